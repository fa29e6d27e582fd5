"""Triton kernels serve CUDA tensors; everything else takes the torch reference. (The CPU test suite still runs
the kernels, called directly, under Triton's interpreter: TRITON_INTERPRET=1.) TANDEM_TORCH_OPS=1 sends CUDA
tensors to the references too, to tell a kernel problem from anything else. Also what several kernels' dispatches
share: the decode-size row tile (`row_block`), persistent zeroed counters (`zeroed_counters`) and programmatic
dependent launch (`pdl_args`, `wait_for_producers`)."""

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # a CPU machine without triton runs the torch references
    HAS_TRITON = False
try:  # programmatic dependent launch's wait (in Triton since 3.4): older ones launch plainly
    from triton.language.extra.cuda import gdc_wait

    HAS_PDL = True
except ImportError:
    HAS_PDL = False

TORCH_OPS_ONLY = os.environ.get("TANDEM_TORCH_OPS", "") == "1"
# TANDEM_PDL=0: plain launches on Hopper too (to compare, or to rule programmatic dependent launch out)
PDL_OFF = os.environ.get("TANDEM_PDL", "") == "0"
_PDL: dict[int, bool] = {}


def use_triton(x) -> bool:
    return HAS_TRITON and x.is_cuda and not TORCH_OPS_ONLY


def pdl_args(x: torch.Tensor) -> dict:
    """A kernel launch's `PDL` and launch options for tensors on x's device. On Hopper and later GPUs every kernel
    here is launched with programmatic dependent launch: the GPU may start it while the kernel before it on the
    stream finishes (about 0.3-0.7 us a launch less in a CUDA graph on an H100), and its first statement
    (`wait_for_producers`) waits for that kernel's writes. Elsewhere, and in the interpreter, a plain launch."""
    if not x.is_cuda or PDL_OFF or not HAS_PDL:
        return {"PDL": False}
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index not in _PDL:
        _PDL[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return {"PDL": True, "launch_pdl": True} if _PDL[index] else {"PDL": False}


if HAS_TRITON:

    @triton.jit
    def wait_for_producers(PDL: tl.constexpr):
        """Every kernel's first statement: launched early (PDL), it waits here until the kernel before it has
        finished and its writes are visible. That kernel waited in turn, so every earlier kernel has finished too
        -- which holds only if no kernel reads or writes anything before this line."""
        if PDL:
            gdc_wait()

else:
    wait_for_producers = None  # what the kernels' modules import; they define no kernels without triton


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
