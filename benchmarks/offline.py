"""Offline throughput of the engine alone, as the serving benchmark loads it: --num-prompts random prompts queued at
once, at most --max-num-seqs running (so a finished request's place goes to the next prompt, as at a serving
concurrency of --max-num-seqs), with every step timed and classed by what it ran:

  decode   only decode/verify rows (the CUDA-graph path on a GPU)
  mixed    decode rows and prompt chunks in one step (one forward over both)
  prefill  prompt chunks only

Compared with `tandem bench serve` at the same concurrency, it separates the engine's cost from the serving
stack's (gRPC, streaming, the router), and the class table says which kind of step the time goes to.

    .venv/bin/python benchmarks/offline.py --model tiny-moe --num-prompts 16 --input-len 64 --output-len 16 \
        --max-num-seqs 4 --k 2
    python3 benchmarks/offline.py --model qwen3.5-35b-a3b --dtype bfloat16 --num-prompts 128 --input-len 1024 \
        --output-len 256 --max-num-seqs 32 --k 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tandem.config import EngineConfig, parse_dtype  # noqa: E402
from tandem.engine.engine import Engine  # noqa: E402
from tandem.model.source import load_model  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.worker_setup import prepare_engine  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-moe")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2, help="MTP drafts per step")
    ap.add_argument("--acceptance", default="0.84,0.66", help="emulated acceptance per draft position")
    args = ap.parse_args()

    cfg, model, _ = load_model(args.model, args.device, parse_dtype(args.dtype))
    rates = tuple(float(r) for r in args.acceptance.split(","))[: args.k] if args.k else None
    ecfg = EngineConfig(dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.input_len + args.output_len + args.k + 8,
                        max_num_batched_tokens=args.max_num_batched_tokens, num_speculative_tokens=args.k,
                        emulated_acceptance=rates)
    eng = Engine(cfg, model, ecfg)
    prepare_engine(eng)  # as a worker does before it serves
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (args.num_prompts, args.input_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    seqs = list(eng.sequences.values())

    steps = {"decode": [], "mixed": [], "prefill": []}  # class -> [(seconds, decodes, prompt tokens)]
    t_start = time.perf_counter()
    while eng.has_work():
        t0 = time.perf_counter()
        eng.step()  # ends with the sampled tokens on the host: the step's device work is done
        dt = time.perf_counter() - t0
        shape = eng.last_step
        if shape is not None:
            steps[shape.kind].append((dt, shape.decodes, shape.prompt_tokens))
    total = time.perf_counter() - t_start
    out_tokens = sum(len(s.output_token_ids) for s in seqs)

    print(f"model={args.model} dtype={args.dtype} device={args.device} prompts={args.num_prompts}x{args.input_len} "
          f"output={args.output_len} max_num_seqs={args.max_num_seqs} k={args.k}"
          + (f" acceptance={rates}" if rates else ""))
    print(f"output tokens {out_tokens} in {total:.2f} s: {out_tokens / total:.1f} output tok/s, "
          f"{(out_tokens + args.num_prompts * args.input_len) / total:.1f} total tok/s")
    print(f"{'class':<8} {'steps':>6} {'seconds':>8} {'share':>6} {'mean ms':>8} {'p50 ms':>8} {'max ms':>8} "
          f"{'decodes':>8} {'prompt tok':>10} {'ms/1k prompt':>12}")
    for kind, rows in steps.items():
        if not rows:
            continue
        ms = [r[0] * 1e3 for r in rows]
        print(f"{kind:<8} {len(rows):>6} {sum(ms) / 1e3:>8.2f} {sum(ms) / 1e3 / total:>6.1%} "
              f"{statistics.mean(ms):>8.2f} {statistics.median(ms):>8.2f} {max(ms):>8.2f} "
              f"{statistics.mean(r[1] for r in rows):>8.1f} {statistics.mean(r[2] for r in rows):>10.1f} "
              + (f"{sum(ms) / sum(r[2] for r in rows) * 1e3:>12.2f}" if kind != "decode" else ""))
    mixed = steps["mixed"]
    if len({r[2] for r in mixed}) > 1:  # what a mixed step costs beyond its decode rows, per prompt token
        fit = statistics.linear_regression([r[2] / 1e3 for r in mixed], [r[0] * 1e3 for r in mixed])
        print(f"mixed steps, least squares: {fit.intercept:.2f} ms + {fit.slope:.2f} ms per 1k prompt tokens")


if __name__ == "__main__":
    main()
