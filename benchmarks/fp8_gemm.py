"""FP8 W8A8 kernel benchmark: each GEMM of the 35B-A3B model (and its MoE experts) at decode, verify and prefill
row counts, timed in a CUDA graph over enough weight copies to defeat the L2, next to its HBM floor and to the
bf16 GEMM of the same shape; with the error of each variant against the fp64 oracle of tests/test_ops_fp8.py.

    python3 benchmarks/fp8_gemm.py [--rows 1,32,96,2048] [--sweep]

Variants: the dispatch's choice (`w8a8_linear`, `fused_experts`; from 257 rows torch's block-scaled matmul when
this torch has it, and then the Triton kernel's time beside it) and, with --sweep: for the dense GEMMs, other
tiles and K splits at decode and verify sizes (row tiles up to 128 at verify rows; torch's block-scaled matmul
beside them at decode rows, when this torch has it), and
prefill tiles with `group_dot`'s DOT 0 (e4m3 with Hopper's fast accumulation inside each 128-wide group, as
DeepSeek's and vLLM's block-FP8 GEMMs; the dispatch's at prefill sizes) and 1 (promoted to fp32 every K = 32;
the dispatch's at decode sizes); for the experts DOT 0, 1 and 2 (bf16 upcast), and their tiles at decode and
prefill sizes. The prefill GEMMs are compute-bound: there the bf16 column is the bar, not the floor. Floor = bytes
the call must move (e4m3 weight and scales, activations in and out) at --bandwidth-gbs. The experts are the
35B-A3B's with its shared expert hosted as expert E (`Experts.host`), each token routed to it too, as at decode
sizes.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.ops import fp8, moe  # noqa: E402
from tandem.ops.fp8 import quantize_block_fp8  # noqa: E402

BLOCK = (128, 128)
L2_BYTES = 50e6
# (name, N, K, calls per decode step of the 35B-A3B: 30 GDN layers, 10 + 1 (MTP) attention layers; the shared
# expert runs among the experts at decode sizes)
DENSE = [("gdn in_proj_qkvz", 12288, 2048, 30), ("gdn out_proj", 2048, 4096, 30),
         ("attn qkv", 9216, 2048, 11), ("attn o_proj", 2048, 4096, 11)]
E, H, I, TOP_K = 256, 2048, 512, 8
SWEEP = ("gdn in_proj_qkvz", "gdn out_proj")  # --sweep: these shapes


def graph_time_us(fns, reps: int = 20) -> float:
    """Mean time of one call, with the calls (over distinct weights) captured in one CUDA graph."""
    for f in fns:  # compile
        f()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (reps * len(fns))


def copies(nbytes: float) -> int:
    return max(2, min(64, int(4 * L2_BYTES / nbytes) + 1))


def oracle_err(out, x, q, s):
    """max |out - exact| / (|x| @ |w|) over the elements, exact = fp64 product of the quantised operands."""
    xq, xs = quantize_block_fp8(x, (1, BLOCK[1]))
    ex = lambda t, sc, b: t.double() * sc.double().repeat_interleave(b[0], 0).repeat_interleave(b[1], 1)[
        : t.shape[0], : t.shape[1]]
    xd, wd = ex(xq, xs, (1, BLOCK[1])), ex(q, s, BLOCK)
    want = xd @ wd.T
    return float(((out.double() - want).abs() / (xd.abs() @ wd.abs().T + 1e-30)).max())


def dense(rows, sweep, bw):
    if not rows:
        return
    print(f"\ndense W8A8 (blocks {BLOCK}); us per call; floor at {bw:.0f} GB/s; err = max |out - exact| / (|x| @ |w|)")
    print(f"{'gemm':<18} {'M':>5} {'fp8 us':>8} {'floor':>7} {'ratio':>6} {'err':>8} {'bf16 us':>8}  best of sweep")
    step_us = {m: [0.0, 0.0, 0.0] for m in rows}
    for name, N, K, per_step in DENSE:
        w = torch.randn(N, K, device="cuda") / K**0.5
        q, s = quantize_block_fp8(w, BLOCK)
        r = copies(N * K)
        qs = [q.clone() for _ in range(r)]
        ss = [s.clone() for _ in range(r)]
        wb = [w.to(torch.bfloat16) for _ in range(copies(2 * N * K))]
        for m in rows:
            x = torch.randn(m, K, device="cuda").to(torch.bfloat16)
            floor = (N * K + s.numel() * 4 + 2 * m * (K + N)) / (bw * 1e9) * 1e6
            out = fp8.w8a8_linear(x, q, s, BLOCK)
            err = oracle_err(out, x, q, s)
            t = graph_time_us([lambda i=i: fp8.w8a8_linear(x, qs[i], ss[i], BLOCK) for i in range(r)])
            tb = graph_time_us([lambda i=i: torch.nn.functional.linear(x, wb[i]) for i in range(len(wb))])
            best = ""
            if sweep and name in SWEEP:
                results = []
                for tiles in sweep_tiles(m, N):
                    for dot in (0, 1) if m > 256 else (1,):
                        f = lambda i, tiles=tiles, dot=dot: fp8.w8a8_linear_triton(x, qs[i], ss[i], BLOCK,
                                                                                    tiles=tiles, dot=dot)
                        e = oracle_err(f(0), x, q, s)
                        results.append((graph_time_us([lambda i=i: f(i) for i in range(r)]), tiles, dot, e))
                layout = fp8.cublas_layout(x.device)
                if m <= 32 and layout is not None:  # torch's block-scaled matmul at decode rows too
                    f = lambda i: fp8.w8a8_linear_cublas(x, qs[i], ss[i], layout)
                    results.append((graph_time_us([lambda i=i: f(i) for i in range(r)]), "cuBLAS", "-",
                                    oracle_err(f(0), x, q, s)))
                results.sort(key=lambda z: z[0])
                best = "  ".join(f"{u:.1f}us {t} dot{d} err {e:.1e}" for u, t, d, e in results[:3])
            if m >= fp8.CUBLAS_MIN_ROWS and fp8.cublas_layout(x.device) is not None:  # the dispatch took torch's
                tt = graph_time_us([lambda i=i: fp8.w8a8_linear_triton(x, qs[i], ss[i], BLOCK) for i in range(r)])
                best = f"(torch's block-scaled matmul; the Triton kernel: {tt:.1f}us)  " + best
            print(f"{name:<18} {m:>5} {t:>8.1f} {floor:>7.1f} {t / floor:>6.1f} {err:>8.1e} {tb:>8.1f}  {best}")
            step_us[m][0] += per_step * t
            step_us[m][1] += per_step * floor
            step_us[m][2] += per_step * tb
    for m, (t, f, tb) in step_us.items():
        print(f"  M={m}: the dense FP8 GEMMs of one step take {t / 1e3:.3f} ms (floor {f / 1e3:.3f}, bf16 "
              f"{tb / 1e3:.3f})")


def sweep_tiles(m, n):
    if m > 256:  # prefill: (BLOCK_M, BLOCK_N, no split, warps, stages)
        return [(128, 128, 1, 8, 3), (64, 128, 1, 4, 3), (128, 64, 1, 4, 4), (64, 64, 1, 4, 4), (128, 256, 1, 8, 3)]
    # verify rows (33-256): one row tile of 128 reads each weight tile once, where two of 64 read it twice
    bms = [16] if m <= 16 else [32, 64] if m <= 32 else [64, 128]
    return [(bm, bn, split, 4, 4) for bm in bms for bn in (32, 64, 128) for split in (1, 2, 4, 8)]


def experts(tokens, sweep, bw):
    if not tokens:
        return
    print(f"\nMoE experts E={E} (+ the shared expert) top-{TOP_K} H={H} I={I}; us per call (routing excluded)")
    print(f"{'T':>5} {'fp8 us':>8} {'floor':>7} {'ratio':>6} {'bf16 us':>8}  variants")
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(E + 1, 2 * I, H, device="cuda", generator=g) / H**0.5
    down = torch.randn(E + 1, H, I, device="cuda", generator=g) / I**0.5
    (qg, sg), (qu, su), (qd, sd) = (quantize_block_fp8(t, BLOCK) for t in (gate_up[:, :I], gate_up[:, I:], down))
    qgu, sgu = torch.cat([qg, qu], 1), torch.cat([sg, su], 1)
    bgu, bd = gate_up.to(torch.bfloat16), down.to(torch.bfloat16)
    del gate_up, down
    for t in tokens:
        x = torch.randn(t, H, device="cuda", generator=g).to(torch.bfloat16)
        logits = torch.randn(t, E, device="cuda", generator=g)
        fns, fns_b, variants = [], [], {}
        # distinct routings per call: the experts touched differ, as from layer to layer
        routes = [moe.route_logits(logits.roll(7 * i, 1), TOP_K, True, logits[:, :1]) for i in range(8)]
        routes = [(w.to(torch.bfloat16), e) for w, e in routes]
        kw = dict(gate_up_scale=sgu, down_scale=sd, block=BLOCK)
        fns = [lambda w=w, e=e: moe.fused_experts(x, qgu, qd, w, e, **kw) for w, e in routes]
        fns_b = [lambda w=w, e=e: moe.fused_experts(x, bgu, bd, w, e) for w, e in routes]
        touched = moe_touched(t) + 1  # the shared expert
        floor = touched * 3 * I * H * (1 + 4 / 128**2) / (bw * 1e9) * 1e6
        tf, tb = graph_time_us(fns), graph_time_us(fns_b)
        time_fp8 = lambda **tiling: graph_time_us(
            [lambda w=w, e=e: moe.fused_experts_triton(x, qgu, qd, w, e, **tiling, **kw) for w, e in routes])
        if sweep:
            for dot in (0, 1, 2):  # the dispatch's is 1 at decode sizes, 0 at prefill sizes
                variants[f"dot{dot}"] = time_fp8(dot=dot)
        v = "  ".join(f"{k} {u:.1f}" for k, u in variants.items())
        tflops = 2 * t * (TOP_K + 1) * 3 * I * H / (tf * 1e-6) / 1e12
        print(f"{t:>5} {tf:>8.1f} {floor:>7.1f} {tf / floor:>6.1f} {tb:>8.1f}  {v}  ({tflops:.0f} TFLOP/s)")
        if sweep and t * TOP_K > 16 * E:  # prefill sizes: the expert GEMMs' tiles
            sweep_expert_tiles(time_fp8, (64, 128), [(64, 128, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3),
                                                     (128, 128, 8, 4), (256, 128, 8, 3)])
        elif sweep and t * TOP_K <= 4 * E:  # decode sizes: weight-streaming, narrow tiles spread over the SMs
            sweep_expert_tiles(time_fp8, (16,), [(16, 128, 4, 4), (32, 128, 4, 4), (64, 128, 4, 4),
                                                 (32, 128, 2, 4), (32, 128, 4, 6), (128, 128, 4, 4)])


def sweep_expert_tiles(time_fp8, block_ms, tiles):
    """The experts' tiles: each BLOCK_M with each gate/up tile (the default down tile), then each down tile with
    the best of those; tiles are (BLOCK_N, BLOCK_K = the activation group, warps, stages)."""

    def timed(**tiling):  # a tile that does not fit (shared memory) counts as never
        try:
            return time_fp8(**tiling)
        except Exception as e:  # noqa: BLE001 - Triton's out-of-resources error has no public class
            print(f"    {tiling}: {type(e).__name__}")
            return float("inf")

    gate_up = sorted((timed(block_m=bm, gate_up_cfg=c), bm, c) for bm in block_ms for c in tiles)
    print("    gate/up tiles (BLOCK_M, tile): " + "  ".join(f"{u:.1f}us {bm} {c}" for u, bm, c in gate_up[:4]))
    _, bm, best = gate_up[0]
    down = sorted((timed(block_m=bm, gate_up_cfg=best, down_cfg=c), c) for c in tiles)
    print(f"    down tiles (BLOCK_M {bm}, gate/up {best}): " + "  ".join(f"{u:.1f}us {c}" for u, c in down[:4]))


def moe_touched(tokens):
    return E * (1 - (1 - TOP_K / E) ** tokens)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,32,96,2048", help="dense GEMM rows ('' for none)")
    ap.add_argument("--tokens", default="1,32,96", help="expert tokens ('' for none)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--bandwidth-gbs", type=float, default=4250.0)
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    logging.basicConfig(format="%(message)s")  # the cuBLAS probe says which path prefill GEMMs take, and why
    logging.getLogger(fp8.__name__).setLevel(logging.INFO)
    dense([int(m) for m in a.rows.split(",") if m], a.sweep, a.bandwidth_gbs)
    experts([int(t) for t in a.tokens.split(",") if t], a.sweep, a.bandwidth_gbs)


if __name__ == "__main__":
    main()
