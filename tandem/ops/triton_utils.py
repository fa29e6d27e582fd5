"""Triton kernels serve CUDA tensors; everything else takes the torch reference. (The CPU test suite still runs
the kernels, called directly, under Triton's interpreter: TRITON_INTERPRET=1.)"""

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # a CPU machine without triton runs the torch references
    HAS_TRITON = False


def use_triton(x) -> bool:
    return HAS_TRITON and x.is_cuda
