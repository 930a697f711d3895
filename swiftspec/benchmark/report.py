"""The end-to-end benchmark's report: per-(system, dataset) totals, the markdown tables (decode
speed, the paper's Table 6 compression layout, the pipeline modes' utilization) and the bar chart
in the layout of the paper's Figure 7."""
from __future__ import annotations

import statistics
from pathlib import Path

from swiftspec.benchmark.systems import SYSTEMS, base_system

ABBREV = {"alpaca": "ALP", "gsm8k": "GSM", "humaneval": "HE", "mt_bench": "MT", "qa": "QA", "sum": "SUM"}
# SwiftSpec paper, Table 6 (Qwen2-72B target, Qwen2-1.5B draft, 8 GPUs): compression ratio
PAPER_TABLE6 = {"swiftspec-async": {"ALP": 2.92, "GSM": 3.78, "HE": 3.92, "MT": 3.11, "QA": 2.74, "SUM": 3.56},
                "swiftspec-serial": {"ALP": 3.28, "GSM": 4.2, "HE": 4.04, "MT": 3.42, "QA": 3.12, "SUM": 3.72}}


def equals_cell(rs: list[dict]) -> str:
    """The "equals target" cell: how many prompts gave the autoregressive tokens, "n/a" where
    that reference did not run."""
    known = [r["matches_target"] for r in rs if r["matches_target"] is not None]
    return f"{sum(known)}/{len(known)}" if known else "n/a"


def summarize(records: list[dict]) -> list[dict]:
    """One row per (system, dataset): totals over its prompts."""
    out = []
    keys = sorted({(r["system"], r["dataset"]) for r in records},
                  key=lambda k: (SYSTEMS.index(base_system(k[0])), k[0], k[1]))
    for system, ds in keys:
        rs = [r for r in records if r["system"] == system and r["dataset"] == ds]
        toks = sum(r["num_tokens"] - 1 for r in rs)
        secs = sum(r["decode_s"] for r in rs)
        out.append({"system": system, "dataset": ds, "prompts": len(rs),
                    "tokens_per_s": toks / secs if secs else float("nan"),
                    "compression_ratio": statistics.mean(r["compression_ratio"] for r in rs),
                    "ttft_s": statistics.mean(r["ttft_s"] for r in rs),
                    "tbt_mean_s": statistics.mean(r["tbt_mean_s"] for r in rs),
                    "tbt_p50_s": statistics.median(r["tbt_p50_s"] for r in rs),
                    "tbt_p99_s": max(r["tbt_p99_s"] for r in rs),
                    "matches_target": equals_cell(rs)})
    return out


def overall(records: list[dict]) -> dict[str, float]:
    """Decode tokens/s of each system over all its prompts."""
    res = {}
    for s in dict.fromkeys(r["system"] for r in records):
        rs = [r for r in records if r["system"] == s]
        secs = sum(r["decode_s"] for r in rs)
        res[s] = sum(r["num_tokens"] - 1 for r in rs) / secs if secs else float("nan")
    return res


def markdown(records: list[dict]) -> str:
    """Decode-speed table (systems x datasets) and a Table-6 style compression table."""
    rows = summarize(records)
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    tot = overall(records)
    base = tot.get("autoregressive")
    get = {(r["system"], r["dataset"]): r for r in rows}
    head = " | ".join(ABBREV.get(d, d) for d in datasets)
    lines = [f"| system | {head} | all | vs autoregressive | TTFT s | TBT p50 ms | TBT p99 ms | equals target |",
             "|" + "---|" * (len(datasets) + 7)]
    for s in systems:
        rs = [get[(s, d)] for d in datasets if (s, d) in get]
        cells = " | ".join(f"{get[(s, d)]['tokens_per_s']:.2f}" if (s, d) in get else "-" for d in datasets)
        rel = f"{tot[s] / base:.2f}x" if base else "-"
        lines.append(f"| {s} | {cells} | {tot[s]:.2f} | {rel} | {statistics.mean(r['ttft_s'] for r in rs):.2f} | "
                     f"{1e3 * statistics.median(r['tbt_p50_s'] for r in rs):.0f} | "
                     f"{1e3 * max(r['tbt_p99_s'] for r in rs):.0f} | {equals_cell([r for r in records if r['system'] == s])} |")
    lines += ["", "Compression ratio (verified tokens per target forward), with the paper's Table 6 "
              "(Qwen2-72B / Qwen2-1.5B on 8 GPUs) for reference:", "",
              f"| system | {head} |", "|" + "---|" * (len(datasets) + 1)]
    for s in systems:
        if s in ("autoregressive", "hf", "hf-compile", "llama-cpp", "pipeline-autoregressive", "pipedec", "pipeinfer"):
            continue
        lines.append(f"| {s} | " + " | ".join(
            f"{get[(s, d)]['compression_ratio']:.2f}" if (s, d) in get else "-" for d in datasets) + " |")
        if s in PAPER_TABLE6:
            lines.append(f"| paper: {s} | " + " | ".join(
                f"{PAPER_TABLE6[s].get(ABBREV.get(d, ''), float('nan')):.2f}" for d in datasets) + " |")
    if pipeline_table(records):
        lines += ["", "Pipeline modes (busy = a stage's forward time / the request's wall time; stage 0 "
                  "also runs the draft):", "", pipeline_table(records)]
    return "\n".join(lines)


def bar_chart(records: list[dict], path: Path, title: str) -> None:
    """Grouped bars of decode tokens/s per dataset and system (the paper's Figure 7 layout)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summarize(records)
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    get = {(r["system"], r["dataset"]): r["tokens_per_s"] for r in rows}
    fig, ax = plt.subplots(figsize=(1.6 * len(datasets) + 3, 4))
    width = 0.8 / len(systems)
    for i, s in enumerate(systems):
        xs = [j + i * width for j in range(len(datasets))]
        ax.bar(xs, [get.get((s, d), 0.0) for d in datasets], width, label=s)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(datasets))], [ABBREV.get(d, d) for d in datasets])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pipeline_table(records: list[dict]) -> str:
    """The pipeline modes' utilization: tokens per timestep, nodes pruned mid-pipeline, busy
    fraction of each stage, KV entries recomputed ("" when no pipeline mode ran)."""
    systems = list(dict.fromkeys(r["system"] for r in records if "pipeline" in r))
    if not systems:
        return ""
    lines = ["| system | tokens per timestep | nodes issued | nodes pruned mid-pipeline | runs cancelled mid-pipeline "
             "| stage busy | draft busy | KV recomputed |", "|---|---|---|---|---|---|---|---|"]
    for s in systems:
        ps = [r["pipeline"] for r in records if r["system"] == s]
        steps = sum(p["timesteps"] for p in ps)
        toks = sum(r["num_tokens"] for r in records if r["system"] == s)
        busy = [statistics.mean(p["stage_busy"][k] for p in ps) for k in range(len(ps[0]["stage_busy"]))]
        lines.append(f"| {s} | {toks / steps:.2f} | {sum(p['issued'] for p in ps)} | {sum(p['pruned'] for p in ps)} | "
                     f"{sum(p.get('cancelled', 0) for p in ps)} | "
                     + " / ".join(f"{b:.0%}" for b in busy) + f" | {statistics.mean(p['draft_busy'] for p in ps):.0%} | "
                     f"{sum(p['recomputed_kv'] for p in ps)} |")
    return "\n".join(lines)


def our_engines(records: list[dict]) -> list[str]:
    """The systems of ``swiftspec bench`` records that are engines of ours (their records carry an
    ``engine`` shape: ``autoregressive`` and the speculative modes; peers have none), in run order."""
    return list(dict.fromkeys(r["system"] for r in records if r.get("engine")))


def ceilings(records: list[dict]) -> dict[str, float]:
    """How far a better choice among the engines of one ``swiftspec bench`` run could go: decode
    tokens/s (over all prompts, as :func:`overall`) of the fastest single system (``"system"``),
    of the fastest system per dataset (``"dataset"``) and of the fastest per prompt (``"prompt"``),
    chosen with hindsight among every engine of ours in the run (records with an ``engine``:
    ``autoregressive`` and the speculative modes; no peer). The per-prompt value is an upper bound
    of any mode choice made per request from these modes, and biased upwards by the machine's
    noise (the minimum of several timings of one prompt). Prompts pair up by their order within
    each (system, dataset), the order ``swiftspec bench`` runs them in.

    Raises:
        ValueError: fewer than two engines of ours, or their prompt counts per dataset differ.
    """
    ours = our_engines(records)
    if len(ours) < 2:
        raise ValueError(f"a ceiling needs two or more of our engines side by side, got {ours}")
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        if r["system"] in ours:
            runs.setdefault((r["system"], r["dataset"]), []).append(r)
    datasets = list(dict.fromkeys(d for _, d in runs))
    counts = {(s, d): len(runs.get((s, d), [])) for s in ours for d in datasets}
    if len(set(counts.values())) != 1:
        raise ValueError(f"the engines ran different prompts: {counts}")

    def rate(rs: list[dict]) -> float:
        return sum(r["num_tokens"] - 1 for r in rs) / sum(r["decode_s"] for r in rs)

    per_dataset = [max((runs[(s, d)] for s in ours), key=rate) for d in datasets]
    per_prompt = [max((runs[(s, d)][i] for s in ours), key=lambda r: rate([r]))
                  for d in datasets for i in range(len(runs[(ours[0], d)]))]
    return {"system": max(overall([r for r in records if r["system"] in ours]).values()),
            "dataset": rate([r for rs in per_dataset for r in rs]), "prompt": rate(per_prompt)}
