"""Compiles, on a machine without a GPU, every Triton kernel variant a forward of a real model shape launches, for
the H200's architecture (sm_90), and reports each one's shared memory, registers and spills.

The interpreter (which runs the kernels in the CPU suite) checks what a kernel computes, not whether it fits a
GPU: a tile that needs more shared memory than an SM has only fails on the device. Triton compiles without a
device (its ptxas is in the wheel), so this script runs a forward -- the model's layers at the preset's real
sizes, the MTP head included -- with the kernel dispatch switched on and each launch replaced by a compile.
Nothing runs: the tensors are uninitialised CPU memory, and the outputs are never read.

    python tests/kernels_sm90.py [--preset qwen3.5-35b-a3b] [--dtype bfloat16] [--shapes decode:1x1,...]
    python tests/kernels_sm90.py --workload [--preset tiny-moe] [--seed 0] [--prefill-only] [--k 2] [--budget 256]

Shapes: `decode:BxQ` (B requests of Q rows each on a context of 300 tokens), `prefill:N` (one N-token prompt),
`mixed:BxQ+N` (both in one forward). Prints one line per kernel variant and exits 1 when one needs more shared
memory than an H200 gives a block (227 KB), or is launched early (programmatic dependent launch, as every kernel
is on the H200) and loads, stores or updates global memory before it waits for the kernel before it.

`--workload`: the serving check of tests/test_no_compiles.py without a GPU, on the preset's layer shapes (four
layers, a 1024-token vocabulary: the kernels' variants do not depend on either). An engine warms up as a worker does
(`Engine.warm_up`, then each decode and prefill graph bucket run once, as capturing them runs them), then serves a
continuous-batching workload; every variant compiled after the warm-up is printed, and the exit status is 1 if
there is one (a served step would have waited on that compile). Kernel outputs and the dense projections are never
computed, so the tokens are arbitrary; what decides the variants -- shapes, row counts, strides, dtypes -- is what
serving gives them.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") != "1", "the interpreter replaces the kernels this script compiles"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.config import ModelConfig  # noqa: E402
from tandem.batch import ForwardBatch  # noqa: E402
from tandem.model.loader import build_empty_model  # noqa: E402
from tandem.model.presets import PRESETS  # noqa: E402
from tandem.ops import attention, fp8, gdn, linear, moe, norm, pointwise, rope  # noqa: E402

H200_SMS = 132
H200_SHARED_PER_BLOCK = 232448  # bytes a block may opt into on sm_90 (227 KB)
BLOCK_SIZE, CONTEXT = 16, 300
LAYERS = 4  # three GDN layers and one attention layer (full_attention_interval 4): every kind of layer
BIG = 2**25  # elements: the experts' weights are above, every tensor torch computes with below


class _CompileOnlyDriver:
    """What the JIT asks the active driver for, answered for an H200 that is not there."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def _record_compiles(found: dict):
    """Every kernel launch compiles (or finds compiled) its variant and launches nothing."""
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        found.setdefault(id(kernel), (self.fn.__name__, kernel))
        return kernel

    JITFunction.run = compile_only


def _as_h200() -> None:
    """The dispatch takes the Triton path for these CPU tensors and sizes its grids for an H200's SMs."""
    for module in (attention, fp8, gdn, linear, moe, norm, pointwise, rope):
        module.use_triton = lambda x: True
        module.pdl = lambda x: {"PDL": True, "launch_pdl": True}  # as on the H200
    attention._target_programs = lambda device: attention.PROGRAMS_PER_SM * H200_SMS
    fp8._sm_count = lambda device: H200_SMS
    gdn.HAS_FLA = False  # long prompts take fla's kernels on the GPU; ours then take every row here
    # FP8 GEMMs of the rows cuBLAS takes (`fp8._cublas_fits`) launch no Triton GEMM there, only the quantiser
    fp8.cublas_layout = lambda device: (1, 1)
    fp8.w8a8_linear_cublas = _cublas_launches_only_the_quantiser


def _cublas_launches_only_the_quantiser(x, w, scale_inv, layout):
    fp8.activation_groups(x, 128)
    return x.new_empty(*x.shape[:-1], w.shape[0])


def _compile_only_on_h200() -> dict:
    """From here on launches compile for an H200 and do not run; returns the dict the compiled variants go to."""
    driver.set_active(_CompileOnlyDriver())
    found: dict = {}
    _record_compiles(found)
    _as_h200()
    return found


def _batch(cfg_blocks: int, rows: list[tuple[int, int]], k: int) -> ForwardBatch:
    """rows: (cached context, query rows) per request."""
    qsl, seq_lens = [0], []
    for cached, n in rows:
        qsl.append(qsl[-1] + n)
        seq_lens.append(cached + n)
    T, B = qsl[-1], len(rows)
    width = max(-(-s // BLOCK_SIZE) for s in seq_lens) + 1
    tables = torch.arange(1, B * width + 1, dtype=torch.int32).view(B, width) % cfg_blocks
    pos = torch.cat([torch.arange(c, c + n) for c, n in rows])
    req = torch.repeat_interleave(torch.arange(B), torch.tensor([n for _, n in rows]))
    slots = tables[req, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
    return ForwardBatch(
        input_ids=torch.zeros(T, dtype=torch.long), positions=pos, query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables, slot_mapping=slots,
        state_slots=torch.arange(1, B + 1), state_replay=torch.zeros(B, dtype=torch.long),
        state_pending=torch.stack([2 * torch.arange(1, B + 1), 2 * torch.arange(1, B + 1) + 1], 1),
        logits_indices=torch.tensor(qsl[1:]) - 1, query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)


def parse_shape(text: str) -> list[tuple[int, int]]:
    kind, _, size = text.partition(":")
    rows = []
    if kind in ("decode", "mixed"):
        bq = size.split("+")[0]
        b, q = (int(v) for v in bq.split("x"))
        rows += [(CONTEXT, q)] * b
    if kind in ("prefill", "mixed"):
        rows.append((0, int(size.split("+")[-1])))
    if not rows:
        raise ValueError(f"shape {text!r}: decode:BxQ, prefill:N or mixed:BxQ+N")
    return rows


def _caches(cfg: ModelConfig, dtype: torch.dtype, blocks: int, slots: int, k: int):
    kv = (blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    caches = []
    for t in cfg.layer_types:
        if t == "full_attention":
            caches.append((torch.empty(kv, dtype=dtype), torch.empty(kv, dtype=dtype)))
        else:
            caches.append((torch.empty(slots, cfg.conv_dim, cfg.conv_kernel - 1, dtype=dtype),
                           torch.empty(slots, cfg.gdn_num_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim,
                                       dtype=cfg.ssm_dtype or dtype),
                           torch.empty(2 * slots, k + 1, gdn.pending_width(cfg.conv_dim, cfg.gdn_num_k_heads,
                                                                       cfg.gdn_k_dim, cfg.gdn_num_v_heads,
                                                                       cfg.gdn_v_dim), dtype=dtype)))
    return caches, (torch.empty(kv, dtype=dtype), torch.empty(kv, dtype=dtype))


@contextlib.contextmanager
def _stacking_without_copies():
    """Fusing the projections stacks their weights by copying them: at the real shapes that writes every expert's
    weights again (16 GB resident at fp32), values no kernel here reads. An uninitialised tensor of the stacked
    shape has the same layout and stays untouched, so it costs no memory. Stacks below BIG elements (the ones torch
    computes with, given values by the workload) are copied as usual."""
    cat = torch.cat

    def uninitialised_cat(tensors, dim=0):
        shape = list(tensors[0].shape)
        shape[dim] = sum(t.shape[dim] for t in tensors)
        if math.prod(shape) < BIG:
            return cat(tensors, dim)
        fill = torch.utils.deterministic.fill_uninitialized_memory  # the workload's NaN fill would touch it all
        torch.utils.deterministic.fill_uninitialized_memory = False
        try:
            return torch.empty(shape, dtype=tensors[0].dtype, device=tensors[0].device)
        finally:
            torch.utils.deterministic.fill_uninitialized_memory = fill

    torch.cat = uninitialised_cat
    try:
        yield
    finally:
        torch.cat = cat


@contextlib.contextmanager
def _projections_not_computed(logits_weight: torch.Tensor | None = None):
    """The projections torch computes (`F.linear`, the dense ones) are most of a forward's CPU time at the real
    shapes, and their outputs, like every tensor here, are only passed to kernels that do not run: no variant
    depends on their values. They return an uninitialised tensor of the shape, dtype and layout `F.linear` gives;
    the projection by `logits_weight` (the lm_head, whose argmax are the tokens, and so the schedule) gives NaN, as
    computing it on the hidden states the kernels never write does."""
    linear = F.linear

    def uncomputed(x, w, bias=None):
        out = x.new_empty(*x.shape[:-1], w.shape[0])
        return out.fill_(math.nan) if w is logits_weight else out

    F.linear = uncomputed
    try:
        yield
    finally:
        F.linear = linear


def compile_forward_kernels(preset: str, dtype: torch.dtype, shapes: list[str]) -> list[tuple[str, object]]:
    """(kernel name, compiled kernel) of every variant the forwards of `shapes` launch, target and MTP head."""
    found = _compile_only_on_h200()
    cfg = ModelConfig.from_hf(dict(PRESETS[preset], num_hidden_layers=LAYERS))
    with _stacking_without_copies():
        model = build_empty_model(cfg, "cpu", dtype, with_mtp=True, fp8=cfg.quantization).fuse_projections()
    k = 2
    with torch.inference_mode(), _projections_not_computed():
        for shape in shapes:
            rows = parse_shape(shape)
            blocks = sum(-(-(c + n) // BLOCK_SIZE) + 1 for c, n in rows) + 1
            caches, mtp_cache = _caches(cfg, dtype, blocks, len(rows) + 1, k)
            batch = _batch(blocks, rows, k)
            hidden = model(batch, caches)
            embeds = model.model.embed_tokens(batch.input_ids)
            model.mtp(embeds, hidden, batch, model.inv_freq, mtp_cache)
    return list(found.values())


def compiles_after_warm_up(preset: str, seed: int, prefill_only: bool = False, k: int = 2,
                          budget: int = 256) -> list[str]:
    """Names and specialisations of the kernel variants the workload of tests/test_no_compiles.py compiles after
    the engine's warm-up (see the module docstring)."""
    from test_no_compiles import workload

    from tandem.config import EngineConfig
    from tandem.engine.engine import Engine

    _compile_only_on_h200()
    hf = PRESETS[preset]
    cfg = ModelConfig.from_hf(dict(hf, num_hidden_layers=LAYERS, vocab_size=min(hf["vocab_size"], 1024)))
    model = build_empty_model(cfg, "cpu", torch.bfloat16, with_mtp=True, fp8=cfg.quantization)
    # the weights torch meets get values (the same each run, NaN-filled where not floating point); the experts'
    # weights (only kernels meet them) stay untouched, or they would be resident (8.6 GB at bf16)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    for p in model.parameters():
        if p.numel() >= BIG:
            continue
        if p.dtype.is_floating_point and p.element_size() > 1:  # finite values where torch computes
            p.data.normal_(0.0, 0.02)
        else:
            p.data.copy_(torch.empty_like(p))  # the fill, as building the model under it gave
    with _stacking_without_copies():
        model = model.fuse_projections()
    # The kernels' outputs are never written. Only the tokens decide the schedule, and they are the argmax of the
    # lm_head's output, NaN (the projections' inputs are kernel outputs): so every run takes the same schedule,
    # that of computing them, while every other fresh tensor stays unfilled (filling them all with NaN was most
    # of a run's time, and touched every page of them)
    torch.utils.deterministic.fill_uninitialized_memory = False
    with _projections_not_computed(logits_weight=model.lm_head_weight):
        eng = Engine(cfg, model,
                     EngineConfig(block_size=16, max_num_seqs=16, max_model_len=1024, max_num_batched_tokens=budget,
                                  num_speculative_tokens=k, device="cpu", dtype="bfloat16", cuda_graphs=True),
                     prefill_only=prefill_only)
        eng.warm_up()
        graphs, pieces = eng.graphs, eng.runner.prefill_graphs
        for B in reversed(graphs.buckets if graphs is not None else []):  # what `capture_graphs` runs before capturing
            graphs._capture(B)
            graphs.verify_graphs[B].replay()
            if graphs.k:
                graphs.draft_graphs[B].replay()
        with torch.inference_mode():
            for n in reversed(pieces.buckets):
                pieces.model(pieces._static_batch(n), pieces.caches)
        late = []
        triton.knobs.runtime.jit_post_compile_hook = lambda **kw: late.append(
            f"{kw['fn'].name}: constants {kw['compile']['constants']}, signature {kw['compile']['signature']}, "
            f"attributes {kw['compile']['configs']}")
        workload(eng, seed=seed)
    return late


_GLOBAL_MEMORY_OP = re.compile(r"^\s*(@%p\d+\s+)?(ld|st|atom|red|cp\.async)\.[\w.:]*global", re.M)


def waits_before_touching_memory(ptx: str) -> bool:
    """Whether the kernel's first global load, store or atomic comes after its `griddepcontrol.wait` (a kernel
    launched early that touched memory before would race the kernel before it)."""
    wait = ptx.find("griddepcontrol.wait")
    first = _GLOBAL_MEMORY_OP.search(ptx)
    return wait >= 0 and (first is None or first.start() > wait)


def resources(kernel) -> dict:
    """Registers, spill stores and local memory of a compiled kernel, read from its cubin by cuobjdump."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    out = {}
    for field in ("REG", "STACK", "LOCAL"):
        tail = text.split(f"{field}:", 1)
        out[field.lower()] = int(tail[1].split()[0]) if len(tail) > 1 else -1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3.5-35b-a3b")
    ap.add_argument("--dtype", default="bfloat16")
    # 301 rows: FP8 prefill GEMMs of a row count cuBLAS does not take run the Triton kernel
    ap.add_argument("--shapes", default="decode:1x1,decode:1x3,decode:64x3,prefill:301,prefill:2048,mixed:32x3+1024")
    ap.add_argument("--workload", action="store_true", help="the serving check (see above); --preset a tiny one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill-only", action="store_true", help="--workload on a prefill worker's engine")
    ap.add_argument("--k", type=int, default=2, help="--workload: MTP drafts per step")
    ap.add_argument("--budget", type=int, default=256, help="--workload: the engine's step budget (tokens)")
    args = ap.parse_args()
    if args.workload:
        late = compiles_after_warm_up(args.preset, args.seed, args.prefill_only, args.k, args.budget)
        print("\n".join(late))
        print(f"{len(late)} kernel variants compiled after the warm-up")
        return 1 if late else 0
    kernels = compile_forward_kernels(args.preset, getattr(torch, args.dtype), args.shapes.split(","))
    too_big = racing = 0
    for name, kernel in sorted(kernels, key=lambda nk: nk[0]):
        md, res = kernel.metadata, resources(kernel)
        over = md.shared > H200_SHARED_PER_BLOCK
        # launched while the kernel before it runs, it must wait for that one before it touches memory
        race = md.launch_pdl and not waits_before_touching_memory(kernel.asm["ptx"])
        too_big += over
        racing += race
        print(f"{name:32s} shared {md.shared:7d} B  warps {md.num_warps}  stages {md.num_stages}"
              f"  regs {res['reg']:3d}  stack {res['stack']:4d}  local {res['local']:4d}"
              f"  early launch {'on' if md.launch_pdl else 'off'}"
              + ("  OVER THE H200's SHARED MEMORY" if over else "")
              + ("  TOUCHES MEMORY BEFORE WAITING FOR THE KERNEL BEFORE" if race else ""))
    print(f"{len(kernels)} kernel variants for sm_90, {too_big} over {H200_SHARED_PER_BLOCK} bytes of shared memory, "
          f"{racing} touching memory before waiting for the kernel before")
    return 1 if too_big or racing else 0


if __name__ == "__main__":
    sys.exit(main())
