"""Triton kernels serve CUDA tensors; everything else takes the torch reference. (The CPU test suite still runs
the kernels, called directly, under Triton's interpreter: TRITON_INTERPRET=1.) TANDEM_TORCH_OPS=1 sends CUDA
tensors to the references too, to tell a kernel problem from anything else. Also what several kernels' dispatches
share: the decode-size row tile (`row_block`), persistent zeroed counters (`zeroed_counters`) and programmatic
dependent launch (`pdl`, `wait_for_prior_kernels`)."""

import functools
import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # a CPU machine without triton runs the torch references
    HAS_TRITON = False

TORCH_OPS_ONLY = os.environ.get("TANDEM_TORCH_OPS", "") == "1"
# TANDEM_PDL=0 launches every kernel only once the one before it has finished (to time the difference, or to rule
# programmatic dependent launch out)
PDL_OFF = os.environ.get("TANDEM_PDL", "") == "0"


def use_triton(x) -> bool:
    return HAS_TRITON and x.is_cuda and not TORCH_OPS_ONLY


@functools.cache
def _hopper_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl(x) -> dict:
    """The launch arguments of programmatic dependent launch for a kernel on x's device. On Hopper and later a
    kernel so launched is scheduled while the kernel before it is still running, and waits in
    `wait_for_prior_kernels` for it to finish; a decode step is ~500 kernels of a few µs each, so the launch gap
    between kernels is otherwise a large part of it. Every kernel takes `PDL` and calls `wait_for_prior_kernels`
    before it touches memory: a kernel launched early that did not would race its predecessor."""
    on = x.is_cuda and not PDL_OFF and _hopper_or_later(x.device.index)
    return {"PDL": on, "launch_pdl": on}


if HAS_TRITON:

    @triton.jit
    def wait_for_prior_kernels(PDL: tl.constexpr):
        """The first thing every kernel does: with PDL, wait until the kernel before it on the stream has finished
        and its writes are visible (so nothing before this may read or write memory), then let the kernel after
        it be scheduled (it waits the same way)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()


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
