"""Built-in model shapes with random weights: tiny ones for tests, the real Qwen3.5 shapes for benchmarks.

Each preset is an HF-style config dict, so it goes through the same `ModelConfig.from_hf` as a checkpoint.
Random weights are drawn directly on the target device (a large preset is ready on a GPU in seconds).
"""

from __future__ import annotations

import torch

from tandem.config import ModelConfig
from tandem.model.loader import build_empty_model
from tandem.model.qwen3_5 import Qwen3_5ForCausalLM
from tandem.parallel import SINGLE, TPGroup

_COMMON = dict(
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, full_attention_interval=4, max_position_embeddings=262144, mtp_num_hidden_layers=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25},
    vocab_size=248320, hidden_act="silu", eos_token_id=248044,
)
_TINY = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25},
    hidden_act="silu", mtp_num_hidden_layers=1, eos_token_id=1, tie_word_embeddings=False,
)
_TINY_MOE = dict(_TINY, model_type="qwen3_5_moe_text", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48)
_35B_A3B = dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                num_key_value_heads=2, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                moe_intermediate_size=512, shared_expert_intermediate_size=512, tie_word_embeddings=False)
# what the official FP8 checkpoints list: everything the naming rule keeps in high precision is implied
_FP8 = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128],
            modules_to_not_convert=[])

PRESETS: dict[str, dict] = {
    "tiny-dense": dict(_TINY, model_type="qwen3_5_text", intermediate_size=128),
    "tiny-moe": _TINY_MOE,
    "qwen3.5-0.8b": dict(_COMMON, model_type="qwen3_5_text", hidden_size=1024, num_hidden_layers=24,
                         num_attention_heads=8, num_key_value_heads=2, linear_num_value_heads=16,
                         intermediate_size=3584, tie_word_embeddings=True),
    "qwen3.5-9b": dict(_COMMON, model_type="qwen3_5_text", hidden_size=4096, num_hidden_layers=32,
                       num_attention_heads=16, num_key_value_heads=4, linear_num_value_heads=32,
                       intermediate_size=12288, tie_word_embeddings=False),
    "qwen3.5-27b": dict(_COMMON, model_type="qwen3_5_text", hidden_size=5120, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48,
                        intermediate_size=17408, tie_word_embeddings=False),
    "qwen3.5-35b-a3b": dict(_COMMON, **_35B_A3B),
    # the layout of the published Qwen3.5-35B-A3B-FP8 checkpoint (e4m3, 128 x 128 blocks); the tiny one's
    # 16 x 16 blocks fill its small projections, so the kernels' block logic runs at test sizes
    "qwen3.5-35b-a3b-fp8": dict(_COMMON, **_35B_A3B, quantization_config=_FP8),
    "tiny-moe-fp8": dict(_TINY_MOE, quantization_config=dict(_FP8, weight_block_size=[16, 16])),
    "qwen3.5-397b-a17b": dict(_COMMON, model_type="qwen3_5_moe_text", hidden_size=4096, num_hidden_layers=60,
                              num_attention_heads=32, num_key_value_heads=2, linear_num_value_heads=64,
                              num_experts=512, num_experts_per_tok=10, moe_intermediate_size=1024,
                              shared_expert_intermediate_size=1024, tie_word_embeddings=False),
}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        if "/" in name or name.startswith("."):  # meant as a path (or a hub id, which is not fetched)
            raise ValueError(f"model directory {name!r} not found: give a local checkpoint directory (config.json "
                             f"and *.safetensors; models are not downloaded) or a preset: {', '.join(PRESETS)}")
        raise ValueError(f"unknown preset {name!r}: give a checkpoint directory or a preset: {', '.join(PRESETS)}")
    return ModelConfig.from_hf(PRESETS[name])


@torch.no_grad()
def random_model(cfg: ModelConfig, device: str, dtype: torch.dtype, seed: int = 0, tp: TPGroup = SINGLE,
                 fp8_compute: bool | None = None):
    """Random weights with stable activations: N(0, 0.02) matrices, small norm offsets, sane GDN decay.
    Every rank draws the full tensors in the same order, one at a time, and keeps its part: a tensor-parallel
    model holds exactly the single-process model's weights. Projections are fused as after loading a checkpoint.
    An FP8 preset (`cfg.quantization`) quantises the drawn weights: kept in e4m3 when `fp8_compute` (None:
    `fp8.uses_fp8_compute`), else dequantised again, as loading such a checkpoint would give."""
    model = build_empty_model(cfg, device, dtype, with_mtp=cfg.num_mtp_layers > 0, tp=tp)
    splits, full_shapes = {}, {}
    if tp.world_size > 1:
        splits = model.parameter_splits()
        with torch.device("meta"):
            full_shapes = {n: p.shape for n, p in Qwen3_5ForCausalLM(cfg, cfg.num_mtp_layers > 0).named_parameters()}
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        full = torch.empty(full_shapes[name], dtype=p.dtype, device=p.device) if name in splits else p.data
        if name.endswith("A_log"):
            full.uniform_(0.0, 2.0, generator=gen)
        elif name.endswith("dt_bias"):
            full.fill_(1.0)
        elif name.endswith("linear_attn.norm.weight"):
            full.fill_(1.0)
        elif full.ndim == 1:  # zero-centred norms: weight 0 means scale 1
            full.normal_(0.0, 0.1, generator=gen)
        else:
            full.normal_(0.0, 0.02, generator=gen)
        if name in splits:
            p.copy_(tp.shard(full, splits[name]))
    if cfg.quantization is not None:
        from tandem.model.fp8 import round_trip_fp8, to_fp8_layout, uses_fp8_compute

        if uses_fp8_compute(device, tp, fp8_compute):
            to_fp8_layout(model, cfg.quantization, quantize=True)
        else:
            round_trip_fp8(model, cfg.quantization)
    return model.fuse_projections()
