"""A served step never waits on a Triton compile: after `Engine.warm_up` and `Engine.capture_graphs` (what a worker
does before it serves), a continuous-batching workload -- prompts of many lengths joining while others decode,
k = 2 drafts, chunked prefill -- compiles no kernel. Triton's post-compile hook names each compile and its
specialisation. On the GPU the engine runs; on the CPU (the interpreter compiles nothing) `tests/kernels_sm90.py
--workload` compiles each launch for sm_90 instead of running it, which is all this check needs."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.sampling_params import SamplingParams
from tandem.model.presets import preset_config, random_model


def workload(eng: Engine, seed: int = 0, requests: int = 48) -> None:
    """Requests of many lengths arriving between steps; a prefill-only engine hands each one off (drops it) once
    its first token is out, as a prefill worker does."""
    rng = random.Random(seed)
    added = 0
    while added < requests or eng.has_work():
        for _ in range(rng.randint(0, 3) if added < requests else 0):  # arrivals between steps
            n = rng.choice([1, 2, 3, 5, 9, 17, 40, 63, 64, 65, 200]) if rng.random() < 0.5 else rng.randint(1, 700)
            eng.add_request(f"r{added}", [rng.randrange(2, 500) for _ in range(n)],
                            SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True, temperature=0.0))
            added += 1
        eng.step()
        if eng.scheduler.prefill_only:
            eng.take_prefilled()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-moe", "tiny-dense"])
def test_no_kernel_compiles_after_warm_up(name):
    import triton

    cfg = preset_config(name)
    model = random_model(cfg, "cuda", torch.bfloat16, seed=0)
    eng = Engine(cfg, model, EngineConfig(block_size=16, max_num_seqs=16, max_model_len=1024,
                                          max_num_batched_tokens=256, num_speculative_tokens=2, device="cuda",
                                          dtype="bfloat16", kv_cache_memory_bytes=4 << 30))
    eng.warm_up()
    eng.capture_graphs()
    compiled = []
    knobs = triton.knobs.runtime
    old, knobs.jit_post_compile_hook = knobs.jit_post_compile_hook, \
        lambda *args, **kw: compiled.append(kw.get("repr"))  # the kernel, its launch options and specialisation
    try:
        workload(eng)
    finally:
        knobs.jit_post_compile_hook = old
    assert compiled == []
    assert eng.pools.blocks.num_used == 0 and eng.pools.slots.num_used == 0


# seed 6 of the 35B-A3B ends a prompt with a 5-8 row chunk on a long context (split-K in the 8-row decode tiling);
# a prefill-only engine (a P/D prefill worker) has no decode graphs to warm its batch-size-dependent variants; at a
# budget of 1024 the FP8 preset's MTP passes reach prefill-size GEMMs of row counts cuBLAS does not take (on an
# H100 the first such pass compiled for 2.4 s while serving, before the warm-up's 257-row prompt); at a budget
# of 8192, past two prompts of the longest length, the warm-up's split-K tails once went missing (late attention
# variants: 5-16 row chunks on a long context), and seed 3 has a step of 114 tokens (1026 expert pairs), which
# took a MoE align variant no other step size does
@pytest.mark.parametrize("name,seed,prefill_only,k,budget", [
    ("qwen3.5-35b-a3b", 0, False, 2, 256), ("qwen3.5-35b-a3b", 6, False, 2, 256), ("qwen3.5-35b-a3b", 0, True, 2, 256),
    ("qwen3.5-35b-a3b", 0, False, 0, 256), ("qwen3.5-35b-a3b-fp8", 0, False, 2, 1024),
    ("qwen3.5-35b-a3b-fp8", 3, False, 2, 8192), ("tiny-moe", 0, False, 2, 256), ("tiny-dense", 0, False, 2, 256)])
def test_no_kernel_compiles_after_warm_up_for_sm90(name, seed, prefill_only, k, budget, sm90_triton_cache):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(sm90_triton_cache)
    script = Path(__file__).with_name("kernels_sm90.py")
    res = subprocess.run([sys.executable, str(script), "--workload", "--preset", name, "--seed", str(seed),
                          "--k", str(k), "--budget", str(budget)] + (["--prefill-only"] if prefill_only else []),
                         env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0 and "0 kernel variants compiled after the warm-up" in res.stdout, \
        res.stdout[-4000:] + res.stderr[-3000:]


def test_workers_name_kernel_variants_loaded_while_serving(sm90_triton_cache):
    """The hook a worker installs once warmed up names the next variant Triton loads, with its constants: here the
    group quantiser, compiled for sm_90 (as `tests/kernels_sm90.py` does) after the hook is in place."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(sm90_triton_cache)
    code = ("import logging, sys, torch; sys.argv[0] = 'kernels_sm90.py'; import kernels_sm90; logging.basicConfig(); "
            "from tandem.ops import fp8; from tandem.worker_setup import name_late_kernel_variants; "
            "kernels_sm90._compile_only_on_h200(); name_late_kernel_variants(); "
            "fp8.quantize_activations_triton(torch.zeros(4, 384, dtype=torch.bfloat16), 128)")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parent)
    assert res.returncode == 0, res.stderr[-3000:]
    named = [line for line in res.stderr.splitlines() if "while serving" in line]
    assert len(named) == 1 and "_quantize_groups_kernel" in named[0] and "384" in named[0], res.stderr[-3000:]
