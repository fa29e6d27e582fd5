"""Triton kernels serve CUDA tensors; everything else takes the torch reference. (The CPU test suite still runs
the kernels, called directly, under Triton's interpreter: TRITON_INTERPRET=1.) TANDEM_TORCH_OPS=1 sends CUDA
tensors to the references too, to tell a kernel problem from anything else. Also what several kernels' dispatches
share: the decode-size row tile (`row_block`) and persistent zeroed counters (`zeroed_counters`)."""

import os

import torch

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # a CPU machine without triton runs the torch references
    HAS_TRITON = False

TORCH_OPS_ONLY = os.environ.get("TANDEM_TORCH_OPS", "") == "1"


def use_triton(x) -> bool:
    return HAS_TRITON and x.is_cuda and not TORCH_OPS_ONLY


def row_block(rows: int) -> int:
    """The row tile of a GEMM kernel at decode and verify sizes: three variants cover every row count."""
    return 16 if rows <= 16 else (32 if rows <= 32 else 64)


_COUNTERS: dict[tuple[str, torch.device], list[torch.Tensor]] = {}


def zeroed_counters(purpose: str, device, size: int, minimum: int) -> torch.Tensor:
    """Zeroed int32 counters for `purpose` (split-K tile arrivals, MoE routing counts), one buffer per purpose
    and device that every launch shares: they run one after another on a stream, and each leaves its counters at
    zero again. A larger buffer, when needed, is added and the old ones kept: a captured CUDA graph may point at
    them. Purposes get buffers of their own: a split-K GEMM may run while routing counts are live."""
    bufs = _COUNTERS.setdefault((purpose, torch.device(device)), [])
    if not bufs or bufs[-1].numel() < size:
        bufs.append(torch.zeros(max(size, minimum), dtype=torch.int32, device=device))
    return bufs[-1]
