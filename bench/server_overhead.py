"""``python bench/server_load.py overhead``: the server's cost over direct engine calls.

The same engine twice, one in this process (``Engine.stream``) and one behind ``swiftspec serve``,
alternating which goes first per prompt; greedy chat requests, both timed by the client: TTFT =
request to first text, decode tokens/s = (tokens - 1) / (last text - first text); the HTTP client
is built once and kept open, as API clients do. Reports medians and the spread of the paired
differences, and whether the texts are equal.
"""
from __future__ import annotations

import json
import statistics
import time

import httpx


def _timed(t0: float, stamps: list[float], text: str, n: int, engine_tokens_per_s: float) -> dict:
    """Client-side TTFT (request to first text) and decode tokens/s ((n - 1) / first-to-last text)."""
    first, last = stamps[0], stamps[-1]
    return {"ttft_s": first - t0, "tokens": n, "tokens_per_s": (n - 1) / (last - first) if n > 1 and last > first
            else float("nan"), "text": text, "engine_tokens_per_s": engine_tokens_per_s}


def _direct(engine, prompt: str, params) -> dict:
    t0 = time.perf_counter()
    stamps, text, out = [], "", None
    for chunk in engine.stream(prompt, params, chat=True):
        if chunk.text:
            stamps.append(time.perf_counter())
            text += chunk.text
        out = chunk.output or out
    return _timed(t0, stamps, text, len(out.token_ids), out.metrics.tokens_per_s)


def _http(client: httpx.Client, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy chat request over ``client`` (kept open across requests, as API clients
    do: building an ``httpx.Client`` builds an SSL context, client-side time that is not the server's)."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, text, usage, ext = [], "", None, None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            for ch in obj.get("choices", []):
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    stamps.append(time.perf_counter())
                    text += piece
            usage, ext = obj.get("usage") or usage, obj.get("swiftspec") or ext
    return _timed(t0, stamps, text, usage["completion_tokens"], ext["tokens_per_s"])


def _spread(xs: list[float]) -> dict:
    qs = statistics.quantiles(xs, n=10) if len(xs) > 1 else xs * 9
    return {"median": statistics.median(xs), "p10": qs[0], "p90": qs[-1], "min": min(xs), "max": max(xs)}


def overhead(engine, url: str, prompts: list[str], max_tokens: int, repeats: int = 1) -> dict:
    """Paired direct / HTTP runs, ``repeats`` pairs per prompt (see the module docstring)."""
    from swiftspec.model_executor.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    client = httpx.Client(base_url=url, timeout=600)
    _direct(engine, "Hello", SamplingParams(temperature=0.0, max_tokens=4))  # warm both paths
    _http(client, "Hello", 4)
    pairs = []
    for i, prompt in enumerate(p for p in prompts for _ in range(repeats)):
        runs = {}
        for way in (("direct", "http") if i % 2 == 0 else ("http", "direct")):
            runs[way] = _direct(engine, prompt, params) if way == "direct" else _http(client, prompt, max_tokens)
        pairs.append({"prompt": i // repeats, "first": "direct" if i % 2 == 0 else "http", **runs,
                      "ttft_added_ms": 1e3 * (runs["http"]["ttft_s"] - runs["direct"]["ttft_s"]),
                      "tokens_per_s_ratio": runs["http"]["tokens_per_s"] / runs["direct"]["tokens_per_s"],
                      "texts_equal": runs["http"]["text"] == runs["direct"]["text"]})
    client.close()
    return {"prompts": len(prompts), "repeats": repeats, "max_tokens": max_tokens, "pairs": pairs,
            "ttft_added_ms": _spread([p["ttft_added_ms"] for p in pairs]),
            "tokens_per_s_ratio": _spread([p["tokens_per_s_ratio"] for p in pairs]),
            "ttft_direct_s": statistics.median(p["direct"]["ttft_s"] for p in pairs),
            "ttft_http_s": statistics.median(p["http"]["ttft_s"] for p in pairs),
            "tokens_per_s_direct": statistics.median(p["direct"]["tokens_per_s"] for p in pairs),
            "tokens_per_s_http": statistics.median(p["http"]["tokens_per_s"] for p in pairs),
            "texts_equal": sum(p["texts_equal"] for p in pairs)}



def run(url: str, engine_args: list[str], prompts: list[str], max_tokens: int, repeats: int = 1) -> dict:
    """:func:`overhead` against the server at ``url``, the direct engine built in this process from
    the same ``engine_args`` (``swiftspec serve``'s engine flags); prints the summary."""
    import argparse

    from swiftspec.entrypoints import cli

    p = argparse.ArgumentParser()
    cli._add_engine_args(p)
    engine = cli.make_engine(p.parse_args(engine_args))
    try:
        res = overhead(engine, url, prompts, max_tokens, repeats)
    finally:
        engine.close()
    t, s = res["ttft_added_ms"], res["tokens_per_s_ratio"]
    print(f"TTFT direct {res['ttft_direct_s']:.3f} s, HTTP {res['ttft_http_s']:.3f} s; added: median "
          f"{t['median']:.1f} ms (p10 {t['p10']:.1f}, p90 {t['p90']:.1f})")
    print(f"decode tokens/s direct {res['tokens_per_s_direct']:.2f}, HTTP {res['tokens_per_s_http']:.2f}; "
          f"ratio median {s['median']:.4f} (p10 {s['p10']:.4f}, p90 {s['p90']:.4f}); "
          f"texts equal {res['texts_equal']}/{len(res['pairs'])}")
    return res
