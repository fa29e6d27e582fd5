"""Model and engine configuration.

`ModelConfig.from_hf` reads a Hugging Face `config.json` (dict) of the Qwen3.5 family and validates it; every
failure names the offending field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
LAYER_TYPES = ("linear_attention", "full_attention")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(ValueError):
    pass


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ConfigError(f"dtype: {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    # gated full attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rotary_dim: int
    # Gated DeltaNet
    gdn_num_k_heads: int
    gdn_num_v_heads: int
    gdn_k_dim: int
    gdn_v_dim: int
    conv_kernel: int
    # feed-forward: `moe_layers[i]` says whether layer i is MoE (Qwen3-Next may mix dense and MoE layers)
    intermediate_size: int
    moe_layers: tuple[bool, ...]
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    ssm_dtype: torch.dtype | None  # None: the model dtype
    num_mtp_layers: int
    eos_token_ids: tuple[int, ...] = ()
    # the checkpoint's (or preset's) `quantization_config`: a `tandem.model.fp8.Fp8Quantization`, or None
    quantization: object = None

    @property
    def conv_dim(self) -> int:
        return 2 * self.gdn_num_k_heads * self.gdn_k_dim + self.gdn_num_v_heads * self.gdn_v_dim

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @classmethod
    def from_file(cls, path: str) -> "ModelConfig":
        with open(path) as f:
            return cls.from_hf(json.load(f))

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        cfg = os.path.join(path, "config.json")
        if not os.path.exists(cfg):
            raise ConfigError(f"{path}: no config.json")
        return cls.from_file(cfg)

    @classmethod
    def from_hf(cls, raw: dict) -> "ModelConfig":
        top = raw
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type: {model_type!r} is not supported (expected one of {SUPPORTED_MODEL_TYPES})")
        text = raw.get("text_config", raw) if model_type in ("qwen3_5", "qwen3_5_moe") else raw

        def req(name):
            if name not in text or text[name] is None:
                raise ConfigError(f"{name}: missing from config")
            return text[name]

        def positive(name):
            v = req(name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {v!r}")
            return v

        n_layers = positive("num_hidden_layers")
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = text.get("full_attention_interval")
            if not isinstance(interval, int) or interval <= 0:
                raise ConfigError("layer_types: missing, and full_attention_interval is not a positive integer")
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        layer_types = tuple(layer_types)
        if len(layer_types) != n_layers:
            raise ConfigError(f"layer_types: has {len(layer_types)} entries but num_hidden_layers is {n_layers}")
        bad = sorted(set(layer_types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(f"layer_types: unknown layer type(s) {bad}")

        rope = text.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ConfigError(f"rope_parameters.rope_type: {rope_type!r} is not supported (only 'default')")

        n_heads, n_kv = positive("num_attention_heads"), positive("num_key_value_heads")
        if n_heads % n_kv:
            raise ConfigError(f"num_key_value_heads: {n_kv} does not divide num_attention_heads {n_heads}")
        head_dim = text.get("head_dim") or req("hidden_size") // n_heads
        rotary_dim = int(head_dim * partial)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ConfigError(f"partial_rotary_factor: {partial} gives an invalid rotary dim {rotary_dim}")
        nk, nv = positive("linear_num_key_heads"), positive("linear_num_value_heads")
        if nv % nk:
            raise ConfigError(f"linear_num_value_heads: {nv} is not a multiple of linear_num_key_heads {nk}")
        if text.get("attention_bias"):
            raise ConfigError("attention_bias: biased attention projections are not supported")
        if text.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act: {text.get('hidden_act')!r} is not supported (only 'silu')")

        is_moe = model_type.startswith("qwen3_5_moe") or model_type == "qwen3_next"
        num_experts = text.get("num_experts", 0) if is_moe else 0
        if is_moe and not num_experts:
            raise ConfigError("num_experts: a MoE model type needs num_experts > 0")
        if model_type == "qwen3_next":
            sparse_step = text.get("decoder_sparse_step", 1)
            only_mlp = set(text.get("mlp_only_layers", []) or [])
            moe_layers = tuple(i not in only_mlp and (i + 1) % sparse_step == 0 for i in range(n_layers))
        else:
            moe_layers = (is_moe,) * n_layers
        if is_moe:
            top_k = positive("num_experts_per_tok")
            if top_k > num_experts:
                raise ConfigError(f"num_experts_per_tok: {top_k} exceeds num_experts {num_experts}")
            moe_inter = positive("moe_intermediate_size")
            shared_inter = positive("shared_expert_intermediate_size")
        else:
            top_k = moe_inter = shared_inter = 0
        intermediate = text.get("intermediate_size") or 0
        if not all(moe_layers) and intermediate <= 0:
            raise ConfigError("intermediate_size: dense layers need a positive intermediate_size")

        ssm = text.get("mamba_ssm_dtype", top.get("mamba_ssm_dtype"))
        # Qwen3.5 keeps the recurrent state in fp32 even when weights are bf16.
        if ssm is None and model_type != "qwen3_next":
            ssm = "float32"
        eos = text.get("eos_token_id", top.get("eos_token_id"))
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=positive("vocab_size"),
            hidden_size=positive("hidden_size"),
            num_layers=n_layers,
            layer_types=layer_types,
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rotary_dim=rotary_dim,
            gdn_num_k_heads=nk,
            gdn_num_v_heads=nv,
            gdn_k_dim=positive("linear_key_head_dim"),
            gdn_v_dim=positive("linear_value_head_dim"),
            conv_kernel=positive("linear_conv_kernel_dim"),
            intermediate_size=intermediate,
            moe_layers=moe_layers,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=moe_inter,
            shared_expert_intermediate_size=shared_inter,
            # Qwen3.5-MoE always renormalises the top-k weights; Qwen3-Next makes it a flag.
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(top.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            ssm_dtype=parse_dtype(ssm) if ssm else None,
            num_mtp_layers=int(text.get("mtp_num_hidden_layers", 0) or 0),
            eos_token_ids=eos,
            quantization=_quantization(top.get("quantization_config", text.get("quantization_config"))),
        )


def _quantization(raw):
    from tandem.model.fp8 import Fp8FormatError, Fp8Quantization  # the model package needs this module first

    try:
        return Fp8Quantization.from_hf(raw)
    except Fp8FormatError as e:
        raise ConfigError(str(e)) from None


@dataclass
class EngineConfig:
    """Engine knobs; names follow vLLM where vLLM has one."""

    block_size: int = 16
    max_num_seqs: int = 64
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048  # the chunked-prefill token budget of one step
    # The caches' sizes (`tandem/cache/sizing.py`). num_kv_blocks (the null block included) overrides the rest;
    # else kv_cache_memory_bytes (KV blocks + GDN state slots) is split between them; else on a GPU what is left of
    # gpu_memory_utilization x the device's memory after the weights and a profile step; else (a CPU) enough
    # blocks for max_num_seqs full-length sequences.
    num_kv_blocks: int | None = None
    num_state_slots: int | None = None  # None: max_num_seqs (one a request), or what the memory split gives
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_speculative_tokens: int = 0  # MTP drafts verified per decode step (0: no speculation)
    # Benchmark only: force the acceptance probability of each draft position (e.g. (0.84, 0.66)) so throughput
    # at a realistic acceptance can be measured on random weights. Outputs produced under it are labelled emulated.
    emulated_acceptance: tuple[float, ...] | None = None
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    # Decode steps through persistent buffers as CUDA graphs (tandem/engine/graphs.py), prefill steps as piecewise
    # ones (tandem/engine/prefill_graphs.py). None: on when the device is CUDA and the Triton kernels serve it;
    # True on a CPU runs the same padded paths without capture (tests).
    cuda_graphs: bool | None = None
    # Prefix caching (`tandem/cache/prefix.py`): KV blocks shared by content and GDN state snapshots, taken at the
    # end of each prompt, at the branch point from a cached chain and every prefix_state_interval tokens of a
    # prompt (a multiple of block_size). num_state_snapshots: None sizes the snapshot pool with the caches
    # (`tandem/cache/sizing.py`), or max_num_seqs entries when num_kv_blocks is given.
    enable_prefix_caching: bool = True
    prefix_state_interval: int = 2048
    num_state_snapshots: int | None = None

    def __post_init__(self):
        self.dtype = parse_dtype(self.dtype)
        if self.cuda_graphs is None:
            from tandem.ops.triton_utils import HAS_TRITON, TORCH_OPS_ONLY

            self.cuda_graphs = self.device.startswith("cuda") and HAS_TRITON and not TORCH_OPS_ONLY
        for name in ("block_size", "max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {v!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ConfigError(f"kv_cache_memory_bytes: must be positive, got {self.kv_cache_memory_bytes!r}")
        if self.num_kv_blocks is None and self.kv_cache_memory_bytes is None and not self.device.startswith("cuda"):
            self.num_kv_blocks = self.max_num_seqs * self.blocks_per_seq + 1  # + the null block
        if self.num_kv_blocks is not None:
            self.check_blocks(self.num_kv_blocks)
        if not isinstance(self.num_speculative_tokens, int) or not 0 <= self.num_speculative_tokens <= 4:
            raise ConfigError(f"num_speculative_tokens: must be 0..4, got {self.num_speculative_tokens!r}")
        if self.max_num_batched_tokens < 1 + self.num_speculative_tokens:
            raise ConfigError(f"max_num_batched_tokens: must hold one verify row set (1 + k = "
                              f"{1 + self.num_speculative_tokens}), got {self.max_num_batched_tokens}")
        if self.emulated_acceptance is not None:
            rates = tuple(self.emulated_acceptance)
            if len(rates) != self.num_speculative_tokens or not all(0.0 <= r <= 1.0 for r in rates):
                raise ConfigError(f"emulated_acceptance: needs {self.num_speculative_tokens} probabilities in [0, 1], "
                                  f"got {self.emulated_acceptance!r}")
            self.emulated_acceptance = rates
        if self.num_state_slots is None and self.num_kv_blocks is not None:
            self.num_state_slots = self.max_num_seqs
        if not isinstance(self.prefix_state_interval, int) or self.prefix_state_interval <= 0 \
                or self.prefix_state_interval % self.block_size:
            raise ConfigError(f"prefix_state_interval: must be a positive multiple of block_size ({self.block_size}), "
                              f"got {self.prefix_state_interval!r}")
        if not self.enable_prefix_caching:
            self.num_state_snapshots = 0
        elif self.num_state_snapshots is None and self.num_kv_blocks is not None:
            self.num_state_snapshots = self.max_num_seqs

    @property
    def blocks_per_seq(self) -> int:
        """KV blocks of one max_model_len request."""
        return -(-self.max_model_len // self.block_size)

    def check_blocks(self, num_kv_blocks: int) -> None:
        """A pool of `num_kv_blocks` (the null block included) must hold one max_model_len request: a request
        that fits max_model_len then always finishes, alone if it must."""
        if num_kv_blocks - 1 < self.blocks_per_seq:
            raise ConfigError(
                f"the KV cache holds {num_kv_blocks - 1} blocks of {self.block_size} tokens "
                f"({(num_kv_blocks - 1) * self.block_size} tokens); one max_model_len ({self.max_model_len}) request "
                f"needs {self.blocks_per_seq}: give the cache more memory, or lower max_model_len (the largest "
                f"max_model_len that fits is {(num_kv_blocks - 1) * self.block_size})")
