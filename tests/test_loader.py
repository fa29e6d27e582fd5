"""Checkpoint layouts: HF save_pretrained (per expert), official fused layout with the VL prefix and mtp.*,
sharded checkpoints, and clear errors for missing or mis-shaped tensors."""

import json
import os
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.config import ModelConfig
from tandem.model.mtp import MTPHead
from tandem.model.loader import CheckpointError, load_checkpoint


def read_all(path):
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def clone_dir(src, dst, tensors, shards=1):
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), dst)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(dst, "model.safetensors"))
        return dst
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, os.path.join(dst, fname))
        weight_map.update({n: fname for n in part})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return dst


def to_official_layout(tensors, cfg: ModelConfig):
    """Fused 3-D experts, `model.language_model.` prefix, plus vision and MTP tensors. Returns (all, mtp)."""
    out, per_expert = {}, {}
    for name, t in tensors.items():
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", name)
        if m:
            per_expert[(int(m.group(1)), int(m.group(2)), m.group(3))] = t
            continue
        out[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t
    for layer in sorted({k[0] for k in per_expert}):
        E = cfg.num_experts
        gate_up = [torch.cat([per_expert[(layer, e, "gate_proj")], per_expert[(layer, e, "up_proj")]])
                   for e in range(E)]
        out[f"model.language_model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        out[f"model.language_model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(
            [per_expert[(layer, e, "down_proj")] for e in range(E)])
    out["model.visual.patch_embed.proj.weight"] = torch.randn(4, 3)
    torch.manual_seed(5)
    mtp = {f"mtp.{k}": torch.randn_like(v) for k, v in MTPHead(cfg).state_dict().items()}
    return {**out, **mtp}, mtp


def params(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_official_fused_layout_equals_save_pretrained(hf_checkpoints, tmp_path):
    _, path = hf_checkpoints["moe"]
    cfg = ModelConfig.from_dir(path)
    hf_model = load_checkpoint(path, cfg, "cpu", torch.float32, progress=False)
    tensors, mtp_in = to_official_layout(read_all(path), cfg)
    official = clone_dir(path, tmp_path / "official", tensors)
    off_model = load_checkpoint(str(official), cfg, "cpu", torch.float32, progress=False)
    a, b = params(hf_model), params(off_model)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    mtp = {k: v for k, v in b.items() if k.startswith("mtp.")}
    assert mtp.keys() == mtp_in.keys()
    assert all(torch.equal(mtp[k], mtp_in[k]) for k in mtp)


def test_sharded_checkpoint_loads(hf_checkpoints, tmp_path):
    _, path = hf_checkpoints["next"]
    cfg = ModelConfig.from_dir(path)
    single = load_checkpoint(path, cfg, "cpu", torch.float32, progress=False)
    sharded_dir = clone_dir(path, tmp_path / "sharded", read_all(path), shards=3)
    sharded = load_checkpoint(str(sharded_dir), cfg, "cpu", torch.float32, progress=False)
    a, b = params(single), params(sharded)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_missing_and_misshaped_tensors_are_listed(hf_checkpoints, tmp_path):
    _, path = hf_checkpoints["dense"]
    tensors = read_all(path)
    del tensors["model.layers.0.linear_attn.A_log"]
    tensors["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    tensors["model.layers.0.bogus.weight"] = torch.zeros(2)
    bad = clone_dir(path, tmp_path / "bad", tensors)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(bad), ModelConfig.from_dir(str(bad)), "cpu", torch.float32, progress=False)
    msg = str(e.value)
    assert "missing tensor model.layers.0.linear_attn.A_log" in msg
    assert "mis-shaped tensor model.layers.3.self_attn.k_proj.weight" in msg
    assert "unexpected tensor model.layers.0.bogus.weight" in msg
