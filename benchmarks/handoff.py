"""Prefill -> decode hand-off: `tandem serve` (1P1D) against the colocated engine, and hand-off bytes and seconds
per prompt length next to the copy ceiling.

    python benchmarks/handoff.py --model qwen3.5-0.8b --dtype bfloat16 --transfer-backend cuda_ipc

Greedy requests go one at a time first, so the prefill and decode workers run the same shapes as the colocated
engine and outputs must be identical; then a concurrent batch checks the same under load. Bytes and seconds come
from the prefill worker's metrics (per request: the difference around it). The ceiling is a copy between the two
workers' devices (--ceiling-gbs; 0: measured here, from the first GPU to the second when there are two, as
`tandem serve` then places the prefill worker on the first and the decode worker on the second, else within the
GPU: ~2000 GB/s on an H200 for a read plus a write of each byte).

    python benchmarks/handoff.py --model qwen3.5-35b-a3b --dtype bfloat16 --transfer-backend torch_distributed \
        --ceiling-gbs 0    # two GPUs: NCCL between them, against the measured link
"""

from __future__ import annotations

import argparse
import gc
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch
from prometheus_client.parser import text_string_to_metric_families

from tandem import LLM, SamplingParams
from tandem.launch import ServeProcess


def handoff_totals(metrics_address: str) -> tuple[float, float, float]:
    """(bytes, seconds, count) of all hand-offs so far, from a prefill worker's /metrics."""
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
              if s.name in ("tandem:handoff_bytes_total", "tandem:handoff_seconds_sum", "tandem:handoff_seconds_count")}
    return (values["tandem:handoff_bytes_total"], values["tandem:handoff_seconds_sum"],
            values["tandem:handoff_seconds_count"])


def copy_gbs(src: str, dst: str, nbytes: int = 1 << 28, reps: int = 10) -> float:
    """GB/s of a device-to-device copy of `nbytes` from `src` to `dst` (the hand-off's ceiling between them)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    b.copy_(a)  # warm: peer access, allocations
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)
    t0 = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3.5-0.8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--transfer-backend", default="auto")
    ap.add_argument("--prompt-lens", default="128,512,2048")
    ap.add_argument("--concurrent", type=int, default=8, help="requests in the concurrent check")
    ap.add_argument("--concurrent-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--ceiling-gbs", type=float, default=2000.0, help="0: measure the copy between the workers' GPUs")
    args = ap.parse_args()
    if not args.ceiling_gbs:
        if not torch.cuda.is_available():
            raise SystemExit("--ceiling-gbs 0 measures a GPU copy: there is no GPU")
        pair = ("cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
        args.ceiling_gbs = copy_gbs(*pair)
        print(f"ceiling: {pair[0]} -> {pair[1]} copy at {args.ceiling_gbs:.0f} GB/s")

    lens = [int(n) for n in args.prompt_lens.split(",")]
    g = torch.Generator().manual_seed(0)
    sequential = [torch.randint(10, 500, (n,), generator=g).tolist() for n in lens]
    concurrent = [torch.randint(10, 500, (args.concurrent_len,), generator=g).tolist() for _ in range(args.concurrent)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    max_len = max(lens + [args.concurrent_len]) + args.max_tokens + args.k + 16

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=max_len, max_num_seqs=args.concurrent,
              speculative_config={"method": "mtp", "num_speculative_tokens": args.k} if args.k else None)
    want_seq = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in sequential]
    want_conc = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in concurrent], params)]
    del llm
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None

    serve = ServeProcess("--model", args.model, "--dtype", args.dtype, "--max-model-len", str(max_len),
                         "--max-num-seqs", str(args.concurrent), "--num-speculative-tokens", str(args.k),
                         "--transfer-backend", args.transfer_backend, start_timeout=600)
    ok = True
    try:
        info = serve.client.server_info()
        prefill_metrics = serve.metrics[1]
        gpus = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "cpu"
        print(f"model {args.model} {args.dtype}, k={args.k}, transfer backend {args.transfer_backend}, device {gpus}")
        print(f"{'prompt':>7} {'equal':>6} {'hand-off MB':>12} {'ms':>8} {'GB/s':>8} {'ceiling ms':>11} {'ratio':>7}")
        for prompt, want in zip(sequential, want_seq):
            before = handoff_totals(prefill_metrics)
            got = [t for m in serve.client.generate(prompt, params, timeout=600) for t in m.token_ids]
            after = handoff_totals(prefill_metrics)
            nbytes, secs = after[0] - before[0], after[1] - before[1]
            floor = nbytes / (args.ceiling_gbs * 1e9)
            ok &= got == want
            print(f"{len(prompt):>7} {str(got == want):>6} {nbytes / 1e6:>12.2f} {secs * 1e3:>8.3f} "
                  f"{nbytes / secs / 1e9:>8.1f} {floor * 1e3:>11.4f} {secs / floor:>7.1f}")
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(concurrent)) as pool:
            got = list(pool.map(lambda p: [t for m in serve.client.generate(p, params, timeout=600)
                                           for t in m.token_ids], concurrent))
        wall = time.perf_counter() - t0
        same = sum(a == b for a, b in zip(got, want_conc))
        total = handoff_totals(prefill_metrics)
        print(f"concurrent: {same}/{len(concurrent)} equal to the colocated batch (x{args.concurrent_len} tokens, "
              f"{wall:.2f} s); all hand-offs: {total[2]:.0f}, {total[0] / total[2] / 1e6:.2f} MB and "
              f"{total[1] / total[2] * 1e3:.3f} ms each on average")
        print(f"transfer backend reported by the router: {info.transfer_backend or '(per prefill worker)'}")
    finally:
        serve.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
