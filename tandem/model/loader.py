"""Build the model on the target device and load safetensors checkpoints into it.

Accepts single-file and sharded (`model.safetensors.index.json`) checkpoints; HF names with or without the
`model.language_model.` prefix (`model.visual.*` ignored); experts fused (3-D) or per expert; Qwen3-Next's
interleaved `in_proj_qkvz` / `in_proj_ba` (converted to the 3.5 split layout); `mtp.*` into the MTP head
(`model.mtp`, present when the checkpoint has those tensors). Each tensor goes straight to the device and dtype; nothing is staged in a second full CPU copy.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager

import torch
from safetensors import safe_open
from tqdm import tqdm

from tandem.config import ModelConfig
from tandem.model.qwen3_5 import Qwen3_5ForCausalLM
from tandem.ops.rope import inv_frequencies


class CheckpointError(ValueError):
    pass


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_empty_model(cfg: ModelConfig, device: str, dtype: torch.dtype, with_mtp: bool = False) -> Qwen3_5ForCausalLM:
    """Allocates (uninitialised) parameters directly on `device` in `dtype`; inv_freq stays fp32."""
    with _default_dtype(dtype), torch.device("meta"):
        model = Qwen3_5ForCausalLM(cfg, with_mtp)
    model.to_empty(device=device)
    model.inv_freq = inv_frequencies(cfg.rotary_dim, cfg.rope_theta, device=device)
    return model.eval().requires_grad_(False)


def _checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return [os.path.join(path, f) for f in sorted(set(json.load(f)["weight_map"].values()))]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no .safetensors files")
    return [os.path.join(path, f) for f in files]


_PER_EXPERT = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _canonical(name: str) -> str | None:
    """Checkpoint name -> our parameter name; None for tensors we do not use."""
    if name.startswith("model.visual.") or name.startswith("visual."):
        return None
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model."):]
    return name


class _Writer:
    """Copies checkpoint tensors into the model's parameters, converting layouts on the way."""

    def __init__(self, model: Qwen3_5ForCausalLM):
        self.model, self.cfg = model, model.cfg
        self.params = dict(model.named_parameters())
        self.loaded: set[str] = set()
        self.partial: dict[str, set] = {}  # fused params assembled from pieces
        self.problems: list[str] = []

    def _copy(self, name: str, t: torch.Tensor, index=None):
        p = self.params.get(name)
        if p is None:
            self.problems.append(f"unexpected tensor {name} {tuple(t.shape)}")
            return
        dst = p.data if index is None else p.data[index]
        if tuple(dst.shape) != tuple(t.shape):
            self.problems.append(f"mis-shaped tensor {name}: checkpoint {tuple(t.shape)}, model {tuple(dst.shape)}")
            return
        dst.copy_(t)
        if index is None:
            self.loaded.add(name)

    def add(self, name: str, read):
        name = _canonical(name)
        if name is None:
            return
        device, dtype = self.model.inv_freq.device, self.model.model.embed_tokens.weight.dtype
        m = _PER_EXPERT.match(name)
        if m:
            self._add_expert(m.group(1), int(m.group(2)), m.group(3), read().to(device, dtype))
            return
        if name.endswith(".linear_attn.in_proj_qkvz.weight") or name.endswith(".linear_attn.in_proj_ba.weight"):
            self._add_qwen3_next_projection(name, read().to(device, dtype))
            return
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return  # tied: the embedding is the head
        self._copy(name, read().to(device, dtype))

    def _add_expert(self, prefix: str, e: int, which: str, t: torch.Tensor):
        inter = self.cfg.moe_intermediate_size
        if which == "down_proj":
            target, index = f"{prefix}.down_proj", (e,)
        else:
            target = f"{prefix}.gate_up_proj"
            index = (e, slice(0, inter)) if which == "gate_proj" else (e, slice(inter, 2 * inter))
        if target not in self.params or e >= self.cfg.num_experts:
            self.problems.append(f"unexpected tensor {prefix}.{e}.{which}.weight")
            return
        self._copy(target, t, index)
        pieces = self.partial.setdefault(target, set())
        pieces.add((e, which))
        want = self.cfg.num_experts * (1 if which == "down_proj" else 2)
        if len(pieces) == want:
            self.loaded.add(target)

    def _add_qwen3_next_projection(self, name: str, t: torch.Tensor):
        """Qwen3-Next packs [q k v z] (and [b a]) per key-head group; split into the 3.5 projections."""
        c = self.cfg
        base = name.rsplit(".", 2)[0]
        nk, r = c.gdn_num_k_heads, c.gdn_num_v_heads // c.gdn_num_k_heads
        H = t.shape[-1]
        if name.endswith("in_proj_qkvz.weight"):
            g = t.view(nk, 2 * c.gdn_k_dim + 2 * r * c.gdn_v_dim, H)
            q, k, v, z = g.split([c.gdn_k_dim, c.gdn_k_dim, r * c.gdn_v_dim, r * c.gdn_v_dim], dim=1)
            self._copy(f"{base}.in_proj_qkv.weight", torch.cat([q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)]))
            self._copy(f"{base}.in_proj_z.weight", z.reshape(-1, H))
        else:
            b, a = t.view(nk, 2 * r, H).split([r, r], dim=1)
            self._copy(f"{base}.in_proj_b.weight", b.reshape(-1, H))
            self._copy(f"{base}.in_proj_a.weight", a.reshape(-1, H))

    def finish(self):
        missing = sorted(set(self.params) - self.loaded)
        self.problems += [f"missing tensor {n}" for n in missing]
        if self.problems:
            raise CheckpointError("checkpoint does not match the model:\n  " + "\n  ".join(self.problems))


def _has_mtp_tensors(files: list[str]) -> bool:
    for file in files:
        with safe_open(file, framework="pt") as f:
            if any(k.startswith("mtp.") for k in f.keys()):
                return True
    return False


def load_checkpoint(path: str, cfg: ModelConfig, device: str, dtype: torch.dtype, progress: bool = True):
    """Returns the model with every tensor loaded from the checkpoint in `path`; it has an MTP head (`.mtp`)
    when the config declares one and the checkpoint holds its `mtp.*` weights."""
    files = _checkpoint_files(path)
    with_mtp = cfg.num_mtp_layers > 0 and _has_mtp_tensors(files)
    model = build_empty_model(cfg, device, dtype, with_mtp)
    writer = _Writer(model)
    with torch.no_grad():
        for file in tqdm(files, desc="loading shards", disable=not progress or len(files) < 2):
            with safe_open(file, framework="pt", device=str(device)) as f:
                for name in f.keys():
                    writer.add(name, lambda n=name: f.get_tensor(n))
    writer.finish()
    return model
