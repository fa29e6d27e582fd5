"""Benchmark metrics and the printed report, with vLLM `bench serve`'s fields, names and layout (so results
read side by side with published vLLM numbers), and from the servers' Prometheus endpoints the speculative-decoding
counters, the engine step times (how busy the engines were during the run) and the prefix-cache counters."""

from __future__ import annotations

import math

import numpy as np

from tandem.bench.backends import RequestOutput

SPEC_PREFIX = "tandem:spec_decode_"
STEP_METRIC = "tandem:engine_step_seconds"
STEP_TOKENS_METRIC = "tandem:engine_step_prompt_tokens_total"
CACHE_METRICS = {"tandem:prefix_cache_queries_total": "queries", "tandem:prefix_cache_hits_total": "hits"}
ROUTE_METRIC = "tandem:router_requests_total"


def _stats(values: list[float], percentiles: list[float]) -> dict:
    v = np.asarray(values or [0.0]) * 1000.0  # ms
    out = {"mean": float(v.mean()), "median": float(np.median(v)), "std": float(v.std())}
    out["percentiles"] = [(p, float(np.percentile(v, p))) for p in percentiles]
    return out


def _peaks(ok: list[RequestOutput]) -> tuple[float, int]:
    """Peak output tokens in any one-second bucket of the run, and peak requests in flight at once."""
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    buckets = np.zeros(int(math.ceil(max(o.start_time + o.latency for o in ok) - t0)) + 1)
    for o in ok:
        scale = o.output_tokens / sum(o.chunk_tokens) if sum(o.chunk_tokens) else 0.0
        t = o.start_time + o.ttft
        for gap, n in zip([0.0, *o.itl], o.chunk_tokens):
            t += gap
            buckets[int(t - t0)] += n * scale
    events = sorted([(o.start_time, 1) for o in ok] + [(o.start_time + o.latency, -1) for o in ok])
    level = peak = 0
    for _, d in events:  # a departure sorts before an arrival at the same instant
        level += d
        peak = max(peak, level)
    return float(buckets.max()), peak


def compute(outputs: list[RequestOutput], duration: float, percentiles: list[float]) -> dict:
    ok = [o for o in outputs if o.success]
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    itls = [x for o in ok for x in o.itl]
    total_in, total_out = sum(o.prompt_len for o in ok), sum(o.output_tokens for o in ok)
    peak_tps, peak_conc = _peaks(ok)
    cached = [o.cached_tokens for o in ok if o.cached_tokens is not None]
    m = {
        "duration": duration, "completed": len(ok), "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": peak_tps, "max_concurrent_requests": peak_conc,
    }
    if any(o.turn for o in ok):  # conversations: a later turn's prompt starts with the whole earlier turn
        by_turn = [[o.ttft for o in ok if o.turn == t] for t in range(max(o.turn for o in ok) + 1)]
        m["mean_ttft_ms_by_turn"] = [1000.0 * float(np.mean(v)) if v else 0.0 for v in by_turn]
        m["mean_ttft_ms_first_turn"] = 1000.0 * float(np.mean(by_turn[0] or [0.0]))
        m["mean_ttft_ms_later_turns"] = 1000.0 * float(np.mean([x for v in by_turn[1:] for x in v] or [0.0]))
    if ok and len(cached) == len(ok):  # every response said how many of its prompt tokens were cached
        m.update({"total_cached_input_tokens": sum(cached), "total_computed_input_tokens": total_in - sum(cached),
                  "cached_input_percent": 100.0 * sum(cached) / total_in if total_in else 0.0})
    for name, values in (("ttft", [o.ttft for o in ok]), ("tpot", tpots), ("itl", itls),
                         ("e2el", [o.latency for o in ok])):
        s = _stats(values, percentiles)
        m[f"mean_{name}_ms"], m[f"median_{name}_ms"], m[f"std_{name}_ms"] = s["mean"], s["median"], s["std"]
        for p, v in s["percentiles"]:
            m[f"p{_pword(p)}_{name}_ms"] = v
    return m


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


# ---- speculative decoding (Prometheus counters, summed over every URL: each decode worker exports its own) -----
def parse_spec_metrics(text: str) -> dict | None:
    from prometheus_client.parser import text_string_to_metric_families

    out = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0, "per_pos": {}}
    found = False
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.startswith(SPEC_PREFIX) or not s.name.endswith("_total"):
                continue
            found = True
            key = s.name[len(SPEC_PREFIX):-len("_total")]
            if key == "num_accepted_tokens_per_pos":
                pos = int(s.labels.get("position", 0))
                out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + s.value
            elif key in out:
                out[key] += s.value
    return out if found else None


def merge_spec(parts: list[dict | None]) -> dict | None:
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    out = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0, "per_pos": {}}
    for p in parts:
        for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[k] += p[k]
        for pos, v in p["per_pos"].items():
            out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + v
    return out


def spec_delta(before: dict | None, after: dict | None) -> dict | None:
    """The run's own counts (after - before); None when the server does not speculate or nothing was drafted."""
    if before is None or after is None:
        return None
    drafts = after["num_drafts"] - before["num_drafts"]
    draft_tokens = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    if draft_tokens <= 0:
        return None
    per_pos = [(after["per_pos"].get(p, 0.0) - before["per_pos"].get(p, 0.0)) / drafts if drafts else 0.0
               for p in sorted(set(before["per_pos"]) | set(after["per_pos"]))]
    return {"acceptance_rate": 100.0 * accepted / draft_tokens,
            "acceptance_length": 1.0 + accepted / drafts if drafts else 0.0,
            "num_drafts": int(drafts), "draft_tokens": int(draft_tokens), "accepted_tokens": int(accepted),
            "per_position_acceptance_rates": per_pos}


# ---- engine steps (histogram sums and counts by kind, summed over every worker) -------------------------------
def parse_step_metrics(text: str) -> dict | None:
    """kind -> [steps, seconds, prompt tokens] over the text's `engine_step_seconds` and
    `engine_step_prompt_tokens_total` series; None when there are none."""
    from prometheus_client.parser import text_string_to_metric_families

    fields = {STEP_METRIC + "_count": 0, STEP_METRIC + "_sum": 1, STEP_TOKENS_METRIC: 2}
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in fields:
                out.setdefault(s.labels.get("kind", ""), [0.0, 0.0, 0.0])[fields[s.name]] += s.value
    return out or None


def merge_steps(parts: list[dict | None]) -> dict | None:
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    out = {}
    for p in parts:
        for kind, values in p.items():
            out[kind] = [a + b for a, b in zip(out.get(kind, [0.0, 0.0, 0.0]), values)]
    return out


def steps_delta(before: dict | None, after: dict | None, duration: float) -> dict | None:
    """The run's own steps by kind (count, seconds, mean ms) and the engines' busy share of the run: their step
    seconds over its duration, summed over workers (so up to the number of engines). None without the series."""
    if before is None or after is None:
        return None
    kinds = {}
    for kind, (n, sec, tokens) in sorted(after.items()):
        n0, sec0, tokens0 = before.get(kind, [0.0, 0.0, 0.0])
        if n - n0 > 0:
            kinds[kind] = {"steps": int(n - n0), "seconds": sec - sec0, "mean_ms": 1e3 * (sec - sec0) / (n - n0),
                           "prompt_tokens": int(tokens - tokens0)}
    busy = sum(k["seconds"] for k in kinds.values())
    return {"kinds": kinds, "busy_percent": 100.0 * busy / duration if duration > 0 else 0.0}


# ---- prefix cache (token counters, summed over every worker and per worker; the router's routes) ---------------
def parse_cache_metrics(text: str) -> dict | None:
    """{"queries", "hits", "workers": {worker: {"queries", "hits"}}, "routes": {route: prefills}}: the prompt
    tokens looked up in the workers' prefix caches and those found (in all and by the `worker` label), and the
    router's placements by route where the text has them; None when the text has no prefix-cache series."""
    from prometheus_client.parser import text_string_to_metric_families

    out, found = {"queries": 0.0, "hits": 0.0, "workers": {}, "routes": {}}, False
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in CACHE_METRICS:
                kind = CACHE_METRICS[s.name]
                out[kind] += s.value
                w = out["workers"].setdefault(s.labels.get("worker", "?"), {"queries": 0.0, "hits": 0.0})
                w[kind] += s.value
                found = True
            elif s.name == ROUTE_METRIC:
                route = s.labels.get("route", "?")
                out["routes"][route] = out["routes"].get(route, 0.0) + s.value
    return out if found else None


def merge_cache(parts: list[dict | None]) -> dict | None:
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    out = {k: sum(p[k] for p in parts) for k in ("queries", "hits")}
    out["workers"] = {w: c for p in parts for w, c in p.get("workers", {}).items()}
    out["routes"] = {}
    for p in parts:
        for route, n in p.get("routes", {}).items():
            out["routes"][route] = out["routes"].get(route, 0.0) + n
    return out


def _hits(queried: int, hits: int) -> dict:
    return {"queried_tokens": queried, "cached_tokens": hits, "computed_tokens": queried - hits,
            "hit_rate": 100.0 * hits / queried if queried else 0.0}


def cache_delta(before: dict | None, after: dict | None) -> dict | None:
    """The run's own lookups: queried, cached (hits) and computed (the rest) prompt tokens and the hit rate, in all
    and per worker that looked any up; the router's prefills by route (when its /metrics was given)."""
    if before is None or after is None:
        return None
    out = _hits(int(after["queries"] - before["queries"]), int(after["hits"] - before["hits"]))
    workers = {}
    for w, a in sorted(after.get("workers", {}).items()):
        b = before.get("workers", {}).get(w, {"queries": 0.0, "hits": 0.0})
        if a["queries"] > b["queries"]:
            workers[w] = _hits(int(a["queries"] - b["queries"]), int(a["hits"] - b["hits"]))
    routes = {r: int(n - before.get("routes", {}).get(r, 0.0)) for r, n in sorted(after.get("routes", {}).items())}
    return {**out, "workers": workers, "routes": {r: n for r, n in routes.items() if n}}


# ---- the printed report ------------------------------------------------------------------------------------------
HEADERS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


def render(m: dict, spec: dict | None, max_concurrency: int | None, request_rate: float,
           percentile_metrics: list[str], percentiles: list[float], steps: dict | None = None,
           cache: dict | None = None) -> str:
    """`cache`: {"counters": cache_delta(...) or None} to print the Prefix Cache section (ours), None not to."""
    lines = []

    def row(label, value, fmt="{:<10}"):
        lines.append(f"{label:<40} " + fmt.format(value))

    lines.append(" Serving Benchmark Result ".center(50, "="))
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate != float("inf"):
        row("Request rate configured (RPS):", request_rate, "{:<10.2f}")
    row("Benchmark duration (s):", m["duration"], "{:<10.2f}")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], "{:<10.2f}")
    row("Output token throughput (tok/s):", m["output_throughput"], "{:<10.2f}")
    row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"], "{:<10.2f}")
    row("Peak concurrent requests:", m["max_concurrent_requests"], "{:<10.2f}")
    row("Total token throughput (tok/s):", m["total_token_throughput"], "{:<10.2f}")
    for name in percentile_metrics:
        short, header = HEADERS[name]
        lines.append(header.center(50, "-"))
        row(f"Mean {short} (ms):", m[f"mean_{name}_ms"], "{:<10.2f}")
        row(f"Median {short} (ms):", m[f"median_{name}_ms"], "{:<10.2f}")
        for p in percentiles:
            row(f"P{_pword(p)} {short} (ms):", m[f"p{_pword(p)}_{name}_ms"], "{:<10.2f}")
    if spec is not None:
        lines.append("Speculative Decoding".center(50, "-"))
        row("Acceptance rate (%):", spec["acceptance_rate"], "{:<10.2f}")
        row("Acceptance length:", spec["acceptance_length"], "{:<10.2f}")
        row("Drafts:", spec["num_drafts"])
        row("Draft tokens:", spec["draft_tokens"])
        row("Accepted tokens:", spec["accepted_tokens"])
        if spec["per_position_acceptance_rates"]:
            lines.append("Per-position acceptance (%):")
            for i, r in enumerate(spec["per_position_acceptance_rates"]):
                row(f"  Position {i}:", 100.0 * r, "{:<10.2f}")
    if steps is not None:  # ours: vLLM's report has no such section
        lines.append("Engine Steps".center(50, "-"))
        row("Engine busy (% summed over engines):", steps["busy_percent"], "{:<10.2f}")
        for kind, k in steps["kinds"].items():
            row(f"{kind.capitalize()} steps:", k["steps"])
            row("  mean (ms):", k["mean_ms"], "{:<10.2f}")
            if k["prompt_tokens"]:  # what a prompt token costs in these steps (decode rows' time included)
                row("  mean prompt tokens:", k["prompt_tokens"] / k["steps"], "{:<10.1f}")
                row("  ms per 1k prompt tokens:", 1e6 * k["seconds"] / k["prompt_tokens"], "{:<10.2f}")
    if cache is not None:  # ours: vLLM's report has no such section
        lines.append("Prefix Cache".center(50, "-"))
        if "mean_ttft_ms_first_turn" in m:
            row("Mean TTFT, first turns (ms):", m["mean_ttft_ms_first_turn"], "{:<10.2f}")
            row("Mean TTFT, later turns (ms):", m["mean_ttft_ms_later_turns"], "{:<10.2f}")
        if "total_cached_input_tokens" in m:
            row("Cached input tokens:", m["total_cached_input_tokens"])
            row("Computed input tokens:", m["total_computed_input_tokens"])
            row("Cached share of input (%):", m["cached_input_percent"], "{:<10.2f}")
        else:
            row("Cached input tokens:", "absent (not in the responses)")
        c = cache["counters"]
        if c is None:
            row("Worker cache counters:", "absent (no tandem:prefix_cache_* at --metrics-url)")
        else:
            row("Worker queried tokens:", c["queried_tokens"])
            row("Worker cached tokens:", c["cached_tokens"])
            row("Worker computed tokens:", c["computed_tokens"])
            row("Worker cache hit rate (%):", c["hit_rate"], "{:<10.2f}")
            for w, wc in c.get("workers", {}).items():
                row(f"  {w} hit rate (%):", wc["hit_rate"], "{:<10.2f}")
            if c.get("routes"):
                row("Router prefills by route:", ", ".join(f"{r} {n}" for r, n in c["routes"].items()))
    lines.append("=" * 50)
    return "\n".join(lines)
