"""One long prompt through a running `tandem serve`: time to first token and decode speed at that context, next to
their floors.

    # one GPU: a server started with --max-model-len 262144, then
    python3 benchmarks/long_context.py --address 127.0.0.1:50051 --model qwen3.5-35b-a3b-fp8 \
        --prompt-len 262016 --max-tokens 128 --bandwidth-gbs 3350     # an H100's bandwidth; 4250 on an H200

Floors (the model's weights are built on the meta device, only to count them):
  TTFT: compute. 2 FLOPs per active weight per prompt token (dense weights and top_k / num_experts of the
    experts; the MTP head's pass counted too), at --linear-tflops (FP8 weights: FP8 tensor-core peak), plus causal
    attention, 2 * L^2 * heads * head_dim FLOPs per full-attention layer, at --attention-tflops. GDN is left out.
  decode: HBM. One step's bytes at context L (`benchmarks/step.py`'s step_bytes: weights, KV, GDN states; with
    k > 0 the MTP drafting too), at --bandwidth-gbs, times --tokens-per-step (1 at k = 0; the acceptance length
    when the server speculates).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from step import step_bytes  # this script's directory is on sys.path
from tandem import SamplingParams
from tandem.client import TandemClient
from tandem.model.source import model_config
from tandem.model.loader import build_empty_model


def meta_model(name: str, dtype: torch.dtype):
    cfg = model_config(name)
    model = build_empty_model(cfg, "meta", dtype, with_mtp=cfg.num_mtp_layers > 0)
    if cfg.quantization is not None:
        from tandem.model.fp8 import to_fp8_layout

        to_fp8_layout(model, cfg.quantization, quantize=False)
    return cfg, model


def prefill_flops(cfg, model, length: int) -> tuple[float, float]:
    """(FLOPs of the weights, FLOPs of causal attention) of one prompt of `length` tokens."""
    active = 0.0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue  # a lookup
        share = cfg.num_experts_per_tok / cfg.num_experts if ".experts." in name else 1.0
        active += p.numel() * share
    attention = len(cfg.attention_layers) * 2 * length * length * cfg.num_heads * cfg.head_dim
    return 2 * active * length, attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", default="127.0.0.1:50051")
    ap.add_argument("--model", required=True, help="the served preset or checkpoint directory (for the floors)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=0, help="the server's --num-speculative-tokens")
    ap.add_argument("--tokens-per-step", type=float, default=1.0, help="mean tokens a decode step emits")
    ap.add_argument("--bandwidth-gbs", type=float, default=4250.0)
    ap.add_argument("--linear-tflops", type=float, default=None,
                    help="default: 1979 with FP8 weights, else 989 (dense H100 / H200 tensor-core peaks)")
    ap.add_argument("--attention-tflops", type=float, default=989.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()

    dtype = getattr(torch, args.dtype)
    cfg, model = meta_model(args.model, dtype)
    linear_tflops = args.linear_tflops or (1979.0 if cfg.quantization is not None else 989.0)
    weights, attention = prefill_flops(cfg, model, args.prompt_len)
    ttft_floor = weights / (linear_tflops * 1e12) + attention / (args.attention_tflops * 1e12)
    context = args.prompt_len + args.max_tokens / 2
    verify, draft = step_bytes(cfg, model, 1, context, dtype.itemsize, args.k)
    step_floor = (verify + draft) / (args.bandwidth_gbs * 1e9)
    decode_floor = args.tokens_per_step / step_floor

    prompt = [random.Random(0).randrange(100, cfg.vocab_size - 1000) for _ in range(args.prompt_len)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    client = TandemClient(args.address)
    t0 = time.monotonic()
    first, tokens = None, 0
    for msg in client.generate(prompt, params, timeout=args.timeout):
        if msg.token_ids and first is None:
            first = time.monotonic()
        tokens += len(msg.token_ids)
    end = time.monotonic()
    if first is None or tokens < 2:
        raise SystemExit(f"the server returned {tokens} tokens")
    ttft, rate = first - t0, (tokens - 1) / (end - first)
    print(f"prompt {args.prompt_len} tokens, {tokens} generated (k = {args.k})")
    print(f"TTFT {ttft:.2f} s; compute floor {ttft_floor:.2f} s ({weights / 1e15:.2f} PFLOP of weights at "
          f"{linear_tflops:.0f} TFLOPS, {attention / 1e15:.2f} PFLOP of attention at {args.attention_tflops:.0f}): "
          f"{ttft / ttft_floor:.1f}x")
    print(f"decode {rate:.1f} tok/s at context ~{context:.0f}; HBM floor {decode_floor:.1f} tok/s "
          f"({step_floor * 1e3:.3f} ms a step of {(verify + draft) / 1e9:.2f} GB at {args.bandwidth_gbs:.0f} GB/s, "
          f"{args.tokens_per_step} tokens a step): {decode_floor / rate:.2f}x")


if __name__ == "__main__":
    main()
