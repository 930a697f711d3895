"""Markdown of bench/server_load.py's records (for bench/tables.py): the soak (counts, resident
memory, the attack cases mixed in, engine restarts, the killed worker), the overhead (paired
spreads) and the attack run (each case's outcome)."""
from __future__ import annotations


def server(record: dict) -> str:
    """bench/server_load.py's soak (counts, resident memory, attacks, restart) or overhead (paired spreads)."""
    if "soak" in record:
        return _soak(record["soak"])
    o = record["overhead"]
    t, q = o["ttft_added_ms"], o["tokens_per_s_ratio"]
    return "\n".join([
        "| pairs | TTFT direct s | TTFT HTTP s | added TTFT ms: median (p10, p90) | decode tokens/s direct | HTTP | "
        "HTTP / direct: median (p10, p90) | texts equal |", "|---|---|---|---|---|---|---|---|",
        f"| {len(o['pairs'])} | {o['ttft_direct_s']:.3f} | {o['ttft_http_s']:.3f} | {t['median']:.1f} ({t['p10']:.1f}, "
        f"{t['p90']:.1f}) | {o['tokens_per_s_direct']:.2f} | {o['tokens_per_s_http']:.2f} | {q['median']:.4f} "
        f"({q['p10']:.4f}, {q['p90']:.4f}) | {o['texts_equal']}/{len(o['pairs'])} |"])


def _soak(s: dict) -> str:
    r = s["restart"]
    first_at, last_at = sorted(s["rss_mib"], key=int)
    lines = ["| mode | requests | valid answered | bad refused (400) | streams dropped | failed |",
             "|---|---|---|---|---|---|",
             f"| {', '.join(s['modes'])} | {s['requests']} | {s['valid_answered']}/{s['valid']} | "
             f"{s['bad_refused_400']}/{s['bad']} | {s['cancelled']} | {len(s['failed'])} |", "",
             f"| process | RSS at request {first_at}, MiB | at request {last_at}, MiB | growth |", "|---|---|---|---|"]
    first, last = s["rss_mib"][first_at], s["rss_mib"][last_at]
    lines += [f"| {p} | {first[p]:.0f} | {last[p]:.0f} | {100 * g:+.1f} % |" for p, g in s["rss_growth"].items()]
    if "attacks" in s:
        a, n = s["attacks"], s["restarts"]
        lines += ["", "Attack cases between the waves (after request N):", "", *_case_rows(a["cases"], True), "",
                  f"{a['passed']}/{a['total']} cases as expected; engine restarts during the soak: {n['total']} "
                  f"({n['intended']} intended, {n['unintended']} not)."]
    lines += ["", f"Worker killed: the next request got {r['first_status']} after {r['first_s']:.2f} s, "
                  f"`/health` then said `{r['health_after_503']['status']}`, the request after it got "
                  f"{r['next_status']} after {r['next_s']:.1f} s (engine restart {r['restart_s']:.1f} s); "
                  f"processes left after SIGTERM: {len(s['leftover_processes'])}."]
    return "\n".join(lines)


def _case_rows(cases: list[dict], after: bool = False) -> list[str]:
    """The table of attack cases: status (and the one expected), engine restart, ``/health`` after,
    memory delta, leftovers, the note; ``after``: with the request each came after."""
    lines = [("| after request " if after else "") + "| case | what | HTTP status (expected) | engine restarted "
             "(expected) | `/health` after | RSS delta, MiB | leftover processes / shm segments | as expected | note |",
             "|---" * (10 if after else 9) + "|"]
    for c in cases:
        status = "-" if c.get("status") is None else c["status"]
        expected = "-" if c["expected_status"] is None else c["expected_status"]
        lines.append((f"| {c['after_request']} " if after else "") +
                     f"| {c['case']} | {c['what']} | {status} ({expected}) | {'yes' if c['restarted'] else 'no'} "
                     f"({'yes' if c['restart_expected'] else 'no'}) | {c['health_after']['code']} | "
                     f"{c['rss_delta_mib']:+.1f} | {len(c['leftover_processes'])} / {len(c['leftover_shm'])} | "
                     f"{'yes' if c['ok'] else '**no**'} | {(c.get('note') or c.get('error') or '').replace('|', '/')} |")
    return lines


def attacks(a: dict) -> str:
    """bench/server_load.py attack: per case its status (and the one expected), engine restart,
    ``/health`` after, memory delta and leftovers."""
    return "\n".join(_case_rows(a["cases"]) + ["", f"{a['passed']}/{a['total']} cases as expected; after SIGTERM "
                                                    f"{len(a['leftover_processes_at_exit'])} processes and "
                                                    f"{len(a['leftover_shm_at_exit'])} shared-memory segments were left."])
