"""Tiny Hugging Face models (the oracle) with every weight perturbed, saved with `save_pretrained`."""

from __future__ import annotations

import torch
import transformers

from tandem.model.presets import PRESETS

KINDS = {
    "dense": ("tiny-dense", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
    "moe": ("tiny-moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {}),
    # Qwen3-Next: its own packed GDN projections, one dense layer among MoE layers, no top-k renormalisation; its
    # shared expert has the experts' size (as in the real checkpoints), so the experts host it (`Experts.host`)
    "next": ("tiny-moe", "Qwen3NextConfig", "Qwen3NextForCausalLM",
             {"model_type": "qwen3_next", "intermediate_size": 96, "mlp_only_layers": [1], "decoder_sparse_step": 1,
              "norm_topk_prob": False, "shared_expert_intermediate_size": 32}),
}


def hf_config_dict(kind: str) -> dict:
    preset, _, _, extra = KINDS[kind]
    d = dict(PRESETS[preset], **extra)
    return d


def make_hf_model(kind: str, seed: int = 0):
    _, cfg_cls, model_cls, _ = KINDS[kind]
    d = hf_config_dict(kind)
    d = {k: v for k, v in d.items() if k != "model_type"}
    cfg = getattr(transformers, cfg_cls)(**d)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            elif p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.normal_(0.0, 0.1)
    return model
