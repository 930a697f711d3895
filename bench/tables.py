"""Markdown tables of bench/RESULTS.md, generated from the committed records in bench/results/.

Every record kind the benchmarks write is recognised by its shape:

* ``swiftspec bench --json`` records (a list of per-prompt dicts): the end-to-end table and the
  compression ratios (``swiftspec.benchmark.e2e.markdown``);
* ``bench/kernels.py --json``: the kernel table (``swiftspec.benchmark.kernels.summary_table``);
* ``bench/native_forward.py --out``: forward time against the machine's read bandwidth;
* ``bench/device_forward.py --out``: forward time (eager, CUDA-graph replay) against the HBM limit;
* an end-to-end table kept as ``swiftspec bench`` printed it (``"table"``: its rows), where the
  run's own JSON was not written;
* ``bench/accuracy.py --out``: top-1 agreement and mean KL against llama.cpp;
* ``swiftspec generate --json`` (the README command): one line;
* ``bench/server_load.py soak|overhead --out``: the soak's counts, memory and restart, or the
  server's added TTFT and tokens/s ratio against direct engine calls.

    python bench/tables.py bench/results/run13-avx2-6x5.json [more.json ...]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def render(record) -> str:
    """The markdown of one record file's content. Raises ValueError for an unknown kind."""
    from swiftspec.benchmark import e2e, kernels

    if isinstance(record, dict) and "records" in record:  # swiftspec bench --out, with its machine
        m = record["machine"]
        on_gpu = any(r.get("device") == "cuda" for r in record["records"])
        where = (f"{m.get('gpu', 'a GPU')} (host: {m['cpu']}, {m['cores']} cores)" if on_gpu else
                 f"{m['cpu']} (family {m['cpu_family']}, model {m['cpu_model']}), {m['cores']} cores, kernels {m['isa']}")
        return f"`{record['command']}` on {where}\n\n" + render(record["records"])
    if isinstance(record, dict) and "table" in record:  # a swiftspec bench table kept as printed (e2e.md)
        cols = list(record["table"][0])
        return "\n".join([f"`{record['command']}`: {record['title']}; {record['code']}. Source: {record['source']}", "",
                          "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                         + ["| " + " | ".join(r[c] for c in cols) + " |" for r in record["table"]])
    if isinstance(record, list) and record and "system" in record[0]:
        return e2e.markdown(record)
    if isinstance(record, dict) and "cases" in record:
        return kernels.summary_table(record["cases"])
    if isinstance(record, dict) and record.get("rows") and "limit_s" in record["rows"][0]:  # bench/device_forward.py
        # records from run 35 on: the cache's capacity per row, and the replay without the device-side KV length
        capacity = {r["capacity"] for r in record["rows"] if "capacity" in r}
        lines = [f"{record.get('device_name') or record['device']}, {record['dtype']}, {record['context']} tokens in the "
                 f"KV cache" + (f" of {', '.join(map(str, sorted(capacity)))} slots" if capacity else "")
                 + f", read bandwidth {record['bandwidth_gb_s']:.1f} GB/s",
                 "", "| model | rows | eager ms | graph ms | graph ms, attention over the whole capacity | limit ms | "
                 "of limit |", "|---|---|---|---|---|---|---|"]
        for r in record["rows"]:
            graph, unbounded = (f"{1e3 * r[k]:.3f}" if k in r else "-" for k in ("graph_s", "graph_unbounded_s"))
            lines.append(f"| {r['model']} | {r['rows']} | {1e3 * r['eager_s']:.3f} | {graph} | {unbounded} | "
                         f"{1e3 * r['limit_s']:.3f} | {100 * r['of_limit']:.0f} % |")
        for prof in record.get("profiles", []):
            lines += ["", f"{prof['model']}, {prof['rows']} rows: device time per forward by kernel", "",
                      "| kernel | us per forward | calls |", "|---|---|---|"]
            lines += [f"| `{k['kernel'][:80]}` | {k['us_per_forward']:.1f} | {k['calls']} |" for k in prof["kernels"]]
        return "\n".join(lines)
    if isinstance(record, dict) and "bandwidth_gb_s" in record:
        lines = [f"{record.get('model', 'target')} model, read bandwidth {record['bandwidth_gb_s']:.1f} GB/s, "
                 f"{record['threads']} threads",
                 "", "| weights | kernels | layout | quantized GEMM | rows | ms | weight GB/s | of bandwidth |",
                 "|---|---|---|---|---|---|---|---|"]
        # records from run 30 on probe the bandwidth beside every row count: "of bandwidth" names it
        # older records predate the interleaved layout (their native weights were plain) and the
        # per-row kernel name (the record's dispatch then)
        default = record.get("isa", {}).get("quant_gemm", "-")
        lines += [f"| {r['weights']} | {'on' if r['kernels'] else 'off'} | "
                  f"{r.get('layout', 'plain' if r['weights'] == 'native' else '-')} | "
                  f"{r.get('quant_gemm', default if r['weights'] == 'native' and r['kernels'] else '-')} | "
                  f"{r['rows']} | {r['ms']:.1f} | {r['gb_s']:.1f} | {100 * r['of_bandwidth']:.0f} %"
                  + (f" of {r['bandwidth_gb_s']:.1f} |" if "bandwidth_gb_s" in r else " |")
                  for r in record["rows"]]
        if record.get("prefill"):
            lines += ["", f"prefill ({record.get('dtype', 'float32')} activations, the dispatched kernel)", "",
                      "| prompt tokens | ms | tokens/s |", "|---|---|---|"]
            lines += [f"| {p['tokens']} | {p['ms']:.0f} | {p['tokens_per_s']:.0f} |" for p in record["prefill"]]
        return "\n".join(lines)
    if isinstance(record, dict) and record.get("rows") and "top1_agreement" in record["rows"][0]:
        lines = ["| weights | kernels | tokens | top-1 agreement with llama.cpp | mean KL, nats |", "|---|---|---|---|---|"]
        lines += [f"| {r['weights']} | {'on' if r['kernels'] else 'off'} | {r['tokens']} | {r['top1_agreement']:.4f} | "
                  f"{r['mean_kl_nats']:.2e} |" for r in record["rows"]]
        return "\n".join(lines)
    if isinstance(record, dict) and "metrics" in record and "tokens_per_s" in record:
        m = record["metrics"]
        return (f"{record['num_tokens']} tokens, {record['tokens_per_s']:.2f} tokens/s decode, TTFT "
                f"{record['ttft_s']:.2f} s, mode {record['mode']} ({m.get('mode_reason', '')}), kernels {m.get('kernels')}")
    if isinstance(record, dict) and ("soak" in record or "overhead" in record):
        return _server(record)
    if isinstance(record, dict) and "huge_page_bytes_after_load" in record:  # bench/huge_pages.py
        lines = [f"{record['model']} model, {record['threads']} threads, kernel {record['quant_gemm']}, "
                 f"{record['huge_page_bytes_after_load'] / 2**20:.0f} MiB on huge pages after the load", "",
                 "| rows | huge pages: min ms | median ms | 4 KiB pages: min ms | median ms | speedup: min | median |",
                 "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['rows']} | {r['huge_min_ms']:.1f} | {r['huge_median_ms']:.1f} | {r['4k_min_ms']:.1f} | "
                  f"{r['4k_median_ms']:.1f} | {r['speedup_min']:.3f}x | {r['speedup_median']:.3f}x |" for r in record["results"]]
        return "\n".join(lines)
    raise ValueError("not a record of swiftspec bench, bench/kernels.py, bench/native_forward.py, "
                     "bench/accuracy.py, bench/huge_pages.py, swiftspec generate --json or bench/server_load.py")


def _server(record: dict) -> str:
    """bench/server_load.py's soak (counts, resident memory, restart) or overhead (paired spreads)."""
    if "soak" in record:
        s, r = record["soak"], record["soak"]["restart"]
        lines = ["| mode | requests | valid answered | bad refused (400) | streams dropped | failed |",
                 "|---|---|---|---|---|---|",
                 f"| {', '.join(s['modes'])} | {s['requests']} | {s['valid_answered']}/{s['valid']} | "
                 f"{s['bad_refused_400']}/{s['bad']} | {s['cancelled']} | {len(s['failed'])} |", "",
                 "| process | RSS at request 10, MiB | at request 50, MiB | growth |", "|---|---|---|---|"]
        first, last = (s["rss_mib"][k] for k in sorted(s["rss_mib"], key=int))
        lines += [f"| {p} | {first[p]:.0f} | {last[p]:.0f} | {100 * g:+.1f} % |" for p, g in s["rss_growth"].items()]
        lines += ["", f"Worker killed: the next request got {r['first_status']} after {r['first_s']:.2f} s, "
                      f"`/health` then said `{r['health_after_503']['status']}`, the request after it got "
                      f"{r['next_status']} after {r['next_s']:.1f} s (engine restart {r['restart_s']:.1f} s); "
                      f"processes left after SIGTERM: {len(s['leftover_processes'])}."]
        return "\n".join(lines)
    o = record["overhead"]
    t, q = o["ttft_added_ms"], o["tokens_per_s_ratio"]
    return "\n".join([
        "| pairs | TTFT direct s | TTFT HTTP s | added TTFT ms: median (p10, p90) | decode tokens/s direct | HTTP | "
        "HTTP / direct: median (p10, p90) | texts equal |", "|---|---|---|---|---|---|---|---|",
        f"| {len(o['pairs'])} | {o['ttft_direct_s']:.3f} | {o['ttft_http_s']:.3f} | {t['median']:.1f} ({t['p10']:.1f}, "
        f"{t['p90']:.1f}) | {o['tokens_per_s_direct']:.2f} | {o['tokens_per_s_http']:.2f} | {q['median']:.4f} "
        f"({q['p10']:.4f}, {q['p90']:.4f}) | {o['texts_equal']}/{len(o['pairs'])} |"])


def main(argv: list[str] | None = None) -> int:
    paths = argv if argv is not None else sys.argv[1:]
    if not paths:
        print(__doc__)
        return 2
    for p in paths:
        print(f"## {p}\n\n{render(json.loads(Path(p).read_text()))}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
