"""Engine step benchmark: decode step time per batch size, next to the HBM floor of the bytes the step must move.

    python benchmarks/step.py --model tiny-moe --batch-sizes 1,8,32

The floor counts, per decode step: every dense weight and the lm_head once, the routed experts the batch is
expected to touch under uniform routing (E * (1 - (1 - top_k/E)^B) per MoE layer), the KV read of every attention layer and the GDN recurrent state read and
written once per request. On a CPU the "bandwidth" is a nominal figure (--bandwidth-gbs) so the ratio is only
indicative; on the H200 use 4250 GB/s.
"""

from __future__ import annotations

import argparse
import time

import torch

from tandem.config import EngineConfig
from tandem.engine.llm import Engine, load_model
from tandem.engine.sampling_params import SamplingParams


def step_bytes(cfg, model, batch: int, context: int, dtype_bytes: int) -> float:
    total = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            continue
        total += p.numel() * p.element_size()
    if cfg.tie_word_embeddings:
        total += cfg.vocab_size * cfg.hidden_size * dtype_bytes
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * dtype_bytes
    touched = cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch) if cfg.num_experts else 0
    total += sum(cfg.moe_layers) * touched * expert
    # embeddings: only B rows are read, not the table
    total -= cfg.vocab_size * cfg.hidden_size * dtype_bytes - batch * cfg.hidden_size * dtype_bytes
    kv = 2 * len(cfg.attention_layers) * context * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    ssm_bytes = 4 if cfg.ssm_dtype == torch.float32 else dtype_bytes
    state = 2 * len(cfg.gdn_layers) * cfg.gdn_num_v_heads * cfg.gdn_k_dim * cfg.gdn_v_dim * ssm_bytes
    return total + batch * (kv + state)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-moe")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bandwidth-gbs", type=float, default=4250.0, help="memory bandwidth for the floor")
    args = ap.parse_args()

    ecfg = EngineConfig(dtype=args.dtype, device=args.device, max_model_len=args.prompt_len + args.steps + 8,
                        max_num_seqs=max(int(b) for b in args.batch_sizes.split(",")))
    cfg, model, _ = load_model(args.model, args.device, ecfg.dtype)
    dtype_bytes = torch.tensor([], dtype=ecfg.dtype).element_size()
    print(f"model={args.model} dtype={args.dtype} device={args.device} prompt={args.prompt_len} "
          f"floor bandwidth={args.bandwidth_gbs:.0f} GB/s")
    print(f"{'batch':>5} {'step ms':>9} {'floor ms':>9} {'ratio':>7} {'tok/s':>9}")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        eng = Engine(cfg, model, ecfg)
        for i in range(b):
            eng.add_request(str(i), [(7 * i + j) % cfg.vocab_size for j in range(args.prompt_len)],
                            SamplingParams(max_tokens=args.steps + 2, ignore_eos=True, temperature=0.0))
        while any(s.in_prefill or not s.output_token_ids for s in eng.sequences.values()):
            eng.step()
        eng.step()  # warm-up decode
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        sync()
        ms = (time.perf_counter() - t0) / args.steps * 1e3
        floor = step_bytes(cfg, model, b, args.prompt_len + args.steps // 2, dtype_bytes) / (args.bandwidth_gbs * 1e9) * 1e3
        print(f"{b:>5} {ms:>9.3f} {floor:>9.4f} {ms / floor:>7.1f} {b / ms * 1e3:>9.1f}")
        for rid in list(eng.sequences):
            eng.abort(rid)


if __name__ == "__main__":
    main()
