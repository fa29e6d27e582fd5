"""Qwen3.5 hybrid decoder over the packed batch.

Layer i is Gated DeltaNet ("linear_attention") or gated full attention; every block is pre-norm:
`h += mixer(norm1(h)); h += ffn(norm2(h))`. Parameter names mirror the Hugging Face checkpoint
(`model.layers.{i}.linear_attn.in_proj_qkv`, ...), so the loader maps names one to one.

Tensor parallelism (`tp`, see `tandem/parallel.py`): each rank holds a share of the attention heads, of the GDN key
and value heads, of the MLP channels and of the experts. Input projections are column-parallel (this rank's
heads or channels), output projections row-parallel, so a mixer or FFN returns this rank's partial sum of its
output and the block all-reduces it. Embedding, norms, router and lm_head are replicated. `tp_splits` on a
module says how its full checkpoint tensors are cut (`Split`, collected by `parameter_splits`).

Fused projections (`Qwen3_5ForCausalLM.fuse_projections`, run once the weights are loaded): the projections of a
module that read the same input are stacked into one weight, so they run as one GEMM (a decode step at small batch
is bound by kernel launches): GDN's qkv | z | b | a, attention's q | k | v, the MLP's gate | up, and in the MoE
block router | shared expert's gate | shared expert's up | shared-expert gate. The parameters become row views of
the stacked weight (kept in the plain attribute `_groups`), so names, shapes, `state_dict` and loading are
unchanged; an unfused module (a freshly built one) runs the separate GEMMs.

FP8 (`tandem/model/fp8.py`, `to_fp8_layout`): the quantised projections become `Fp8Linear` (e4m3 weight plus
`weight_scale_inv`, W8A8 GEMM) and the experts hold e4m3 weights with their scales; fusing then stacks the e4m3
projections apart from the high-precision ones.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.config import ModelConfig
from tandem.batch import ForwardBatch
from tandem.ops.attention import paged_attention
from tandem.ops.fp8 import FP8_DTYPE, scale_shape, w8a8_linear
from tandem.ops.gdn import Gates, causal_conv1d, gated_delta_rule
from tandem.ops.linear import linear
from tandem.ops.moe import fused_experts, route_logits
from tandem.ops.norm import add_rms_norm_1p, gated_rms_norm, rms_norm_1p
from tandem.ops.pointwise import sigmoid_gate, silu_mul
from tandem.ops.rope import inv_frequencies, qk_norm_rope_write_kv, rope_tables
from tandem.parallel import SINGLE, Split, TPGroup
from tandem.profiling import phase


@dataclass
class Core:
    """The part of a mixer that depends on how the rows split into requests: paged attention, GDN's conv and
    recurrence over the requests' state slots. Everything else in a layer is row-wise. A forward is written as a
    generator (`steps`) that yields each core and is sent back its output, [T, ...]: `run_cores` runs the cores
    at once; the piecewise prefill graphs (tandem/engine/prefill_graphs.py) capture the row-wise parts between
    cores per token count and run the cores eagerly on each step's batch. `fn(*inputs, batch, *cache, out=None)`,
    with `out` a buffer for the result."""

    fn: Callable
    inputs: tuple[torch.Tensor, ...]
    cache: tuple[torch.Tensor, ...]

    def __call__(self, batch: ForwardBatch, rows: int | None = None, out=None):
        """On the first `rows` rows of the inputs (all when None)."""
        inputs = self.inputs if rows is None else tuple(t[:rows] for t in self.inputs)
        with phase("core." + self.fn.__name__):
            return self.fn(*inputs, batch, *self.cache, out=out)


def run_cores(steps: Generator, batch: ForwardBatch):
    """Drives a `steps` generator, running each core as it comes; returns the generator's result."""
    try:
        core = next(steps)
        while True:
            core = steps.send(core(batch))
    except StopIteration as done:
        return done.value


class RMSNorm1p(nn.Module):
    """Zero-centred RMSNorm: `rms(x) * (1 + w)`. `fp8_group`: the activation group of the FP8 GEMMs that read
    its output, if any (`Qwen3_5ForCausalLM.fuse_projections` sets it): the norm's kernel quantises for them."""

    fp8_group: int | None = None

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm_1p(x, self.weight, self.eps, self.fp8_group)

    def residual(self, h, delta):
        """(h + delta, its norm), one pass: the residual add of the block before, then this norm."""
        return add_rms_norm_1p(h, delta, self.weight, self.eps, self.fp8_group)


class GatedRMSNorm(nn.Module):
    """Per-value-head plain-weight RMSNorm followed by the SiLU gate: `w * rms(o) * silu(z)`, o and z [T, heads *
    dim] (or [T, heads, dim]). `fp8_group`: as `RMSNorm1p`'s (the GDN out projection's)."""

    fp8_group: int | None = None

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        return gated_rms_norm(x, z, self.weight, self.eps, self.fp8_group)


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


def _stacked(params: list[nn.Parameter]) -> bool:
    """Whether the `params` already lie one after another, in order, in one storage."""
    storage, offset = params[0].untyped_storage().data_ptr(), params[0].storage_offset()
    for p in params:
        if (not p.is_contiguous() or p.dtype != params[0].dtype or p.untyped_storage().data_ptr() != storage
                or p.storage_offset() != offset):
            return False
        offset += p.numel()
    return True


# cuBLAS falls back to slow (sm_75) GEMM kernels when an output row is not 16-byte aligned: the MoE block's
# router | shared gate | shared up | shared-expert gate has 2 * 256 + ... + 1 rows; 5x slower at prefill
ROW_ALIGN = 16


def _stack_rows(params: list[nn.Parameter], align: int = 1) -> torch.Tensor:
    """One [rows, cols] tensor holding the `params` (each read as rows of its last dim, cols wide) one after
    another, each parameter re-pointed at its rows with its own shape (no extra memory), then rows nobody reads
    up to a multiple of `align`. Parameters stacked already (fused before, or by an enclosing module) are left
    where they are: the result is then a view over them, which makes fusing idempotent (its padding rows, if
    any, are whatever the storage holds after them)."""
    first = params[0].data
    cols = first.shape[-1]
    rows = sum(p.numel() // cols for p in params)
    padded = -(-rows // align) * align
    room = first.untyped_storage().nbytes() // first.element_size() - first.storage_offset()
    if _stacked(params) and padded * cols <= room:
        return first.as_strided((padded, cols), (cols, 1))
    fused = torch.cat([p.data.reshape(-1, cols) for p in params] + [first.new_zeros(padded - rows, cols)])
    start = 0
    for p in params:
        n = p.numel() // cols
        p.data = fused[start : start + n].view(p.shape)
        start += n
    return fused


class Fp8Linear(nn.Module):
    """`y = x W^T` with W in e4m3 and one fp32 scale per (b0 x b1) block (`weight_scale_inv`, the checkpoint's
    name), x quantised per token and group of b1 channels on the fly (W8A8, `tandem/ops/fp8.py`)."""

    def __init__(self, n_in: int, n_out: int, block: tuple[int, int]):
        super().__init__()
        self.in_features, self.out_features, self.block = n_in, n_out, tuple(block)
        self.weight = nn.Parameter(torch.empty(n_out, n_in, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(scale_shape((n_out, n_in), block), dtype=torch.float32),
                                             requires_grad=False)

    def forward(self, x):
        return w8a8_linear(x, self.weight, self.weight_scale_inv, self.block)


@dataclass
class _FusedGroup:
    """Projections stacked into one weight (and, in FP8, one stacked scale): `rows` per projection, `index` their
    positions in `_fused_names`; the weight may end in padding rows (`ROW_ALIGN`), whose outputs are dropped."""

    weight: torch.Tensor
    scale_inv: torch.Tensor | None
    block: tuple[int, int] | None
    rows: list[int]
    index: list[int]

    def __post_init__(self):
        pad = self.weight.shape[0] - sum(self.rows)
        self._sizes = self.rows + [pad] if pad else self.rows  # the output's parts, padding last

    def __call__(self, x):
        if self.scale_inv is None:
            y = linear(x, self.weight)
        else:
            y = w8a8_linear(x, self.weight, self.scale_inv, self.block)
        return y.split(self._sizes, dim=-1)[: len(self.rows)]  # views: no copies


class _FusedProjections(nn.Module):
    """A module whose projections `_fused_names` (weight names, in their order in the fused weight) read the same
    input. `fuse()` stacks them into `_groups`; `project(x)` returns each projection of x, by one GEMM per group.
    Projections of one storage kind form a group: all of them in a bf16 / fp32 model; in an FP8 one the e4m3
    projections (whose scales stack too, when every projection's rows fill whole scale blocks) apart from the
    high-precision ones (router, gates, GDN a/b). Inference only: the fused weights carry no autograd."""

    _fused_names: tuple[str, ...] = ()
    _groups: list[_FusedGroup] | None = None

    def _projection(self, name: str) -> nn.Module:
        return self.get_submodule(name.removesuffix(".weight"))

    @torch.no_grad()
    def fuse(self):
        mods = [self._projection(n) for n in self._fused_names]
        kinds: dict[tuple, list[int]] = {}
        for i, m in enumerate(mods):
            block = getattr(m, "block", None)
            if block is not None and m.out_features % block[0]:
                kinds[("fp8 alone", i)] = [i]  # its scale rows would straddle its neighbours': not stacked
            else:
                kinds.setdefault((m.weight.dtype, block), []).append(i)
        self._groups = []
        for index in kinds.values():
            group = [mods[i] for i in index]
            block = getattr(group[0], "block", None)
            scale = _stack_rows([m.weight_scale_inv for m in group]) if block is not None else None
            # our W8A8 kernel has no alignment needs, and padding rows would need scale rows of their own
            align = ROW_ALIGN if block is None else 1
            self._groups.append(_FusedGroup(_stack_rows([m.weight for m in group], align), scale, block,
                                            [m.weight.shape[0] for m in group], index))

    def fp8_input_group(self) -> int | None:
        """The activation group of the FP8 GEMMs among the projections of the input (None: no FP8 GEMM)."""
        return next(filter(None, map(_fp8_group, map(self._projection, self._fused_names))), None)

    def project(self, x):
        if self._groups is None:
            return [_apply_linear(self._projection(n), x) for n in self._fused_names]
        if len(self._groups) == 1:
            return self._groups[0](x)
        out = [None] * len(self._fused_names)
        for group in self._groups:
            for i, y in zip(group.index, group(x)):
                out[i] = y
        return out

    def _apply(self, fn, recurse=True):
        # .to(), .half(), to_empty(), ... give each parameter a tensor of its own: stack them again so that the
        # fused weights follow the parameters
        fused, self._groups = self._groups is not None, None
        super()._apply(fn, recurse)
        if fused:
            self.fuse()
        return self


def _fp8_group(m: nn.Module) -> int | None:
    """The activation group of an FP8 projection (None: not FP8)."""
    return m.block[1] if isinstance(m, Fp8Linear) else None


def _apply_linear(m: nn.Module, x):
    """A projection module (nn.Linear, Fp8Linear, or a bare holder of `.weight` such as the router) applied to x."""
    return m(x) if isinstance(m, Fp8Linear) else F.linear(x, m.weight)


class GatedDeltaNet(_FusedProjections):
    _fused_names = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        # This rank's key heads and their value heads: value head h reads key head h // (nv / nk), so a
        # contiguous share of each keeps every value head with its key head.
        self.nk = tp.part(cfg.gdn_num_k_heads, "linear_num_key_heads")
        self.nv = tp.part(cfg.gdn_num_v_heads, "linear_num_value_heads")
        self.dk, self.dv = cfg.gdn_k_dim, cfg.gdn_v_dim
        conv_dim = 2 * self.nk * self.dk + self.nv * self.dv
        self.in_proj_qkv = _linear(cfg.hidden_size, conv_dim)
        self.in_proj_z = _linear(cfg.hidden_size, self.nv * self.dv)
        self.in_proj_b = _linear(cfg.hidden_size, self.nv)
        self.in_proj_a = _linear(cfg.hidden_size, self.nv)
        # HF stores the depthwise conv as Conv1d weight [C, 1, K]; we keep that shape for loading.
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(conv_dim, 1, cfg.conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)  # per head: stays local
        self.out_proj = _linear(self.nv * self.dv, cfg.hidden_size)
        qkv = Split(0, (cfg.gdn_num_k_heads * self.dk, cfg.gdn_num_k_heads * self.dk, cfg.gdn_num_v_heads * self.dv))
        self.tp_splits = {"in_proj_qkv.weight": qkv, "conv1d.weight": qkv, "in_proj_z.weight": Split(0),
                          "in_proj_b.weight": Split(0), "in_proj_a.weight": Split(0), "dt_bias": Split(0),
                          "A_log": Split(0), "out_proj.weight": Split(1)}

    def steps(self, x, batch: ForwardBatch, conv_state, recurrent_state, pending):
        T = x.shape[0]
        mixed_qkv, z, b, a = self.project(x)
        o = yield Core(self.recurrence, (mixed_qkv, a, b), (conv_state, recurrent_state, pending))
        return self.out_proj(self.norm(o.reshape(T, -1), z))  # heads side by side, z read in place

    def recurrence(self, mixed_qkv, a, b, batch: ForwardBatch, conv_state, recurrent_state, pending, out=None):
        """The conv and the delta rule, request by request from their state slots -> o [T, nv, dv]; the
        log-decay g and write strength beta come from a and b inside the delta rule's kernel. `pending`: the
        kept rows, the conv's input in the first conv_dim columns, the delta rule's inputs in the rest."""
        T, conv_dim = mixed_qkv.shape
        q, k, v = causal_conv1d(mixed_qkv, conv_state, pending[..., :conv_dim], self.conv1d.weight[:, 0, :], batch,
                                splits=[self.nk * self.dk, self.nk * self.dk, self.nv * self.dv])
        return gated_delta_rule(q.view(T, self.nk, self.dk), k.view(T, self.nk, self.dk),
                                v.view(T, self.nv, self.dv), Gates(a, b, self.A_log, self.dt_bias), recurrent_state,
                                pending[..., conv_dim:], batch, out=out)


class GatedAttention(_FusedProjections):
    _fused_names = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
    o_fp8_group: int | None = None  # the output gate's kernel quantises for an FP8 o_proj (as the norms do)

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        # This rank's query heads and KV heads: a contiguous share of each keeps every GQA group whole.
        self.nh = tp.part(cfg.num_heads, "num_attention_heads")
        self.nkv = tp.part(cfg.num_kv_heads, "num_key_value_heads")
        self.hd = cfg.head_dim
        # q_proj is interleaved per head: [query (hd) | gate (hd)] for each head, so a share of rows is a share of heads
        self.q_proj = _linear(cfg.hidden_size, self.nh * self.hd * 2)
        self.k_proj = _linear(cfg.hidden_size, self.nkv * self.hd)
        self.v_proj = _linear(cfg.hidden_size, self.nkv * self.hd)
        self.o_proj = _linear(self.nh * self.hd, cfg.hidden_size)
        self.q_norm = RMSNorm1p(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm1p(self.hd, cfg.rms_norm_eps)
        self.tp_splits = {"q_proj.weight": Split(0), "k_proj.weight": Split(0), "v_proj.weight": Split(0),
                          "o_proj.weight": Split(1)}

    def steps(self, x, batch: ForwardBatch, inv_freq, k_cache, v_cache):
        T = x.shape[0]
        q_gate, k, v = self.project(x)
        q, gate = q_gate.view(T, self.nh, 2 * self.hd).chunk(2, dim=-1)
        cos, sin = rope_tables(batch, inv_freq, x.dtype)
        q = qk_norm_rope_write_kv(q, k.view(T, self.nkv, self.hd), v.view(T, self.nkv, self.hd), self.q_norm.weight,
                                  self.k_norm.weight, self.q_norm.eps, cos, sin, k_cache, v_cache, batch.slot_mapping)
        o = yield Core(self.attend, (q,), (k_cache, v_cache))
        return self.o_proj(sigmoid_gate(o.reshape(T, -1), gate, self.o_fp8_group))

    def attend(self, q, batch: ForwardBatch, k_cache, v_cache, out=None):
        return paged_attention(q, k_cache, v_cache, batch, self.hd**-0.5, out=out)


class MLP(_FusedProjections):
    """SwiGLU over this rank's share of the intermediate channels (the whole of them on one rank)."""

    _fused_names = ("gate_proj.weight", "up_proj.weight")
    act_fp8_group: int | None = None  # the SwiGLU kernel quantises for an FP8 down_proj (as the norms do)

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj = _linear(hidden, inter), _linear(hidden, inter)
        self.down_proj = _linear(inter, hidden)
        self.tp_splits = {"gate_proj.weight": Split(0), "up_proj.weight": Split(0), "down_proj.weight": Split(1)}

    def forward(self, x):
        return self.swiglu_down(*self.project(x))

    def swiglu_down(self, gate, up):
        """The rest of the MLP, from the gate and up projections of its input."""
        return self.down_proj(silu_mul(gate, up, self.act_fp8_group))


class Experts(nn.Module):
    """This rank's experts: global ids `first .. first + E_local - 1` (expert parallelism)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        E, H, inter = tp.part(cfg.num_experts, "num_experts"), cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.first = cfg.num_experts, tp.rank * E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inter, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, inter))
        # FP8 (`tandem.model.fp8.to_fp8_layout`): e4m3 weights, these scales and their block; the gate and up
        # rows have scale rows of their own ([E, 2 * ceil(I / b0), ceil(H / b1)]), so I need not fill whole blocks
        self.register_parameter("gate_up_proj_scale_inv", None)
        self.register_parameter("down_proj_scale_inv", None)
        self.block: tuple[int, int] | None = None
        self.tp_splits = {"gate_up_proj": Split(0), "down_proj": Split(0)}
        self._with_shared: tuple | None = None  # `host`: (gate_up, down, their scales) of E + 1 experts

    def host(self, shared: MLP) -> bool:
        """Stores `shared` as expert E, right after the E experts (the parameters of both become views of
        [E + 1, ...] tensors: no extra memory), when it has an expert's shape and storage and every expert is on
        this rank; returns whether it did. A batch can then route each token to the shared expert too, with
        weight sigmoid(shared logit), and run it in the experts' kernels, with no GEMM or SwiGLU launch of its own
        (a SwiGLU MLP of the experts' intermediate size is one more expert)."""
        E, I = self.gate_up_proj.shape[0], self.down_proj.shape[2]
        projections = (shared.gate_proj, shared.up_proj, shared.down_proj)
        fp8 = self.block is not None
        if (E != self.num_experts or shared.gate_proj.weight.shape != (I, self.gate_up_proj.shape[2])
                or any(m.weight.dtype != self.gate_up_proj.dtype for m in projections)
                or any(isinstance(m, Fp8Linear) != fp8 or (fp8 and m.block != self.block) for m in projections)):
            self._with_shared = None
            return False
        gate, up, down = projections

        def stacked(own, *parts):  # [E + 1, ...]: expert E made of `parts`
            return _stack_rows([own, *parts]).view(E + 1, *own.shape[1:])

        self._with_shared = (stacked(self.gate_up_proj, gate.weight, up.weight), stacked(self.down_proj, down.weight),
                             stacked(self.gate_up_proj_scale_inv, gate.weight_scale_inv, up.weight_scale_inv)
                             if fp8 else None,
                             stacked(self.down_proj_scale_inv, down.weight_scale_inv) if fp8 else None)
        return True

    @property
    def all_local(self) -> bool:
        """Every expert is on this rank: the routing's expert ids (and its ranks, `route_logits`) apply as they are."""
        return self.gate_up_proj.shape[0] == self.num_experts

    def forward(self, x, weights, experts, shared=None, shared_logit=None, ranks=None):
        """Sum of `weight * expert(x)` over the (token, expert) pairs routed to this rank's experts, plus the
        gated shared expert `sigmoid(shared_logit) * shared` (added in the same pass on one rank). Without
        `shared`, the shared expert is expert E among `experts` (`host`), and the kernel path leaves the sum to
        the next residual add: it returns the per-pair outputs [T, top_k + 1, H] (see `add_rms_norm_1p`).
        `ranks`: of a ranked routing (`route_logits`), when `all_local`."""
        fp8 = dict(gate_up_scale=self.gate_up_proj_scale_inv, down_scale=self.down_proj_scale_inv, block=self.block)
        if shared is None:
            gate_up, down, fp8["gate_up_scale"], fp8["down_scale"] = self._with_shared
            return fused_experts(x, gate_up, down, weights, experts, **fp8, summed=False, ranks=ranks)
        if self.all_local:
            return fused_experts(x, self.gate_up_proj, self.down_proj, weights, experts, **fp8, shared=shared,
                                 shared_logit=shared_logit, ranks=ranks)
        assert ranks is None, "ranks index this rank's experts only when it holds them all"
        local = self.gate_up_proj.shape[0]
        tok, k = ((experts >= self.first) & (experts < self.first + local)).nonzero(as_tuple=True)
        out = torch.zeros_like(x)
        if tok.numel():  # each pair as a row of its own with top-1 routing, experts renumbered from 0
            y = fused_experts(x[tok], self.gate_up_proj, self.down_proj, weights[tok, k, None],
                              experts[tok, k, None] - self.first, **fp8)
            out.index_add_(0, tok, y)
        return out + torch.sigmoid(shared_logit) * shared


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))


# Up to this many rows a MoE block whose experts host its shared expert (`Experts.host`) routes every token to it
# (decode and verify steps: the launches saved matter); more rows (prefill) run it as its own GEMMs, as cuBLAS
# is faster than the grouped kernels at those sizes
SHARED_AS_EXPERT_MAX_ROWS = 256


class SparseMoE(_FusedProjections):
    """Routed experts plus a sigmoid-gated shared expert. Every rank routes every token over all experts with the
    full router; the sum over experts is split between the ranks' experts (and shared-expert channels)."""

    # gate and up stay adjacent, in MLP order, so the shared expert's own fused weight is a view into this one
    _fused_names = ("gate.weight", "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
                    "shared_expert_gate.weight")
    _hosting_names = ("gate.weight", "shared_expert_gate.weight")  # when the experts host the shared expert

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Router(cfg)
        self.experts = Experts(cfg, tp)
        self.shared_expert = MLP(cfg.hidden_size, tp.part(cfg.shared_expert_intermediate_size,
                                                          "shared_expert_intermediate_size"))
        self.shared_expert_gate = _linear(cfg.hidden_size, 1)
        self.hosted = False

    def fp8_input_group(self) -> int | None:
        """The experts' activation group when they are FP8, else the shared expert's projections'."""
        if self.experts.block is not None:
            return self.experts.block[1]
        return self.shared_expert.fp8_input_group()

    def fuse(self):
        self.hosted = self.experts.host(self.shared_expert)
        self._fused_names = self._hosting_names if self.hosted else type(self)._fused_names
        super().fuse()
        self.shared_expert.fuse()  # its gate | up: a view of the rows just stacked (here or in the experts)

    def forward(self, x):
        """-> [T, H], or on the kernel path with the shared expert routed the per-pair outputs [T, top_k + 1, H]
        that the next residual add sums (`add_rms_norm_1p`)."""
        if self.hosted:
            router_logits, shared_logit = self.project(x)
            if x.shape[0] <= SHARED_AS_EXPERT_MAX_ROWS:
                weights, experts, ranks = route_logits(router_logits, self.top_k, self.renormalize, shared_logit,
                                                       ranked=True)
                return self.experts(x, weights, experts, ranks=ranks)
            shared_gate, shared_up = self.shared_expert.project(x)
        else:
            router_logits, shared_gate, shared_up, shared_logit = self.project(x)
        weights, experts, ranks = route_logits(router_logits, self.top_k, self.renormalize,
                                               ranked=self.experts.all_local)
        shared = self.shared_expert.swiglu_down(shared_gate, shared_up)
        # the gate is replicated, so gate * (partial shared sum) is this rank's part of the gated shared expert
        return self.experts(x, weights, experts, shared, shared_logit, ranks=ranks)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, is_attention: bool, is_moe: bool, tp: TPGroup = SINGLE):
        super().__init__()
        self.is_attention, self.tp = is_attention, tp
        if is_attention:
            self.self_attn = GatedAttention(cfg, tp)
        else:
            self.linear_attn = GatedDeltaNet(cfg, tp)
        if is_moe:
            self.mlp = SparseMoE(cfg, tp)
        else:
            self.mlp = MLP(cfg.hidden_size, tp.part(cfg.intermediate_size, "intermediate_size"))
        self.input_layernorm = RMSNorm1p(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm1p(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, delta, batch: ForwardBatch, inv_freq, cache):
        return run_cores(self.steps(h, delta, batch, inv_freq, cache), batch)

    def quantize_in_producers(self, on: bool = True):
        """The kernel before each FP8 GEMM writes the e4m3 groups of its input (one quantiser launch fewer each):
        the input norm for the attention / GDN projections, the post-attention norm for the MLP or MoE block,
        the GDN output norm and the attention output gate for the out projections, the SwiGLU of a dense MLP
        or of a shared expert run as an MLP for its down projection. `on=False`: none does (each GEMM's input is
        quantised by a launch of its own; benchmarks compare the two)."""
        mixer = self.self_attn if self.is_attention else self.linear_attn
        self.input_layernorm.fp8_group = mixer.fp8_input_group() if on else None
        self.post_attention_layernorm.fp8_group = self.mlp.fp8_input_group() if on else None
        group = _fp8_group(mixer.o_proj if self.is_attention else mixer.out_proj) if on else None
        if self.is_attention:
            mixer.o_fp8_group = group
        else:
            mixer.norm.fp8_group = group
        for mlp in self.mlp.modules():
            if isinstance(mlp, MLP):
                mlp.act_fp8_group = _fp8_group(mlp.down_proj) if on else None

    def steps(self, h, delta, batch: ForwardBatch, inv_freq, cache):
        """The residual stream is `h + delta` (delta: the previous block's output, not yet added, possibly as
        parts [T, P, H] to sum; None before the first block); returns the same pair after this layer, so each add
        runs in the pass of the next norm."""
        h, x = (h, self.input_layernorm(h)) if delta is None else self.input_layernorm.residual(h, delta)
        if self.is_attention:
            mixed = yield from self.self_attn.steps(x, batch, inv_freq, *cache)
        else:
            mixed = yield from self.linear_attn.steps(x, batch, *cache)
        h, x = self.post_attention_layernorm.residual(h, self.tp.all_reduce(mixed))  # partial sums, all-reduced
        return h, self.tp.all_reduce(self.mlp(x))


class Trunk(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, t == "full_attention", moe, tp) for t, moe in zip(cfg.layer_types, cfg.moe_layers))
        self.norm = RMSNorm1p(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3_5ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, with_mtp: bool = False, tp: TPGroup = SINGLE):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.model = Trunk(cfg, tp)
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)
        if with_mtp:
            from tandem.model.mtp import MTPHead  # mtp.py builds on this module's layers

            self.mtp = MTPHead(cfg, tp)
        self.register_buffer("inv_freq", inv_frequencies(cfg.rotary_dim, cfg.rope_theta), persistent=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def forward(self, batch: ForwardBatch, caches) -> torch.Tensor:
        """Returns the final post-norm hidden state of every token, [T, H]. `caches[i]` is layer i's
        (k_cache, v_cache) or (conv_state, recurrent_state, pending)."""
        return run_cores(self.steps(batch, caches), batch)

    def steps(self, batch: ForwardBatch, caches):
        """The forward as a generator of its cores (`Core`); returns what `forward` returns."""
        h, delta = self.model.embed_tokens(batch.input_ids), None
        for layer, cache in zip(self.model.layers, caches):
            h, delta = yield from layer.steps(h, delta, batch, self.inv_freq, cache)
        return self.model.norm.residual(h, delta)[1]

    @torch.no_grad()
    def fuse_projections(self) -> Qwen3_5ForCausalLM:
        """Stacks the weights of the projections that read the same input, module by module (target and MTP
        layers), so each group runs as one GEMM; the parameters become views of the stacked weights. Run it once
        the weights are in place (the loader and `random_model` do); running it again changes nothing."""
        for module in self.modules():
            if isinstance(module, _FusedProjections):
                module.fuse()
        for module in self.modules():
            if isinstance(module, DecoderLayer):
                module.quantize_in_producers()
        return self

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight).float()

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of `compute_logits(hidden)`, taken on the lm_head's own output: the fp32 copy holds the same
        values, so the same token, at the cost of a cast launch and twice the bytes read (a step drafts k times)."""
        return F.linear(hidden, self.lm_head_weight).argmax(-1)

    def parameter_splits(self) -> dict[str, Split]:
        """Parameter name -> how its full tensor is cut across ranks; parameters not named are replicated."""
        return {f"{prefix}.{name}": split for prefix, module in self.named_modules()
                for name, split in getattr(module, "tp_splits", {}).items()}
