"""Fused projections (`Qwen3_5ForCausalLM.fuse_projections`): one GEMM per group of projections reading the same
input gives the unfused model's logits and greedy tokens, with the parameters as views of the fused weights
(no extra memory, names and state_dict unchanged)."""

import pytest
import torch
import torch.nn.functional as F

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import ScheduledChunk
from tandem.model.loader import build_empty_model
from tandem.config import ModelConfig
from tandem.model.presets import PRESETS, preset_config, random_model
from tandem.model.qwen3_5 import MLP, ROW_ALIGN, SHARED_AS_EXPERT_MAX_ROWS, GatedAttention, GatedDeltaNet, SparseMoE
from tandem.ops import moe
from tandem.ops.triton_utils import HAS_TRITON
from tandem.parallel import TPGroup
from admitted import admitted

NAMES = ["tiny-moe", "tiny-dense", "tiny-moe-hosting"]
HOSTING = "-hosting"  # a MoE preset whose shared expert has the experts' size, as in the real checkpoints


def config(name: str) -> ModelConfig:
    """A preset, or (name ending in HOSTING) the preset with the shared expert resized to the experts' size, so
    that the experts host it (`Experts.host`)."""
    if not name.endswith(HOSTING):
        return preset_config(name)
    d = dict(PRESETS[name.removesuffix(HOSTING)])
    return ModelConfig.from_hf(dict(d, shared_expert_intermediate_size=d["moe_intermediate_size"]))
FUSED = (GatedDeltaNet, GatedAttention, MLP, SparseMoE)


def is_fp8(model) -> bool:
    return any(p.dtype == torch.float8_e4m3fn for p in model.parameters())


def unfused_copy(cfg, model):
    """The same weights in a freshly built (so never fused) model, each parameter a tensor of its own."""
    ref = build_empty_model(cfg, "cpu", torch.float32, with_mtp=hasattr(model, "mtp"),
                            fp8=cfg.quantization if is_fp8(model) else None)
    ref.load_state_dict(model.state_dict())
    assert all(m._groups is None for m in ref.modules() if isinstance(m, FUSED))
    return ref


def fused_modules(model):
    return [m for m in model.modules() if isinstance(m, FUSED)]


def assert_fused(model):
    """Every fusable module has its fused weight, and each of its projections is a row view inside it, in order."""
    mods = fused_modules(model)
    assert {type(m) for m in mods} >= {GatedDeltaNet, GatedAttention}
    for m in mods:
        assert m._groups and sorted(i for g in m._groups for i in g.index) == list(range(len(m._fused_names)))
        for g in m._groups:
            names = [m._fused_names[i] for i in g.index]
            stacked = [(g.weight, names)]
            if g.scale_inv is not None:  # FP8: the scales stack in the same order
                stacked.append((g.scale_inv, [n + "_scale_inv" for n in names]))
            for fused, params in stacked:
                assert fused.is_contiguous()
                start, end = fused.data_ptr(), fused.data_ptr() + fused.numel() * fused.element_size()
                ptr, rows = start, 0
                for name in params:
                    p = m.get_parameter(name)
                    assert p.data_ptr() == ptr and p.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
                    ptr += p.numel() * p.element_size()
                    rows += p.shape[0]
                    assert torch.equal(p.float(), fused[rows - p.shape[0] : rows].float())
                if g.scale_inv is None:  # high precision: padded to whole 16-byte output rows (cuBLAS's fast path)
                    assert fused.shape[0] % ROW_ALIGN == 0 and 0 <= fused.shape[0] - rows < ROW_ALIGN
                    assert ptr == start + rows * fused.shape[1] * fused.element_size()
                else:
                    assert ptr == end and rows == fused.shape[0]



def prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in lengths]


def packed_logits(cfg, model, ps):
    """Logits at every row of one packed prefill batch, then of one decode step of every request."""
    eng = Engine(cfg, model, EngineConfig(block_size=4, max_num_seqs=8, max_model_len=128))
    seqs = [admitted(eng, str(i), p) for i, p in enumerate(ps)]
    prefill = eng.runner.run([ScheduledChunk(s, len(p)) for s, p in zip(seqs, ps)], all_rows=True)
    for s in seqs:
        s.prompt_token_ids.append(7)
    decode = eng.runner.run([ScheduledChunk(s, 1) for s in seqs], all_rows=True)
    return torch.cat([prefill, decode])


def greedy(cfg, model, ps, k):
    eng = Engine(cfg, model, EngineConfig(block_size=4, max_num_seqs=3, max_num_batched_tokens=16,
                                          max_model_len=128, num_speculative_tokens=k))
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    out = {}
    while eng.has_work():
        out.update({s.request_id: list(s.output_token_ids) for s in eng.step()})
    return [out[str(i)] for i in range(len(ps))]


@pytest.mark.parametrize("name", NAMES + ["tiny-moe-fp8", "tiny-moe-fp8-hosting"])
def test_fused_model_equals_unfused(name):
    """For the FP8 preset (W8A8 through the torch reference): the e4m3 projections stack apart from the
    high-precision ones (router, gates, GDN a/b), so fusing changes only the GEMM count, not the maths."""
    cfg = config(name)
    model = random_model(cfg, "cpu", torch.float32, seed=2, fp8_compute=cfg.quantization is not None)
    assert_fused(model)
    if cfg.quantization is not None:
        assert is_fp8(model)
        gdn, moe_block = model.model.layers[0].linear_attn, model.model.layers[0].mlp
        assert [g.index for g in gdn._groups] == [[0, 1], [2, 3]]  # qkv | z in e4m3, b | a in fp32
        # router | gate, shared gate | up; or, with the shared expert hosted by the experts, router | gate alone
        assert [g.index for g in moe_block._groups] == ([[0, 1]] if moe_block.hosted else [[0, 3], [1, 2]])
    ref = unfused_copy(cfg, model)
    assert list(model.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert not any(n.endswith("_fused") for n, _ in model.named_buffers())
    ps = prompts([1, 7, 19, 33])
    got, want = packed_logits(cfg, model, ps), packed_logits(cfg, ref, ps)
    assert (got - want).abs().max() <= 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    gp = prompts([3, 20, 7, 12, 1], seed=3)
    for k in (0, 2):  # the MTP head's layer is fused too
        assert greedy(cfg, model, gp, k) == greedy(cfg, ref, gp, k)


def test_moe_block_is_one_gemm_with_the_shared_expert():
    model = random_model(preset_config("tiny-moe"), "cpu", torch.float32)
    moe = model.model.layers[0].mlp
    cfg = model.cfg
    inter = cfg.shared_expert_intermediate_size
    (group,) = moe._groups
    rows = cfg.num_experts + 2 * inter + 1
    assert group.weight.shape == (-(-rows // ROW_ALIGN) * ROW_ALIGN, cfg.hidden_size) and rows % ROW_ALIGN
    assert [y.shape[1] for y in moe.project(torch.zeros(2, cfg.hidden_size))] == [cfg.num_experts, inter, inter, 1]
    # the shared expert's own gate | up is a view of the MoE block's rows, not a second copy
    (own,) = moe.shared_expert._groups
    assert own.weight.data_ptr() == moe.shared_expert.gate_proj.weight.data_ptr()
    assert own.weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    want = (torch.nn.functional.silu(moe.shared_expert.gate_proj(x)) * moe.shared_expert.up_proj(x))
    assert torch.allclose(moe.shared_expert(x), moe.shared_expert.down_proj(want), atol=1e-6)


@pytest.mark.parametrize("name", ["tiny-moe-hosting", "tiny-moe-fp8-hosting"])
def test_experts_host_a_shared_expert_of_their_size(name):
    """The shared expert becomes expert E of [E + 1, ...] expert tensors (its parameters views into them, no
    copy); up to SHARED_AS_EXPERT_MAX_ROWS rows every token is routed to it with weight sigmoid(gate logit), more
    rows run it by its own GEMMs: both give the unfused block's output. Not when the sizes differ (tiny-moe)."""
    assert not any(m.hosted for m in random_model(preset_config("tiny-moe"), "cpu", torch.float32).modules()
                   if isinstance(m, SparseMoE))
    cfg = config(name)
    fp8 = cfg.quantization is not None
    model = random_model(cfg, "cpu", torch.float32, seed=4, fp8_compute=fp8)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert len(blocks) == len(cfg.moe_layers) + 1 and all(b.hosted for b in blocks)  # the MTP head's too
    block, E, inter = blocks[0], cfg.num_experts, cfg.moe_intermediate_size
    gate_up, down, gate_up_scale, down_scale = block.experts._with_shared
    shared = block.shared_expert
    assert gate_up.shape == (E + 1, 2 * inter, cfg.hidden_size) and down.shape == (E + 1, cfg.hidden_size, inter)
    views = [(block.experts.gate_up_proj, gate_up[:E]), (shared.gate_proj.weight, gate_up[E, :inter]),
             (shared.up_proj.weight, gate_up[E, inter:]), (block.experts.down_proj, down[:E]),
             (shared.down_proj.weight, down[E])]
    if fp8:
        half = gate_up_scale.shape[1] // 2
        views += [(shared.gate_proj.weight_scale_inv, gate_up_scale[E, :half]),
                  (shared.up_proj.weight_scale_inv, gate_up_scale[E, half:]),
                  (shared.down_proj.weight_scale_inv, down_scale[E])]
    for param, rows in views:
        assert param.data_ptr() == rows.data_ptr() and param.shape == rows.shape
    ref = unfused_copy(cfg, model)
    ref_block = [m for m in ref.modules() if isinstance(m, SparseMoE)][0]
    assert not ref_block.hosted
    x = torch.randn(SHARED_AS_EXPERT_MAX_ROWS + 3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for rows in (1, 6, SHARED_AS_EXPERT_MAX_ROWS, SHARED_AS_EXPERT_MAX_ROWS + 3):
        assert (block(x[:rows]) - ref_block(x[:rows])).abs().max() <= 1e-5


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its interpreter runs the kernels on the CPU)")
def test_hosted_shared_expert_through_the_kernels(monkeypatch):
    """The kernel path of a hosting block (routing kernel with the shared pair, grouped GEMMs over E + 1 experts,
    per-pair outputs left unsummed) under the interpreter, summed by the residual norm's kernel, against the
    unfused block's torch output."""
    from tandem.ops import norm

    cfg = config("tiny-moe-hosting")
    model = random_model(cfg, "cpu", torch.float32, seed=5)
    block = model.model.layers[0].mlp
    ref_block = [m for m in unfused_copy(cfg, model).modules() if isinstance(m, SparseMoE)][0]
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    h = torch.zeros_like(x)
    monkeypatch.setattr(moe, "use_triton", lambda t: True)
    parts = block(x)
    assert parts.shape == (7, cfg.num_experts_per_tok + 1, cfg.hidden_size)
    total, _ = norm.add_rms_norm_1p_triton(h, parts, model.model.layers[1].input_layernorm.weight, 1e-6)
    assert (total - ref_block(x)).abs().max() <= 1e-5
    # the routing was ranked (its counters' atomics), and the block left the counters at zero for the next one
    assert not moe.routing_counters(x.device, 2).any()
    assert torch.equal(block(x), parts)


@pytest.mark.parametrize("name", NAMES)
def test_fusing_again_changes_nothing(name):
    model = random_model(config(name), "cpu", torch.float32)
    def fused_ptrs():
        return {id(m): [g.weight.data_ptr() for g in m._groups] for m in fused_modules(model)}

    before = fused_ptrs()
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    model.fuse_projections()
    assert fused_ptrs() == before
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    assert_fused(model)


def test_converting_the_model_keeps_it_fused():
    cfg = preset_config("tiny-moe")
    model = random_model(cfg, "cpu", torch.float32)
    ps = prompts([5, 9])
    want = packed_logits(cfg, model, ps)
    model.to(torch.float64).to(torch.float32)  # every parameter gets a new tensor, twice
    assert_fused(model)
    assert all(g.weight.dtype == torch.float32 for m in fused_modules(model) for g in m._groups)
    assert torch.equal(packed_logits(cfg, model, ps), want)


def test_unfused_model_runs_the_separate_projections():
    cfg = preset_config("tiny-moe")
    model = random_model(cfg, "cpu", torch.float32)
    ref = unfused_copy(cfg, model)
    ps = prompts([4, 11])
    assert (packed_logits(cfg, ref, ps) - packed_logits(cfg, model, ps)).abs().max() <= 1e-5


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its interpreter runs the kernel on the CPU)")
@pytest.mark.parametrize("renorm", [False, True])
def test_routing_kernel_from_fused_logits(monkeypatch, renorm):
    """The GPU branch of route_logits (the routing kernel, under the interpreter here) on the router's columns of a
    fused output, against `route` on the input."""
    g = torch.Generator().manual_seed(0)
    x, router, other = (torch.randn(n, 64, generator=g) for n in (7, 16, 9))
    logits = F.linear(x, torch.cat([router, other]))[:, :16]  # strided, as in SparseMoE
    monkeypatch.setattr(moe, "use_triton", lambda t: True)
    w, e = moe.route_logits(logits, 3, renorm)
    w_ref, e_ref = moe.route_torch(x, router, 3, renorm)
    assert torch.equal(e, e_ref) and torch.allclose(w, w_ref, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_tensor_parallel_shards_are_fused(name):
    cfg = config(name)
    for rank in range(2):
        part = random_model(cfg, "cpu", torch.float32, seed=3, tp=TPGroup(rank, 2))  # no process group needed
        assert_fused(part)
        attn = next(m for m in part.modules() if isinstance(m, GatedAttention))
        assert attn._groups[0].weight.shape[0] == (attn.nh * 2 + attn.nkv * 2) * attn.hd  # this rank's heads only


# ---------------------------------------------------------------------------------------------------- GPU

def cuda_kernels(fn) -> int:
    """Kernels `fn` launches on the GPU (copies and fills not counted)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset")))


def step_kernels(cfg, model, rows: int) -> int:
    """Kernels of one forward of `rows` new rows of a single request (rows 1: a decode step at batch 1)."""
    dtype = model.model.embed_tokens.weight.dtype
    eng = Engine(cfg, model, EngineConfig(block_size=4, max_num_seqs=2, max_model_len=128, device="cuda",
                                          dtype=dtype, kv_cache_memory_bytes=1 << 28))
    (p,) = prompts([9])
    seq = admitted(eng, "a", p)
    eng.runner.run([ScheduledChunk(seq, 9)])
    counts = []
    for _ in range(2):  # the first one compiles and warms up
        seq.prompt_token_ids += [7] * rows
        counts.append(cuda_kernels(lambda: eng.runner.run([ScheduledChunk(seq, rows)])))
    return counts[-1]


def on_gpu(cfg, model):
    ref = build_empty_model(cfg, "cuda", model.model.embed_tokens.weight.dtype, with_mtp=hasattr(model, "mtp"))
    ref.load_state_dict(model.state_dict())
    return ref


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_fused_model_equals_unfused_on_gpu(name):
    cfg = config(name)
    model = random_model(cfg, "cuda", torch.float32, seed=2)
    assert_fused(model)
    ref = on_gpu(cfg, model)
    ps = prompts([1, 7, 19, 33])

    def logits(m):
        eng = Engine(cfg, m, EngineConfig(block_size=4, max_num_seqs=8, max_model_len=128, device="cuda",
                                          kv_cache_memory_bytes=1 << 28))
        seqs = [admitted(eng, str(i), p) for i, p in enumerate(ps)]
        out = [eng.runner.run([ScheduledChunk(s, len(p)) for s, p in zip(seqs, ps)], all_rows=True)]
        for s in seqs:
            s.prompt_token_ids += [7, 8, 9]
        out.append(eng.runner.run([ScheduledChunk(s, 3) for s in seqs], all_rows=True))  # verify-shaped rows
        return torch.cat(out)

    got, want = logits(model), logits(ref)
    assert (got - want).abs().max() <= 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.gpu
@pytest.mark.parametrize("name, saved_decode, saved_verify", [
    # At least, by the GEMMs merged: per GDN layer 3 (2 with several rows: the gated norm copies z's strided
    # rows), per attention layer 2 (1: k's rows are copied for its norm), per MoE block 3 (2: the routing kernel
    # reads contiguous logits), per dense MLP 1. Both presets: 3 GDN layers, 1 attention layer. (cuBLAS may run
    # some of the small separate GEMMs as two kernels: more are saved then.)
    ("tiny-moe", 3 * 3 + 2 + 4 * 3, 3 * 2 + 1 + 4 * 2),
    ("tiny-dense", 3 * 3 + 2 + 4 * 1, 3 * 2 + 1 + 4 * 1),
    # the experts host the shared expert: per MoE block also its SiLU * up and its down GEMM
    ("tiny-moe-hosting", 3 * 3 + 2 + 4 * 5, 3 * 2 + 1 + 4 * 4),
])
def test_fused_model_launches_fewer_kernels(name, saved_decode, saved_verify):
    cfg = config(name)
    model = random_model(cfg, "cuda", torch.bfloat16)
    ref = on_gpu(cfg, model)
    assert step_kernels(cfg, ref, 1) - step_kernels(cfg, model, 1) >= saved_decode
    assert step_kernels(cfg, ref, 3) - step_kernels(cfg, model, 3) >= saved_verify
