"""Triton kernels serve CUDA tensors; everything else takes the torch reference. (The CPU test suite still runs
the kernels, called directly, under Triton's interpreter: TRITON_INTERPRET=1.) TANDEM_TORCH_OPS=1 sends CUDA
tensors to the references too, to tell a kernel problem from anything else."""

import os

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # a CPU machine without triton runs the torch references
    HAS_TRITON = False

TORCH_OPS_ONLY = os.environ.get("TANDEM_TORCH_OPS", "") == "1"


def use_triton(x) -> bool:
    return HAS_TRITON and x.is_cuda and not TORCH_OPS_ONLY
