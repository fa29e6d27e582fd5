"""Every Triton kernel variant a forward of the real model shapes launches compiles for the H200 (sm_90) and fits
its shared memory: `tests/kernels_sm90.py` compiles them here, without a GPU (see its docstring). The interpreter
tests check the values; this checks what only the device would otherwise reject."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("kernels_sm90.py")


def run_check(cache_dir, *args, code=None):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    cmd = [sys.executable, str(SCRIPT), *args] if code is None else [sys.executable, "-c", code, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=SCRIPT.parent)


@pytest.mark.parametrize("preset,dtype", [("qwen3.5-35b-a3b", "bfloat16"), ("qwen3.5-35b-a3b-fp8", "bfloat16"),
                                          ("qwen3.5-35b-a3b", "float32")])
def test_real_shapes_fit_the_h200(sm90_triton_cache, preset, dtype):
    res = run_check(sm90_triton_cache, "--preset", preset, "--dtype", dtype)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if " B  warps " in line]
    names = {line.split()[0] for line in lines}
    # every kernel is launched early on the H200, and waits for the one before it (else the script fails)
    assert all("early launch on" in line for line in lines), res.stdout
    # the forward reached every kernel family of a Qwen3.5 MoE layer and the MTP head
    expected = {"_paged_attn_kernel", "_attn_reduce_kernel", "_causal_conv1d_kernel", "_gdn_recurrent_kernel",
                "_moe_gate_up_kernel", "_moe_down_kernel", "_route_kernel", "_add_rms_norm_1p_kernel",
                "_qk_norm_rope_kernel", "_gated_rms_norm_kernel"}
    if preset.endswith("fp8"):
        expected |= {"_w8a8_kernel", "_quantize_groups_kernel"}
    assert expected <= names, sorted(expected - names)


def test_the_check_catches_tiles_too_large_for_the_h200(sm90_triton_cache):
    """fp32 prefill attention with the 16-bit tiles (128 x 64 at head_dim 256) needs 295 KB: the check must fail."""
    code = ("import sys; sys.argv[0] = 'kernels_sm90.py'; import kernels_sm90 as k; from tandem.ops import attention; "
            "attention.FP32_PREFILL_M, attention.FP32_PREFILL_BLOCK_N = attention.PREFILL_M, "
            "attention.PREFILL_BLOCK_N; sys.exit(k.main())")
    res = run_check(sm90_triton_cache, "--dtype", "float32", "--shapes", "prefill:300", code=code)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    over = [line for line in res.stdout.splitlines() if "OVER" in line]
    assert over and all(line.startswith("_paged_attn_kernel") for line in over), res.stdout


RACY = '''
import triton
import triton.language as tl

from tandem.ops.triton_utils import wait_for_prior_kernels


@triton.jit
def loads_before_waiting(x_ptr, y_ptr, PDL: tl.constexpr):
    v = tl.load(x_ptr + tl.arange(0, 16))
    wait_for_prior_kernels(PDL)
    tl.store(y_ptr + tl.arange(0, 16), v)


@triton.jit
def waits_first(x_ptr, y_ptr, PDL: tl.constexpr):
    wait_for_prior_kernels(PDL)
    tl.store(y_ptr + tl.arange(0, 16), tl.load(x_ptr + tl.arange(0, 16)))
'''


def test_the_check_catches_a_kernel_touching_memory_before_its_wait(sm90_triton_cache, tmp_path):
    """Compiled for sm_90 with programmatic dependent launch, a kernel that loads before `wait_for_prior_kernels`
    fails the script's check, and the same kernel with the wait first passes it."""
    (tmp_path / "racy.py").write_text(RACY)
    code = ("import sys; import kernels_sm90 as k; sys.path.insert(0, sys.argv[1]); import racy, triton; "
            "from triton.backends.compiler import GPUTarget; from triton.compiler import ASTSource\n"
            "for fn in (racy.loads_before_waiting, racy.waits_first):\n"
            "    src = ASTSource(fn=fn, signature={'x_ptr': '*fp32', 'y_ptr': '*fp32', 'PDL': 'constexpr'}, "
            "constexprs={'PDL': True})\n"
            "    kernel = triton.compile(src, target=GPUTarget('cuda', 90, 32), options={'launch_pdl': True})\n"
            "    print(fn.fn.__name__, k.waits_before_touching_memory(kernel.asm['ptx']))")
    res = run_check(sm90_triton_cache, str(tmp_path), code=code)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.split() == ["loads_before_waiting", "False", "waits_first", "True"], res.stdout
