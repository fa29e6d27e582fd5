"""tandem-tiny's configuration (official `qwen3_5_moe` config.json layout) and export in the official on-disk
layout: `model.language_model.*` trunk, fused 3-D experts, `mtp.*`, untied `lm_head.weight`."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from training.data import SPECIAL_TOKENS

# The 3:1 GDN:attention ratio of Qwen3.5 (full_attention_interval 4): 8 layers = 6 Gated DeltaNet + 2 attention.
TINY_TEXT = dict(
    model_type="qwen3_5_moe_text",
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=8,
    full_attention_interval=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=96,
    shared_expert_intermediate_size=256,
    router_aux_loss_coef=0.001,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
                     "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    attention_bias=False,
    attention_dropout=0.0,
    mtp_num_hidden_layers=1,
    mtp_use_dedicated_embeddings=False,
    mamba_ssm_dtype="float32",
    tie_word_embeddings=False,
    initializer_range=0.02,
    bos_token_id=None,
    eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
    pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
    dtype="bfloat16",
    use_cache=True,
)


def text_config(**overrides) -> dict:
    d = dict(TINY_TEXT, **overrides)
    n, every = d["num_hidden_layers"], d["full_attention_interval"]
    d["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    return d


def full_config(text: dict) -> dict:
    """The official composite layout: a `qwen3_5_moe` config with the text model under `text_config`. This
    model has no vision tower (no `vision_config` weights are shipped)."""
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
        "dtype": text["dtype"],
    }


def official_state_dict(model, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in model.state_dict().items():
        if name.startswith("model."):
            name = "model.language_model." + name[len("model."):]
        out[name] = t.detach().to("cpu", dtype).contiguous()
    return out


def save_checkpoint(model, text: dict, out_dir: str, dtype=torch.bfloat16) -> int:
    """Writes config.json, generation_config.json and model.safetensors; returns the safetensors size in bytes."""
    os.makedirs(out_dir, exist_ok=True)
    text = dict(text, dtype=str(dtype).removeprefix("torch."))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(full_config(text), f, indent=2)
        f.write("\n")
    gen = {"eos_token_id": [text["eos_token_id"], SPECIAL_TOKENS.index("<|endoftext|>")],
           "pad_token_id": text["pad_token_id"], "do_sample": False, "max_new_tokens": 256}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")
    path = os.path.join(out_dir, "model.safetensors")
    save_file(official_state_dict(model, dtype), path, metadata={"format": "pt"})
    return os.path.getsize(path)
