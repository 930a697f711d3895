"""Markdown tables of README.md and bench/RESULTS.md, generated from the committed records in bench/results/.

Every record kind the benchmarks write is recognised by its shape:

* ``swiftspec bench --json`` records (a list of per-prompt dicts): the end-to-end table and the
  compression ratios (``swiftspec.benchmark.report.markdown``);
* ``bench/kernels.py --json``: the kernel table (``swiftspec.benchmark.kernel_timing.summary_table``);
* ``bench/native_forward.py --out``: forward time against the machine's read bandwidth;
* ``bench/device_forward.py --out``: forward time (eager, CUDA-graph replay) against the HBM limit;
* an end-to-end table kept as ``swiftspec bench`` printed it (``"table"``: its rows), where the
  run's own JSON was not written;
* ``bench/accuracy.py --out``: top-1 agreement and mean KL against llama.cpp;
* ``swiftspec generate --json`` (the README command): one line;
* ``bench/server_load.py soak|overhead|attack --out``: the soak's counts, memory and restart, the
  server's added TTFT and tokens/s ratio against direct engine calls, or each attack case's outcome;
* ``bench/shared_core.py --out`` (one run, or several under ``runs``): tokens/s per core layout;
* ``scripts/gpu_probe.py --out``: each multi-process GPU check's status.

Generated blocks: in README.md and bench/RESULTS.md every measured number stands between two
markers that name what produced it, ``KIND FILE [FILE ...]`` (files under bench/results/)::

    <!-- tables:begin summary run38-zen3-6x5.json -->
    ...generated text, never edited by hand...
    <!-- tables:end summary run38-zen3-6x5.json -->

KIND is ``record`` (:func:`render` of one record: all its tables), ``summary`` (the compact
end-to-end table of ``swiftspec bench`` records, with the machine and the command that
reproduces it), ``generate`` (``swiftspec generate --json`` records, one row each), ``ceiling``
(``swiftspec bench`` records: the default configuration against the fastest of our engines per
run, dataset and prompt, chosen with hindsight) or ``steps`` (a GPU forward record's step table).

    python bench/tables.py bench/results/run13-avx2-6x5.json [more.json ...]   # print records' tables
    python bench/tables.py --check    # every marked block equals what its records give (exit 1: a diff)
    python bench/tables.py --write    # regenerate every marked block in place
"""
from __future__ import annotations

import argparse
import difflib
import json
import re
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# the documents whose marked blocks --check / --write regenerate
DOCUMENTS = ("README.md", "bench/RESULTS.md")
BLOCK = re.compile(r"<!-- tables:begin (?P<spec>[^>\n]+?) -->\n(?P<body>.*?)<!-- tables:end (?P=spec) -->", re.S)
BEGIN = re.compile(r"<!-- tables:begin ")
if str(ROOT / "bench") not in sys.path:  # loaded by path (the tests): its sibling server_tables
    sys.path.insert(0, str(ROOT / "bench"))
import server_tables


def render(record) -> str:
    """The markdown of one record file's content. Raises ValueError for an unknown kind."""
    from swiftspec.benchmark import kernel_timing, report

    if isinstance(record, dict) and "records" in record:  # swiftspec bench --out, with its machine
        m = record["machine"]
        on_gpu = any(r.get("device") == "cuda" for r in record["records"])
        where = (f"{m.get('gpu', 'a GPU')} (host: {m['cpu']}, {m['cores']} cores)" if on_gpu else
                 f"{m['cpu']} (family {m['cpu_family']}, model {m['cpu_model']}), {m['cores']} cores, kernels "
                 + ", ".join(f"{op} `{isa}`" for op, isa in (_engine_kernels(record) or m["isa"]).items()))
        return f"`{_command(record)}` on {where}\n\n" + render(record["records"])
    if isinstance(record, dict) and "table" in record:  # a swiftspec bench table kept as printed (e2e.md)
        cols = list(record["table"][0])
        return "\n".join([f"`{record['command']}`: {record['title']}; {record['code']}. Source: {record['source']}", "",
                          "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                         + ["| " + " | ".join(r[c] for c in cols) + " |" for r in record["table"]])
    if isinstance(record, list) and record and "system" in record[0]:
        return report.markdown(record)
    if isinstance(record, dict) and str(record.get("probe", "")).startswith("swiftspec scripts/gpu_probe.py"):
        return _probe(record)
    if isinstance(record, dict) and "cases" in record:
        return kernel_timing.summary_table(record["cases"])
    if isinstance(record, dict) and record.get("rows") and "limit_s" in record["rows"][0]:  # bench/device_forward.py
        # newer records hold the cache's capacity per row, and the replay without the device-side KV length
        capacity = {r["capacity"] for r in record["rows"] if "capacity" in r}
        # on CUDA the limit came from a device-to-device copy: its bytes (read + write) halved, about half
        # of what the HBM can read, so "of limit" there is no fraction of the read bandwidth
        d2d = record["device"] == "cuda" and "bandwidth_method" not in record
        if "bandwidth_method" in record:  # the read-only limit, the spec sheet and r beside it
            return _device_forward(record, capacity)
        limit = (f", limit: weight bytes over {record['bandwidth_gb_s']:.1f} GB/s, a device-to-device copy's bytes "
                 f"(read + write) halved, about half the HBM's read bandwidth (to be re-measured with a read-only "
                 f"pass)" if d2d else f", read bandwidth {record['bandwidth_gb_s']:.1f} GB/s")
        lines = [f"{record.get('device_name') or record['device']}, {record['dtype']}, {record['context']} tokens in the "
                 f"KV cache" + (f" of {', '.join(map(str, sorted(capacity)))} slots" if capacity else "") + limit,
                 "", "| model | rows | eager ms | graph ms | graph ms, attention over the whole capacity | "
                 + ("d2d-copy limit ms | of d2d-copy limit |" if d2d else "limit ms | of limit |"),
                 "|---|---|---|---|---|---|---|"]
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
        # newer records probe the bandwidth beside every row count: "of bandwidth" names it;
        # older records predate the interleaved layout (their native weights were plain) and the
        # per-row kernel name (the record's dispatch then)
        default = record.get("isa", {}).get("quant_gemm", "-")
        lines += [f"| {r['weights']} | {'on' if r['kernels'] else 'off'} | "
                  f"{r.get('layout', 'plain' if r['weights'] == 'native' else '-')} | "
                  f"{r.get('quant_gemm', default if r['weights'] == 'native' and r['kernels'] else '-')} | "
                  f"{r['rows']} | {r['ms']:.1f} | {r['gb_s']:.1f} | {100 * r['of_bandwidth']:.0f} %"
                  + (f" of {r['bandwidth_gb_s']:.1f} |" if "bandwidth_gb_s" in r else " |")
                  for r in record["rows"]]
        if record.get("tuning"):  # what swiftspec.ops.tuning chose for this model, and its summed times
            t = record["tuning"]
            lines += ["", f"self-tuning ({t['source']}, rows {', '.join(map(str, t['rows']))}): {t['variant']}; "
                      + ", ".join(f"{v} {ms:.1f} ms" for v, ms in t["times_ms"].items())]
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
        return server_tables.server(record)
    if isinstance(record, dict) and "attack" in record:
        return server_tables.attacks(record["attack"])
    if isinstance(record, dict) and "huge_page_bytes_after_load" in record:  # bench/huge_pages.py
        lines = [f"{record['model']} model, {record['threads']} threads, kernel {record['quant_gemm']}, "
                 f"{record['huge_page_bytes_after_load'] / 2**20:.0f} MiB on huge pages after the load", "",
                 "| rows | huge pages: min ms | median ms | 4 KiB pages: min ms | median ms | speedup: min | median |",
                 "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['rows']} | {r['huge_min_ms']:.1f} | {r['huge_median_ms']:.1f} | {r['4k_min_ms']:.1f} | "
                  f"{r['4k_median_ms']:.1f} | {r['speedup_min']:.3f}x | {r['speedup_median']:.3f}x |" for r in record["results"]]
        return "\n".join(lines)
    if isinstance(record, dict) and record.get("kind") == "engine_speed_before_after":
        return _engine_speed(record)
    if isinstance(record, dict) and record.get("kind") == "engine_start":
        import engine_start

        return engine_start.table(record)
    if isinstance(record, dict) and "layout" in (record.get("runs") or [record])[0].get("rows", [{}])[0]:
        return _shared_core(record)
    raise ValueError("not a record of swiftspec bench, bench/kernels.py, bench/native_forward.py, "
                     "bench/accuracy.py, bench/huge_pages.py, bench/shared_core.py, bench/engine_speed.py, "
                     "bench/engine_start.py, swiftspec "
                     "generate --json or bench/server_load.py")


def _shared_core(record: dict) -> str:
    """bench/shared_core.py: median tokens/s of each layout per run (a record of several runs holds
    them under ``runs``), and each serial rep's time over "autoregressive plus the draft's cost"."""
    runs = record.get("runs", [record])
    layouts = [r["layout"] for r in runs[0]["rows"]]
    lines = ["| run | " + " | ".join(f"{name} tokens/s" for name in layouts)
             + " | serial-shared / (autoregressive + draft) |", "|---|" + "---|" * (len(layouts) + 1)]
    for i, run in enumerate(runs, 1):
        rows = {r["layout"]: r for r in run["rows"]}
        ratio = rows.get("serial-shared", {}).get("vs_autoregressive_plus_draft")
        lines.append(f"| {i} | " + " | ".join(f"{rows[name]['median_tokens_per_s']:.1f}" for name in layouts)
                     + f" | {', '.join(f'{x:.2f}' for x in ratio) if ratio else '-'} |")
    return "\n".join(lines)


def _engine_speed(record: dict) -> str:
    """bench/engine_speed.py: decode tokens/s per tree, mode and prompt, in the order the trees
    ran, each tree's mean over its runs and prompts, and whether every tree generated the same ids."""
    modes = [k for k in record["runs"][0] if isinstance(record["runs"][0][k], list) and not k.endswith("_tokens")]
    lines = ["| tree | " + " | ".join(f"{m} tokens/s" for m in modes) + " |", "|---|" + "---|" * len(modes)]
    lines += [f"| {r['tree']} | " + " | ".join(" / ".join(f"{v:.2f}" for v in r[m]) for m in modes) + " |"
              for r in record["runs"]]
    trees = list(dict.fromkeys(r["tree"] for r in record["runs"]))
    lines += [f"| mean of {t} | " + " | ".join(
        f"{statistics.mean(v for r in record['runs'] if r['tree'] == t for v in r[m]):.2f}" for m in modes) + " |"
              for t in trees]
    same = len({r[f"{m}_ids_hash"] for r in record["runs"] for m in modes}) == 1
    return "\n".join(lines + ["", f"same generated ids in every run and mode: {'yes' if same else 'no'}"])


def _device_forward(record: dict, capacity: set) -> str:
    """A bench/device_forward.py record that measured the read bandwidth with a read-only pass: per
    model and row count the best time's r (over one row), and its share of the read-bandwidth and
    spec-sheet limits."""
    spec = record.get("spec_sheet_gb_s")
    head = (f"{record.get('device_name') or record['device']}, {record['dtype']}, {record['context']} tokens in the KV "
            f"cache" + (f" of {', '.join(map(str, sorted(capacity)))} slots" if capacity else "")
            + f"; read bandwidth {record['bandwidth_gb_s']:.0f} GB/s ({record['bandwidth_method']})"
            + (f", spec sheet {spec:.0f} GB/s" if spec else "")
            + (f", a d2d copy {record['copy_gb_s']:.0f} GB/s" if record.get("copy_gb_s") else ""))
    lines = [head, "", "| model | rows | eager ms | graph ms | r (vs one row) | read limit ms | of read limit | "
             "of spec sheet |", "|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        graph = f"{1e3 * r['graph_s']:.3f}" if "graph_s" in r else "-"
        lines.append(f"| {r['model']} | {r['rows']} | {1e3 * r['eager_s']:.3f} | {graph} | "
                     f"{r.get('vs_one_row', float('nan')):.2f} | {1e3 * r['limit_s']:.3f} | {100 * r['of_limit']:.0f} % | "
                     + (f"{100 * r['of_spec_sheet']:.0f} % |" if "of_spec_sheet" in r else "- |"))
    return "\n".join(lines)


def _probe(record: dict) -> str:
    """scripts/gpu_probe.py: each check's status (and its reason where it did not pass)."""
    cuda = record.get("cuda", {})
    lines = [f"{cuda.get('name', 'no GPU')} ({cuda.get('torch', '?')}), {record['started']}", "",
             "| check | status | reason |", "|---|---|---|"]
    for name, check in record["checks"].items():
        lines.append(f"| {name} | {check.get('status')} | {check.get('reason') or ''} |")
    return "\n".join(lines)


# the peers' rows in a summary table
PEERS = {"llama-cpp": "llama.cpp on the same GGUF", "llama-cpp-spec": "llama.cpp speculative (the draft's GGUF, chains of 4)",
         "hf": "transformers `generate`", "hf-compile": "transformers, static cache + `torch.compile`",
         "hf-assisted": "transformers assisted generation",
         "llama-cpp-lookup": "llama.cpp prompt lookup on the same GGUF"}


def _load(name: str, results: Path = RESULTS):
    return json.loads((results / name).read_text())


def _command(record: dict) -> str:
    """The record's command as it reproduces it: where its output went left out, its environment set."""
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(record["machine"].get("env", {}).items())
           # where models live, which tests run; whether the quantized GEMM was tuned (the record's
           # isa names the variant that ran and why: quant_gemm_variant, quant_gemm_choice)
           if k not in ("SWIFTSPEC_CACHE", "SWIFTSPEC_REAL_MODELS", "SWIFTSPEC_KERNEL_TUNING")]
    return " ".join(env + [re.sub(r" --out \S+", "", record["command"])])


def _engine_kernels(record: dict) -> dict | None:
    """The CPU kernels a ``swiftspec bench --out`` record's first SwiftSpec engine ran (its workers'
    self-tuned variant and why); None where no record has them (older records, peers only: the
    bench process's own dispatch, ``machine.isa``, stands in)."""
    return next((r["kernels"] for r in record["records"] if r.get("kernels")), None)


def _machine(record: dict, records: list[dict]) -> str:
    """One line: the hardware, software and workload of a ``swiftspec bench --out`` record."""
    m = record["machine"]
    host = f"{m['cores']} cores of an {m['cpu']} (family {m['cpu_family']}, model {m['cpu_model']})"
    ran = _engine_kernels(record)
    kernels = ran or m["isa"] or {}
    variant = (f" (`{ran['quant_gemm_variant']}`, {ran.get('quant_gemm_choice', 'rule')})"
               if ran and "quant_gemm_variant" in ran else "")
    where = (f"{m['gpu']}, host {host}" if "gpu" in m else f"{host}, quantized GEMM kernel `{kernels['quant_gemm']}`{variant}")
    soft = f"torch {m['torch']}" + (f", llama-cpp-python {m['llama_cpp']['version']}" if m.get("llama_cpp") else "")
    ar = [r for r in records if r["system"] == records[0]["system"]]
    datasets = list(dict.fromkeys(r["dataset"] for r in ar))
    per = len(ar) // len(datasets)
    stored = {r["engine"]["weights"] for r in records if r.get("engine")}
    shapes = [re.search(rf"--{flag}-config (\S+)", record["command"]) for flag in ("target", "draft")]
    pair = (" / ".join(f"`{m_.group(1)}`" if m_ else "the default's" for m_ in shapes) + " shapes"
            if any(shapes) else "the default pair's shapes")
    weights = (f"random weights of {pair}, the default pair's recorded acceptance replayed"
               if any(r.get("replayed") for r in records) else
               "GGUF weights as stored" if stored == {"native"} else f"weights {', '.join(sorted(stored))}")
    dtype = ", ".join(sorted({r["dtype"] for r in records}))
    return (f"{where}; {soft}; {weights}, {dtype} activations; {len(datasets)} datasets x {per} "
            f"prompt{'s' if per > 1 else ''}, greedy")


def _what_ran(system: str, rs: list[dict]) -> str:
    """What a system of a ``swiftspec bench`` record ran, from its records' engine shape."""
    eng = rs[0].get("engine")
    if eng is None:
        peer = rs[0].get("peer")  # the proposer's parameters, where the peer has any
        return PEERS.get(system, system) + (f" ({', '.join(f'{k} {v}' for k, v in peer.items())})" if peer else "")
    mode = eng["mode"]
    parts = [{"autoregressive": "target alone", "ngram": "`ngram` (prompt lookup)"}.get(mode, f"`{mode}`")]
    if mode in ("serial", "async", "colocated"):
        parts.append(f"bs {eng['bs']}" + (f", d {eng['d']}" if eng.get("d") else ""))
    if mode == "hybrid" and eng.get("hybrid_rows"):
        parts.append(f"d {eng['d']}, up to {eng['hybrid_rows']} rows")
    if eng.get("ngram_tokens"):
        k = eng["ngram_tokens"]
        parts.append(f"up to {k} n-gram tokens, as many as matched" if eng.get("ngram_adaptive")
                     else f"{k} n-gram token{'s' if k > 1 else ''}")
    if eng.get("draft_payback") and mode in ("serial", "hybrid"):  # the modes the gate acts in
        parts.append("payback gate")
    if eng.get("draft_sms"):
        parts.append(f"draft on {eng['draft_sms']} SMs")
    if eng.get("target_tp", 1) > 1:
        parts.append(f"TP {eng['target_tp']}")
    alone = sum(r.get("ran") in ("autoregressive", "ngram") and r.get("ran") != mode for r in rs)  # the gate's
    if alone:
        parts.append(f"target alone on {alone} of {len(rs)} requests")
    return ", ".join(parts)


def _equals(system: str, rs: list[dict]) -> str:
    got = [r.get("matches_target") for r in rs]
    if all(g is None for g in got):
        return "reference" if system == "autoregressive" else "n/a"
    own = " (own numerics)" if rs[0].get("engine") is None else ""
    return f"{sum(bool(g) for g in got)}/{sum(g is not None for g in got)}{own}"


def summary(names: list[str], results: Path = RESULTS) -> str:
    """The compact end-to-end table of one or more ``swiftspec bench --out`` records (one machine):
    per system decode tokens/s over all prompts, its ratio to our autoregressive and to llama.cpp of
    the same record, mean time to first token, greedy equality with the target, the compression
    ratio's range over the datasets; then the machine once and the command of each record."""
    from swiftspec.benchmark.report import overall

    recs = [_load(n, results) for n in names]
    tots = [overall(r["records"]) for r in recs]
    llama = any("llama-cpp" in t for t in tots)
    rows = []
    for k, (rec, tot) in enumerate(zip(recs, tots)):
        for system, tps in tot.items():
            rs = [r for r in rec["records"] if r["system"] == system]
            by_ds = {}
            for r in rs:
                by_ds.setdefault(r["dataset"], []).append(r["compression_ratio"])
            cr = sorted(statistics.mean(v) for v in by_ds.values())
            rows.append({"record": str(k + 1), "system": f"`{system}`", "what ran": _what_ran(system, rs),
                         "tokens/s": f"{tps:.2f}",
                         "vs our autoregressive": f"{tps / tot['autoregressive']:.2f}x" if "autoregressive" in tot else "-",
                         "vs llama.cpp": f"{tps / tot['llama-cpp']:.2f}x" if "llama-cpp" in tot else "-",
                         "TTFT s": f"{statistics.mean(r['ttft_s'] for r in rs):.2f}",
                         "equals target": _equals(system, rs),
                         "compression ratio": f"{cr[0]:.2f}" + (f"-{cr[-1]:.2f}" if cr[-1] != cr[0] else "")})
    cols = (["record"] if len(recs) > 1 else []) + ["system", "what ran", "tokens/s", "vs our autoregressive"] \
        + (["vs llama.cpp"] if llama else []) + ["TTFT s"] \
        + (["equals target"] if any(r["equals target"] not in ("n/a", "reference") for r in rows) else []) \
        + ["compression ratio"]
    machines = {_machine(r, r["records"]) for r in recs}
    if len(machines) != 1:
        raise ValueError(f"summary of records from different machines: {sorted(machines)}")
    head = {"tokens/s": "decode tokens/s", "TTFT s": "time to first token, s"}
    lines = [f"Machine: {machines.pop()}.", "",
             "| " + " | ".join(head.get(c, c) for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r[c] for c in cols) + " |" for r in rows]
    lines.append("")
    for k, (name, rec) in enumerate(zip(names, recs)):
        lines.append((f"- record {k + 1}, " if len(recs) > 1 else "Record ")
                     + f"`bench/results/{name}`, command: `{_command(rec)}`")
    return "\n".join(lines)


def ceiling(names: list[str], results: Path = RESULTS) -> str:
    """The mode-choice ceilings of ``swiftspec bench --out`` records (``report.ceilings``): per record
    the default configuration (``auto``), then the fastest of our engines over the run, per dataset
    and per prompt with hindsight, each as decode tokens/s and its ratio to llama.cpp of the same
    run; then each record's command."""
    from swiftspec.benchmark.report import ceilings, our_engines, overall

    lines = ["| record | our engines side by side | default configuration | fastest engine | fastest per dataset "
             "| fastest per prompt |", "|---|---|---|---|---|---|"]
    cmds = []
    for name in names:
        rec = _load(name, results)
        tot = overall(rec["records"])
        llama = tot.get("llama-cpp")
        auto = next((s for s in tot if s in ("swiftspec-profiled", "swiftspec-profiled[auto]")), None)

        def cell(tps: float | None) -> str:
            return "-" if tps is None else f"{tps:.2f}" + (f" ({tps / llama:.2f}x)" if llama else "")

        c = ceilings(rec["records"])
        lines.append(f"| `{name}` | {len(our_engines(rec['records']))} | {cell(tot.get(auto))} | {cell(c['system'])} | "
                     f"{cell(c['dataset'])} | {cell(c['prompt'])} |")
        cmds.append(f"- `{name}`: `{_command(rec)}`")
    return "\n".join(lines + ["", "Decode tokens/s (x llama.cpp of the same run). Commands:", ""] + cmds)


def generate_rows(names: list[str], results: Path = RESULTS) -> str:
    """``swiftspec generate --json`` records (the README command), one row each."""
    lines = ["| record | mode | tokens | decode tokens/s | time to first token, s | compression ratio |",
             "|---|---|---|---|---|---|"]
    for name in names:
        r = _load(name, results)
        lines.append(f"| {name} | {r['mode']} | {r['num_tokens']} | {r['tokens_per_s']:.2f} | {r['ttft_s']:.2f} | "
                     f"{r['compression_ratio']:.2f} |")
    return "\n".join(lines)


def block(spec: str, results: Path = RESULTS) -> str:
    """The text of the generated block whose marker holds ``spec``: ``KIND FILE [FILE ...]``."""
    kind, *names = spec.split()
    if not names:
        raise ValueError(f"block {spec!r}: no record named")
    if kind == "record" and len(names) == 1:
        rec = _load(names[0], results)
        head = f"Record `bench/results/{names[0]}`"
        if isinstance(rec, dict) and "records" not in rec and "table" not in rec:  # those two name their command
            cmd = _record_command(rec)
            head += f", command: `{cmd}`" if cmd else ""
        return f"{head}:\n\n{render(rec)}"
    if kind == "summary":
        return summary(names, results)
    if kind == "generate":
        return generate_rows(names, results)
    if kind == "ceiling":
        return ceiling(names, results)
    if kind == "steps" and len(names) == 1:
        return steps(names[0], results)
    raise ValueError(f"block {spec!r}: KIND is record (one file), summary, generate, ceiling or steps (one file)")


def _record_command(rec: dict) -> str | None:
    """The command a benchmark record was written by (its ``command``, or ``argv`` run with python)."""
    return rec.get("command") or ("python " + shlex.join(rec["argv"]) if "argv" in rec else None)


def steps(name: str, results: Path = RESULTS) -> str:
    """The compact step table of a bench/device_forward.py record with the read-only limit: per
    model its one-row step (CUDA graph) against the read bandwidth and the spec sheet, and r at
    the largest row count measured."""
    rec = _load(name, results)
    if "bandwidth_method" not in rec:
        raise ValueError(f"{name}: a steps block needs a record with the read-only bandwidth")
    models = list(dict.fromkeys(r["model"] for r in rec["rows"]))
    measured = {r["rows"] for r in rec["rows"]}
    widest = 8 if 8 in measured else max(measured)  # 8: the verification's bs on a GPU
    lines = [f"{rec.get('device_name') or rec['device']}, {rec['dtype']}; read bandwidth {rec['bandwidth_gb_s']:.0f} "
             f"GB/s measured in the same run ({rec['bandwidth_method']}), spec sheet "
             f"{rec.get('spec_sheet_gb_s') or float('nan'):.0f} GB/s.", "",
             f"| model | one-row step, graph ms | of read limit | of spec sheet | r at {widest} rows |",
             "|---|---|---|---|---|"]
    for m in models:
        one = next(r for r in rec["rows"] if r["model"] == m and r["rows"] == 1)
        wide = next(r for r in rec["rows"] if r["model"] == m and r["rows"] == widest)
        lines.append(f"| `{m}` | {1e3 * one.get('graph_s', one['eager_s']):.2f} | {100 * one['of_limit']:.0f} % | "
                     f"{100 * one.get('of_spec_sheet', float('nan')):.0f} % | {wide.get('vs_one_row', float('nan')):.2f} |")
    cmd = re.sub(r" --out \S+", "", _record_command(rec) or "")
    return "\n".join(lines + ["", f"Record `bench/results/{name}`" + (f", command: `{cmd}`" if cmd else "")])


def regenerate(text: str, results: Path = RESULTS) -> str:
    """``text`` with the body of every marked block replaced by what its records give."""
    if len(BEGIN.findall(text)) != len(BLOCK.findall(text)):
        raise ValueError("a '<!-- tables:begin SPEC -->' marker without its '<!-- tables:end SPEC -->'")
    return BLOCK.sub(lambda m: f"<!-- tables:begin {m['spec']} -->\n{block(m['spec'], results)}\n"
                               f"<!-- tables:end {m['spec']} -->", text)


def specs(text: str) -> list[str]:
    """The specs of the marked blocks in ``text``, in order."""
    return [m["spec"] for m in BLOCK.finditer(text)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="*", help="record files whose tables to print")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="compare every marked block with what its records give")
    mode.add_argument("--write", action="store_true", help="regenerate every marked block in place")
    args = ap.parse_args(argv)
    if args.check or args.write:
        stale = 0
        for doc in DOCUMENTS:
            path = ROOT / doc
            text = path.read_text()
            new = regenerate(text)
            print(f"{doc}: {len(specs(text))} generated blocks" + ("" if new == text else ", out of date"))
            if new != text:
                stale += 1
                if args.write:
                    path.write_text(new)
                else:
                    sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                               f"{doc} (committed)", f"{doc} (from the records)"))
        return 1 if stale and args.check else 0
    if not args.records:
        ap.print_help()
        return 2
    for p in args.records:
        print(f"## {p}\n\n{render(json.loads(Path(p).read_text()))}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
