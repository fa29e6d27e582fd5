import os
import sys

import pytest

# One OpenMP thread per process, this one and every process it starts (a cluster's router and workers inherit the
# variable): the suite runs several processes at once on few cores, and oversubscribed OpenMP workers spin while
# they wait for one another (test_serving's colocated oracle: 48 s of CPU with two threads on a loaded 2-core
# machine, 1.4 s with one). Set before torch is imported, which reads it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

# Without a GPU, Triton kernels run under the interpreter so the CPU suite checks them too (set before any
# kernel module is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))


def _round_like_the_gpu():
    """The interpreter (triton 3.6) rounds fp32 -> e4m3 / bf16 without carrying into the exponent (124.4 becomes
    64 in e4m3, not 128) and rounds ties up: no GPU does that. Those conversions get torch's (round to nearest
    even, as the hardware's cvt), so the interpreter tests can hold the kernels to the exact rounded values."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    original, rtne = interpreter._convert_float, interpreter._ir.ROUNDING_MODE.RTNE

    def convert(input, input_dtype, output_dtype, rounding_mode):
        target = {"fp8e4nv": (torch.float8_e4m3fn, torch.uint8, np.uint8),
                  "bf16": (torch.bfloat16, torch.int16, np.uint16)}.get(output_dtype.name)
        if input_dtype.name != "fp32" or target is None or rounding_mode not in (None, rtne):
            return original(input, input_dtype, output_dtype, rounding_mode)
        dtype, bits, np_bits = target
        t = torch.from_numpy(np.ascontiguousarray(input).view(np.float32)).to(dtype)
        return t.view(bits).numpy().view(np_bits).reshape(input.shape)

    interpreter._convert_float = convert


def _patch_the_language_once_per_launch():
    """The interpreter (triton 3.6) patches triton.language -- every builtin, found through inspect.getmembers -- for
    each launch, and again for each call of a @triton.jit helper inside the kernel: once per program at least,
    since every kernel here starts with `wait_for_prior_kernels`, and once per row where a loop calls one. That
    re-patching was a large part of an interpreted kernel's time. A helper's patch sets the modules the launch (or
    a helper before it in the same launch: triton.language's own, such as tl.sum, patch triton.language.core too)
    already patched to the same interpreted builtins, so within a launch that patched the helper's modules it is
    skipped; anything else patches as before."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch, run = interpreter._patch_lang, interpreter.GridExecutor.__call__
    launches = []  # per running launch: the language modules patched in it so far (None until its own patch)

    def modules(fn):
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_once(fn):
        if launches and launches[-1] is not None and modules(fn) <= launches[-1]:
            return interpreter._LangPatchScope()  # a helper inside the kernel: nothing left to patch
        scope = patch(fn)
        if launches:  # the launch's own patch (before any program runs), or a helper's with more modules
            launches[-1] = (launches[-1] or set()) | modules(fn)
        return scope

    def launch(self, *args, **kwargs):
        launches.append(None)
        try:
            return run(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch


if os.environ.get("TRITON_INTERPRET") == "1":
    _round_like_the_gpu()
    _patch_the_language_once_per_launch()

from hf_models import KINDS, make_hf_model  # noqa: E402


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """kind -> (hf model, directory written by save_pretrained)."""
    out = {}
    for kind in KINDS:
        model = make_hf_model(kind)
        d = tmp_path_factory.mktemp(f"hf-{kind}")
        model.save_pretrained(d)
        out[kind] = (model, str(d))
    return out


@pytest.fixture(scope="session")
def sm90_triton_cache(tmp_path_factory):
    """One Triton cache for every sm_90 compile check (tests/kernels_sm90.py): the checks share most variants.
    The no-compile check stays valid with it warm: Triton's post-compile hook fires on each variant a process
    first launches, read from this cache or not."""
    return tmp_path_factory.mktemp("sm90-triton-cache")
