"""Overload: long prompts saturate the prefill worker while short requests keep coming; counts outcomes.

`tandem serve` (1 prefill + 2 decode workers, tandem-tiny on the CPU by default) is started; for --seconds, each of
--long-clients sends ~--long-tokens-token prompts back to back over HTTP with the official openai client (no client
retries: a 429 is counted, then the client waits for its Retry-After), and short requests start at --short-rate per
second, each streamed to time its first token. Printed: outcomes (ok, 429, other errors by status) for short and
long requests, and p50/p99 time to first token of the short ones. The target: no short request fails, long ones
are served or refused early with 429, none gets a 5xx.

    python benchmarks/overload.py                                        # 8 long clients + 4 short/s for 40 s
    python benchmarks/overload.py --seconds 10 --long-clients 2          # a quick check
    python benchmarks/overload.py --serve-flags="--lease-seconds 3"      # flags passed to `tandem serve`
"""

from __future__ import annotations

import argparse
import random
import shlex
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import openai

from tandem.launch import ServeProcess


def outcome_of(e: Exception) -> str:
    if isinstance(e, openai.APIStatusError):
        return str(e.status_code)
    return type(e).__name__


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {"short": Counter(), "long": Counter()}
        self.ttft: list[float] = []
        self.examples: dict[str, str] = {}

    def add(self, kind: str, outcome: str, ttft: float | None = None, error: Exception | None = None) -> None:
        with self.lock:
            self.counts[kind][outcome] += 1
            if ttft is not None:
                self.ttft.append(ttft)
            if error is not None and outcome not in self.examples:
                self.examples[outcome] = str(error)[:200]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def retry_after(e: Exception) -> float:
    try:
        return float(e.response.headers.get("retry-after", 1))
    except (AttributeError, ValueError):
        return 1.0


def long_client(client: openai.OpenAI, model: str, args, seed: int, stop_at: float, tally: Tally) -> None:
    rng = random.Random(seed)
    while time.monotonic() < stop_at:
        ids = [rng.randrange(2, 4000) for _ in range(args.long_tokens)]
        try:
            client.completions.create(model=model, prompt=ids, max_tokens=args.max_tokens, temperature=0.0)
            tally.add("long", "ok")
        except Exception as e:  # every failure is an outcome to count
            tally.add("long", outcome_of(e), error=e)
            if isinstance(e, openai.RateLimitError):
                time.sleep(retry_after(e))


def short_request(client: openai.OpenAI, model: str, args, seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    t0 = time.monotonic()
    try:
        stream = client.completions.create(model=model, prompt=[rng.randrange(2, 4000) for _ in range(16)],
                                           max_tokens=args.max_tokens, temperature=0.0, stream=True)
        first = None
        for _ in stream:
            if first is None:
                first = time.monotonic() - t0
        tally.add("short", "ok", ttft=first)
    except Exception as e:  # every failure is an outcome to count
        tally.add("short", outcome_of(e), error=e)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=40.0, help="how long load is offered")
    ap.add_argument("--long-clients", type=int, default=8)
    ap.add_argument("--long-tokens", type=int, default=3500)
    ap.add_argument("--short-rate", type=float, default=4.0, help="short requests started per second")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    ap.add_argument("--prefill-workers", type=int, default=1)
    ap.add_argument("--decode-workers", type=int, default=2)
    ap.add_argument("--serve-flags", default="", help="more `tandem serve` flags, as one string")
    ap.add_argument("--timeout", type=float, default=300.0, help="client timeout per request")
    args = ap.parse_args()

    t0 = time.monotonic()
    serve = ServeProcess("--prefill-workers", str(args.prefill_workers), "--decode-workers", str(args.decode_workers),
                         *shlex.split(args.serve_flags), start_timeout=300)
    try:
        print(f"serving after {time.monotonic() - t0:.1f} s at http://{serve.http}/v1", flush=True)
        client = openai.OpenAI(base_url=f"http://{serve.http}/v1", api_key="none", max_retries=0,
                               timeout=args.timeout)
        model = client.models.list().data[0].id
        tally, stop_at = Tally(), time.monotonic() + args.seconds
        longs = [threading.Thread(target=long_client, args=(client, model, args, i, stop_at, tally), daemon=True)
                 for i in range(args.long_clients)]
        for t in longs:
            t.start()
        with ThreadPoolExecutor(max(8, int(args.short_rate * 60))) as pool:
            i, start = 0, time.monotonic()
            while time.monotonic() < stop_at:
                pool.submit(short_request, client, model, args, 10_000 + i, tally)
                i += 1
                time.sleep(max(0.0, start + i / args.short_rate - time.monotonic()))
        for t in longs:
            t.join()
        took = time.monotonic() - stop_at + args.seconds
    finally:
        serve.stop()
    print(f"\n{args.long_clients} long clients ({args.long_tokens}-token prompts) + {args.short_rate:g} short "
          f"requests/s for {args.seconds:g} s ({took:.1f} s until the last answer), {args.prefill_workers} prefill + "
          f"{args.decode_workers} decode workers, serve flags: {args.serve_flags or '(none)'}")
    for kind in ("short", "long"):
        c = tally.counts[kind]
        others = {k: v for k, v in c.items() if k not in ("ok", "429")}
        print(f"  {kind:5s}: {sum(c.values())} sent, {c['ok']} ok, {c['429']} 429, other errors: {others or 0}")
    print(f"  short TTFT: p50 {percentile(tally.ttft, 0.5):.2f} s, p99 {percentile(tally.ttft, 0.99):.2f} s, "
          f"max {max(tally.ttft, default=float('nan')):.2f} s")
    for outcome, text in tally.examples.items():
        print(f"  e.g. {outcome}: {text}")
    failed_short = sum(v for k, v in tally.counts["short"].items() if k != "ok")
    server_errors = sum(v for kind in tally.counts.values() for k, v in kind.items() if k.startswith("5"))
    return 1 if failed_short or server_errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
