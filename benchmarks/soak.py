"""Soak: many requests at a fixed concurrency against `tandem serve` (CPU by default), then checks that none
failed, nothing stayed allocated (blocks, slots, leases, router requests) and every process's resident memory
stayed flat after warm-up.

    .venv/bin/python benchmarks/soak.py --requests 2000 --concurrency 64

Prints a JSON report; exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import requests

from tandem import SamplingParams
from tandem.launch import ServeProcess


def rss_by_process(root: psutil.Process) -> dict[str, int]:
    """Resident bytes of `tandem serve` and each child, keyed by the child's role and worker name."""
    out = {"serve": root.memory_info().rss}
    for p in root.children(recursive=True):
        try:
            cmd = p.cmdline()
            name = cmd[cmd.index("--worker-name") + 1] if "--worker-name" in cmd else str(p.pid)
            out[name] = p.memory_info().rss
        except (psutil.NoSuchProcess, ValueError):
            pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prefill-workers", type=int, default=2)
    ap.add_argument("--decode-workers", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32, help="per request: uniform in [1, this]")
    ap.add_argument("--model", default="tiny-moe")
    ap.add_argument("--rss-growth-limit", type=float, default=0.10,
                    help="allowed resident-memory growth of any process from warm-up to the end (fraction)")
    args = ap.parse_args()

    c = ServeProcess("--model", args.model, "--prefill-workers", str(args.prefill_workers), "--decode-workers",
                     str(args.decode_workers), "--max-model-len", "1024", "--block-size", "16")
    root = psutil.Process(c.proc.pid)
    rng = random.Random(0)
    plan = []
    for i in range(args.requests):
        prompt = [rng.randrange(2, 512) for _ in range(rng.randrange(1, 200))]
        greedy = rng.random() < 0.5
        params = SamplingParams(max_tokens=rng.randint(1, args.max_tokens), temperature=0.0 if greedy else 0.8,
                                top_p=1.0 if greedy else 0.9, seed=None if greedy else i)
        plan.append((i, prompt, params, rng.random() < 0.5))
    failures: list[str] = []
    done = [0]
    lock = threading.Lock()
    samples: list[tuple[int, dict[str, int]]] = []

    def one(item):
        i, prompt, params, streaming = item
        try:
            if streaming:
                n = sum(len(m.token_ids) for m in c.client.generate(prompt, params, timeout=300))
            else:
                n = len(c.client.generate_unary(prompt, params, timeout=300).token_ids)
            if not 1 <= n <= params.max_tokens:
                raise AssertionError(f"{n} tokens for max_tokens={params.max_tokens}")
        except Exception as e:  # every failure is counted and reported
            with lock:
                failures.append(f"request {i}: {type(e).__name__}: {e}"[:300])
        with lock:
            done[0] += 1

    stop = threading.Event()

    def sampler():
        while not stop.wait(2.0):
            samples.append((done[0], rss_by_process(root)))

    threading.Thread(target=sampler, daemon=True).start()
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(one, plan))
        seconds = time.monotonic() - t0
        stop.set()
        samples.append((done[0], rss_by_process(root)))
        info = c.wait_idle(30)
        leaks = [f"{w.role} {w.address}: {w.load}".replace("\n", " ") for w in info.workers
                 if w.load.free_kv_blocks != w.load.total_kv_blocks or w.load.free_state_slots
                 != w.load.total_state_slots or w.load.active_leases or w.load.running_requests
                 or w.load.waiting_requests]
        text = requests.get(f"http://{c.metrics[0]}/metrics", timeout=10).text
        router_running = sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                             if ln.startswith("tandem:num_requests_running{"))
        if router_running:
            leaks.append(f"router: {router_running} requests still running")
    finally:
        code = c.stop()
    # warm-up: the first sample taken after a tenth of the requests; growth is measured from there to the end
    warm = next((s for n, s in samples if n >= args.requests // 10), samples[0][1])
    end = samples[-1][1]
    growth = {k: (end[k] - warm[k]) / warm[k] for k in warm if k in end}
    report = {
        "requests": args.requests, "concurrency": args.concurrency, "seconds": round(seconds, 1),
        "requests_per_second": round(args.requests / seconds, 1), "failures": len(failures),
        "failure_examples": failures[:5], "leaks": leaks, "serve_exit_code": code,
        "rss_mib_warm": {k: round(v / 2**20, 1) for k, v in warm.items()},
        "rss_mib_end": {k: round(v / 2**20, 1) for k, v in end.items()},
        "rss_growth": {k: round(v, 4) for k, v in growth.items()},
        "rss_samples": len(samples),
        # total resident MiB of each process at every tenth of the run: flat means no trend after warm-up
        "rss_mib_by_tenth": {k: [round(next((smp[k] for n, smp in samples if n >= args.requests * t // 10 and k in smp),
                                             end.get(k, 0)) / 2**20, 1) for t in range(1, 11)] for k in end},
    }
    print(json.dumps(report, indent=2))
    ok = not failures and not leaks and code == 0 and all(g <= args.rss_growth_limit for g in growth.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
