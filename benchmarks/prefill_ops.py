"""Prefill-size kernel benchmark: the ops of one 35B-A3B layer at 8 prompts x 2048 tokens (and the MoE experts and
align at decode sizes too), each timed by CUDA events next to its floor: the HBM bytes it must move at
--bandwidth-gbs or its FLOPs at --tflops (dense bf16), whichever is larger. With --sweep, the tilings each kernel's
dispatch could take instead of its default, so a default can be chosen from figures.

    python3 benchmarks/prefill_ops.py [--sweep] [--rows recurrent,align]

Rows: `conv` (causal_conv1d, q|k|v parts), `gated norm` (GDN output norm, gate read in place), `recurrent` (the
delta rule at decode and verify sizes, in a CUDA graph as a step runs it: B requests of 1 or 3 rows), `align`
(kernel and torch reference; host time per call too: at prefill the engine is host-bound), `experts`
(fused_experts in bf16, eager and in a CUDA graph; floor = the routed experts' weight bytes, or the FLOPs at
prefill), `attention` (paged_attention over 8 causal prompts of 2048 tokens, head_dim 256, GQA 16:2).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.batch import ForwardBatch  # noqa: E402
from tandem.ops import attention, gdn, moe, norm  # noqa: E402

E, TOP_K, H, I = 256, 8, 2048, 512  # the 35B-A3B's MoE
NK, NV, DK, DV, KW = 16, 32, 128, 128, 4  # its GDN
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 2, 256, 16  # its attention, the engine's KV block
PROMPTS, LEN = 8, 2048


def device_us(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def host_us(fn, reps: int = 10) -> float:
    """Time to enqueue one call (the device is drained before, so the queue never blocks it)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t * 1e6 / reps


def graph_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return device_us(g.replay, reps)


class Report:
    def __init__(self, bandwidth_gbs: float, tflops: float):
        self.bw, self.flops = bandwidth_gbs * 1e9, tflops * 1e12

    def row(self, name: str, us: float, nbytes: float, flops: float = 0.0, extra: str = ""):
        floor = max(nbytes / self.bw, flops / self.flops) * 1e6
        print(f"{name:<48} {us:10.1f} us  floor {floor:8.1f} us  {us / floor:5.2f}x  {extra}", flush=True)


def packed_batch(lens, dev, cached=0, replay=0, keep=False):
    """Requests of `lens` new rows after `cached` ones; request i reads and writes state slot i + 1, replays
    `replay` pending rows from buffer 2 (i + 1) and, when `keep` (a verify step), keeps its rows in the other."""
    qsl = torch.tensor([0] + lens).cumsum(0)
    B, T = len(lens), int(qsl[-1])
    per = -(-(cached + max(lens)) // BLOCK)
    tables = torch.arange(1, 1 + B * per).view(B, per)
    return ForwardBatch(
        input_ids=torch.zeros(T, dtype=torch.long, device=dev), positions=torch.zeros(T, dtype=torch.long, device=dev),
        query_start_loc=qsl.to(dev), seq_lens=(torch.tensor(lens) + cached).to(dev), block_tables=tables.to(dev),
        slot_mapping=torch.zeros(T, dtype=torch.long, device=dev), state_slots=torch.arange(1, B + 1, device=dev),
        state_replay=torch.full((B,), replay, device=dev),
        state_pending=torch.tensor([(2 * s, 2 * s + 1 if keep else -1) for s in range(1, B + 1)], device=dev),
        logits_indices=(qsl[1:] - 1).to(dev), query_start_loc_cpu=qsl.tolist(),
        seq_lens_cpu=[n + cached for n in lens]), tables


def conv_rows(rep: Report, sweep: bool):
    dev, dt = "cuda", torch.bfloat16
    batch, _ = packed_batch([LEN] * PROMPTS, dev)
    T, C = PROMPTS * LEN, 2 * NK * DK + NV * DV
    x = torch.randn(T, C, device=dev, dtype=dt)
    state = torch.randn(PROMPTS + 1, C, KW - 1, device=dev, dtype=dt)
    pending = torch.empty(2 * (PROMPTS + 1), 1, C, device=dev, dtype=dt)  # prompt rows: never read or written
    w = torch.randn(C, KW, device=dev, dtype=dt)
    splits = [NK * DK, NK * DK, NV * DV]
    nbytes = 2 * T * C * 2
    configs = [(None, None)] + ([(None, 16), (None, 32), (8, 8), (32, 8), (8, 16), (8, 32)] if sweep else [])
    for split, block_t in configs:
        us = device_us(lambda: gdn.causal_conv1d_triton(x, state, pending, w, batch, splits, split=split,
                                                        block_t=block_t))
        rep.row(f"conv T={T} C={C} split={split or 'auto'} block_t={block_t or 'auto'}", us, nbytes)


def gated_norm_rows(rep: Report, sweep: bool):  # no tilings to sweep
    dev, dt, T = "cuda", torch.bfloat16, PROMPTS * LEN
    o = torch.randn(T, NV, DV, device=dev, dtype=dt)
    proj = torch.randn(T, 2 * NK * DK + 2 * NV * DV + 2 * NV, device=dev, dtype=dt)
    z = proj[:, 2 * NK * DK + NV * DV : 2 * NK * DK + 2 * NV * DV].view(T, NV, DV)
    w = torch.randn(DV, device=dev, dtype=dt)
    rep.row(f"gated norm T={T} x [{NV}, {DV}]", device_us(lambda: norm.gated_rms_norm_triton(o, z, w, 1e-6)),
            3 * T * NV * DV * 2)


def recurrent_rows(rep: Report, sweep: bool):
    """The delta rule at decode (1 row a request) and verify sizes (k + 1 = 3 rows, kept; 2 replayed: one draft
    was accepted in the step before), fp32 state."""
    dev, dt = "cuda", torch.bfloat16
    for B, rows in ((1, 1), (1, 3), (32, 1), (32, 3)):
        replay = 2 if rows > 1 else 0
        batch, _ = packed_batch([rows] * B, dev, replay=replay, keep=rows > 1)
        T = B * rows
        q, k = (torch.randn(T, NK, DK, device=dev, dtype=dt) for _ in range(2))
        v = torch.randn(T, NV, DV, device=dev, dtype=dt)
        ab = torch.randn(T, 2 * NV, device=dev, dtype=dt)
        gates = gdn.Gates(ab[:, :NV], ab[:, NV:], torch.rand(NV, device=dev) - 2, torch.ones(NV, device=dev, dtype=dt))
        state = torch.randn(B + 1, NV, DK, DV, device=dev) * 0.1
        width = NK * DK + NV * DV + 2 * NV
        pending = torch.randn(2 * (B + 1), rows, width, device=dev, dtype=dt)
        # the state read and written; q, k, v read; kept rows written and replayed rows read
        nbytes = (2 * B * NV * DK * DV * 4 + T * (2 * NK * DK + NV * DV) * 2
                  + (rows > 1) * B * (rows + replay) * width * 2)
        configs = [(None, None)] + ([(bv, w) for bv in (16, 32, 64, 128) for w in (1, 2, 4, 8)] if sweep else [])
        for block_v, warps in configs:
            us = graph_us(lambda: gdn.gated_delta_rule_triton(q, k, v, gates, state, pending, batch,
                                                              block_v=block_v, num_warps=warps))
            rep.row(f"recurrent B={B} rows={rows} block_v={block_v or 'auto'} warps={warps or 'auto'}", us, nbytes)


def align_rows(rep: Report, sweep: bool):  # no tilings to sweep
    for T in (1, 32, 96, 1024, PROMPTS * LEN):  # decode at B = 1 and 32, verify at B = 32 with k = 2, prefill
        experts = torch.rand(T, E, device="cuda").topk(TOP_K, dim=1).indices
        block_m = moe._configs(T * TOP_K, E)[0]  # the dispatch's
        for use_kernel in (True, False):
            fn = lambda: moe.moe_align(experts, E, block_m, use_kernel)  # noqa: E731
            rep.row(f"align T={T} pairs={T * TOP_K} {'kernel' if use_kernel else 'torch reference'}",
                    device_us(fn), experts.numel() * 8 * 3, extra=f"host {host_us(fn):.0f} us a call")
        if T * TOP_K <= moe.ALIGN_CHUNK:  # ranked routing: the routing kernel's counters give counts and ranks
            logits = torch.randn(T, E, device="cuda")

            def ranked():
                w, e, ranks = moe.route_logits(logits, TOP_K, True, ranked=True)
                if not isinstance(ranks, moe.Aligned):  # up to RANK_PAIRS pairs the routing launch aligns too
                    moe.moe_align(e, E, block_m, ranks=ranks)
                moe.routing_counters(logits.device, E).zero_()  # what the gate/up kernel does

            rep.row(f"route + ranked align + zeroing T={T} pairs={T * TOP_K}", graph_us(ranked),
                    experts.numel() * 8 * 3)
            rep.row(f"route + align T={T} pairs={T * TOP_K}",
                    graph_us(lambda: moe.moe_align(moe.route_logits(logits, TOP_K, True)[1], E, block_m)),
                    experts.numel() * 8 * 3)


def experts_rows(rep: Report, sweep: bool):
    dev, dt = "cuda", torch.bfloat16
    gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=dt) / H**0.5
    down = torch.randn(E, H, I, device=dev, dtype=dt) / I**0.5
    router = torch.randn(E, H, device=dev, dtype=dt)
    for T in (1, 32, 96, 2048, PROMPTS * LEN):
        x = torch.randn(T, H, device=dev, dtype=dt)
        weights, experts = moe.route(x, router, TOP_K, True)
        touched = experts.unique().numel()
        nbytes, flops = touched * 3 * H * I * 2 + 2 * T * H * 2, 2 * T * TOP_K * 3 * H * I
        fn = lambda: moe.fused_experts(x, gate_up, down, weights, experts)  # noqa: E731
        rep.row(f"experts T={T} (touched {touched}) eager", device_us(fn), nbytes, flops,
                extra=f"host {host_us(fn):.0f} us a call")
        rep.row(f"experts T={T} graph", graph_us(fn), nbytes, flops)
        if sweep and T <= 96:  # decode sizes: one config changed at a time from the dispatch's (N tiles, warps)
            bm, gu0, dn0, _ = moe._configs(T * TOP_K, E)
            for gu, dn in [(gu, dn0) for gu in ((16, 128, 4, 4), (64, 128, 4, 4), (32, 128, 2, 4), (16, 128, 2, 5))] + \
                          [(gu0, dn) for dn in ((32, 128, 4, 4), (128, 128, 4, 4), (64, 128, 2, 4))]:
                us = graph_us(lambda: moe.fused_experts_triton(x, gate_up, down, weights, experts, block_m=bm,
                                                               gate_up_cfg=gu, down_cfg=dn))
                rep.row(f"experts T={T} gate_up={gu} down={dn}", us, nbytes, flops)
        if sweep and T >= 2048:
            for bm, gu, dn in [(64, (128, 64, 4, 3), (128, 64, 8, 3)), (64, (128, 64, 8, 3), (128, 64, 8, 3)),
                               (64, (64, 64, 4, 4), (128, 64, 8, 4)), (128, (64, 64, 8, 3), (128, 64, 8, 3)),
                               (128, (128, 64, 8, 3), (128, 64, 8, 3)), (64, (64, 64, 4, 3), (64, 64, 4, 3)),
                               (64, (64, 64, 4, 3), (256, 64, 8, 3)), (128, (128, 32, 8, 4), (128, 32, 8, 4))]:
                us = device_us(lambda: moe.fused_experts_triton(x, gate_up, down, weights, experts, block_m=bm,
                                                                gate_up_cfg=gu, down_cfg=dn))
                rep.row(f"experts T={T} block_m={bm} gate_up={gu} down={dn}", us, nbytes, flops)


def attention_rows(rep: Report, sweep: bool):
    dev, dt = "cuda", torch.bfloat16
    batch, tables = packed_batch([LEN] * PROMPTS, dev)
    T = PROMPTS * LEN
    blocks = int(tables.max()) + 1
    k_cache = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(T, HEADS, HEAD_DIM, device=dev, dtype=dt)
    flops = 4 * HEAD_DIM * HEADS * PROMPTS * LEN * (LEN + 1) / 2
    nbytes = 2 * q.numel() * 2 + 2 * T * KV_HEADS * HEAD_DIM * 2
    configs = [(None, None)] + ([(64, 64), (128, 32), (128, 64), (32, 64)] if sweep else [])
    for prefill_m, block_n in configs:
        us = device_us(lambda: attention.paged_attention_triton(
            q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, HEAD_DIM**-0.5, LEN,
            prefill_m=prefill_m, block_n=block_n))
        rep.row(f"attention {PROMPTS}x{LEN} prefill_m={prefill_m or 'default'} block_n={block_n or 'default'}",
                us, nbytes, flops)
    for B, rows, ctx in ((1, 1, 1024), (1, 3, 4096), (32, 1, 1280), (32, 3, 1280), (32, 3, 4096)):
        # decode and verify: the context split over programs (split-K), then the partials' reduce
        batch, tables = packed_batch([rows] * B, dev, cached=ctx)
        kc = torch.randn(int(tables.max()) + 1, BLOCK, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
        vc = torch.randn_like(kc)
        q = torch.randn(B * rows, HEADS, HEAD_DIM, device=dev, dtype=dt)
        us = graph_us(lambda: attention.paged_attention_triton(q, kc, vc, batch.query_start_loc, batch.seq_lens,
                                                               batch.block_tables, HEAD_DIM**-0.5, rows))
        rep.row(f"attention decode {B}x{rows} on {ctx} cached", us, 2 * B * (ctx + rows) * KV_HEADS * HEAD_DIM * 2)


ROWS = {"conv": conv_rows, "norm": gated_norm_rows, "recurrent": recurrent_rows, "align": align_rows,
        "experts": experts_rows, "attention": attention_rows}  # each takes (report, sweep)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="also time the tilings other than the defaults")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"which ops, comma separated (of {', '.join(ROWS)})")
    ap.add_argument("--bandwidth-gbs", type=float, default=4250.0)
    ap.add_argument("--tflops", type=float, default=989.0, help="dense bf16 peak for the compute floor")
    a = ap.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; floors at {a.bandwidth_gbs:.0f} GB/s and "
          f"{a.tflops:.0f} TFLOP/s")
    rep = Report(a.bandwidth_gbs, a.tflops)
    with torch.inference_mode():
        for name in a.rows.split(","):
            ROWS[name](rep, a.sweep)


if __name__ == "__main__":
    main()
