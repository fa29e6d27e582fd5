"""Unquantised projections at decode and verify rows: cuBLAS (`F.linear`, what the dispatch takes below 33 rows
and for every projection but the skinny ones) against the skinny Triton kernel (`tandem/ops/linear.py`) over a
sweep of its tiles, each timed in a CUDA graph over enough weight copies to defeat the L2, next to its HBM floor.
The 35B-A3B's shapes: the MoE router | shared gate (the skinny kernel's), and GDN's out_proj / attention's
o_proj, which cuBLAS runs split-K plus a reduce at one row (8.8 us for 16.8 MB on the H200, 1.9 TB/s).

    python3 benchmarks/linear_decode.py [--rows 1,3,32,96] [--bandwidth-gbs 4250]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_gemm import copies, graph_time_us  # noqa: E402
from tandem.ops import linear  # noqa: E402

SHAPES = [("router | gate", 264, 2048), ("out_proj / o_proj", 2048, 4096)]  # (name, N, K)
TILES = list(itertools.product((16, 32), (128, 256, 512), (4, 8), (3, 4)))  # BLOCK_N, BLOCK_K, warps, stages


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,3,32,96")
    ap.add_argument("--bandwidth-gbs", type=float, default=4250.0)
    a = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}; us per call in a CUDA graph; floor at {a.bandwidth_gbs:.0f} GB/s")
    print(f"{'projection':<18} {'M':>3} {'floor':>6} {'cuBLAS':>7} {'skinny':>7}  "
          "best skinny tiles (N, K, warps, stages)")
    for name, N, K in SHAPES:
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5 for _ in range(copies(2 * N * K))]
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x.double(), ws[0].double())
            scale = F.linear(x.double().abs(), ws[0].double().abs())  # what the sum's rounding is relative to
            floor = (2 * N * K + 2 * m * (N + K)) / (a.bandwidth_gbs * 1e9) * 1e6
            cublas = graph_time_us([lambda w=w: F.linear(x, w) for w in ws])
            default = graph_time_us([lambda w=w: linear.skinny_linear_triton(x, w) for w in ws])
            results = []
            for tiles in TILES:
                try:
                    err = ((linear.skinny_linear_triton(x, ws[0], tiles).double() - want).abs() / scale).max().item()
                except OutOfResources:  # more shared memory than an SM has
                    continue
                if err > 2**-7:  # bf16 rounding is within 2^-8 (an absolute 1e-2 failed outputs past 4: every tile)
                    results.append((float("inf"), tiles))
                    continue
                results.append((graph_time_us([lambda w=w, t=tiles: linear.skinny_linear_triton(x, w, t)
                                               for w in ws]), tiles))
            results.sort()
            best = "  ".join(f"{us:.1f}us {t}" for us, t in results[:3])
            print(f"{name:<18} {m:>3} {floor:>6.1f} {cublas:>7.1f} {default:>7.1f}  {best}", flush=True)


if __name__ == "__main__":
    main()
