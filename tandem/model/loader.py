"""Build the model on the target device and load safetensors checkpoints into it.

Accepts single-file and sharded (`model.safetensors.index.json`) checkpoints; HF names with or without the
`model.language_model.` prefix (`model.visual.*` ignored); experts fused (3-D) or per expert; Qwen3-Next's
interleaved `in_proj_qkvz` / `in_proj_ba` (converted to the 3.5 split layout); `mtp.*` into the MTP head
(`model.mtp`, present when the checkpoint has those tensors). Each tensor goes straight to the device and dtype;
nothing is staged in a second full CPU copy.
Under tensor parallelism a rank reads only its part of each split tensor (safetensors slices) and only its
experts; the Qwen3-Next packed projections are read whole, converted, then cut.
FP8 block-quantised checkpoints (`quantization_config.quant_method == "fp8"`, see `tandem/model/fp8.py`) load one
of two ways (`fp8.uses_fp8_compute`): on one GPU the model takes the FP8 layout and the e4m3 weights and their
`weight_scale_inv` go in as stored (W8A8 compute); elsewhere (CPU, tensor parallelism) each float8 weight is
dequantised with its scale into the model dtype as it is read (read whole, then cut).
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from tqdm import tqdm

from tandem.config import ModelConfig
from tandem.model.qwen3_5 import Qwen3_5ForCausalLM
from tandem.ops.fp8 import FP8_DTYPE
from tandem.ops.rope import inv_frequencies
from tandem.parallel import SINGLE, TPGroup

if TYPE_CHECKING:
    from tandem.model.fp8 import Fp8Quantization


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


def build_empty_model(cfg: ModelConfig, device: str, dtype: torch.dtype, with_mtp: bool = False,
                      tp: TPGroup = SINGLE, fp8=None) -> Qwen3_5ForCausalLM:
    """Allocates (uninitialised) parameters directly on `device` in `dtype`; inv_freq stays fp32. With `tp`, only
    this rank's shard. `fp8` (an Fp8Quantization): the FP8 layout, e4m3 weights and fp32 scales."""
    with _default_dtype(dtype), torch.device("meta"):
        model = Qwen3_5ForCausalLM(cfg, with_mtp, tp)
        if fp8 is not None:
            from tandem.model.fp8 import to_fp8_layout

            to_fp8_layout(model, fp8, quantize=False)
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


_PER_EXPERT = re.compile(
    r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")


def _canonical(name: str) -> str | None:
    """Checkpoint name -> our parameter name; None for tensors we do not use."""
    if name.startswith("model.visual.") or name.startswith("visual."):
        return None
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model."):]
    return name


class _Writer:
    """Copies checkpoint tensors into the model's parameters, converting layouts on the way. Under tensor
    parallelism each parameter gets this rank's part only, read as slices of the checkpoint tensor."""

    def __init__(self, model: Qwen3_5ForCausalLM):
        self.model, self.cfg, self.tp = model, model.cfg, model.tp
        self.params = dict(model.named_parameters())
        self.splits = model.parameter_splits() if self.tp.world_size > 1 else {}
        self.device, self.dtype = model.inv_freq.device, model.model.embed_tokens.weight.dtype
        self.loaded: set[str] = set()
        self.partial: dict[str, set] = {}  # fused params assembled from pieces
        self.problems: list[str] = []

    def _full_shape(self, name: str) -> tuple[int, ...]:
        shape = list(self.params[name].shape)
        split = self.splits.get(name)
        if split is not None:
            shape[split.dim] *= self.tp.world_size
        return tuple(shape)

    def _fits(self, name: str, shape, is_fp8: bool | None = None) -> bool:
        """Whether the checkpoint tensor `name` of (full) `shape` belongs to the model; records why not. `is_fp8`:
        whether the checkpoint stores it as float8, which must agree with the model's (FP8) layout."""
        if name not in self.params:
            self.problems.append(f"unexpected tensor {name} {tuple(shape)}")
            return False
        if tuple(shape) != self._full_shape(name):
            self.problems.append(f"mis-shaped tensor {name}: checkpoint {tuple(shape)}, model {self._full_shape(name)}")
            return False
        want = self.params[name].dtype == FP8_DTYPE
        if is_fp8 is not None and is_fp8 != want:
            self.problems.append(f"{name}: the checkpoint stores it {'as' if is_fp8 else 'not as'} float8, but by "
                                 "quantization_config (modules_to_not_convert) it is " + ("" if want else "not ")
                                 + "quantised")
            return False
        return True

    def _put(self, name: str, t: torch.Tensor):
        """A full tensor (already converted): this rank's part goes in."""
        if self._fits(name, t.shape):
            split = self.splits.get(name)
            self.params[name].data.copy_(self.tp.shard(t, split) if split is not None else t)
            self.loaded.add(name)

    def _read(self, f, key: str, name: str):
        """Copies this rank's part of checkpoint tensor `key` into parameter `name`, reading only that part."""
        sl = f.get_slice(key)
        if not self._fits(name, sl.get_shape(), sl.get_dtype() == "F8_E4M3"):
            return
        split = self.splits.get(name)
        if split is None:
            t = f.get_tensor(key)
        else:
            lead = (slice(None),) * split.dim
            parts = [sl[lead + (slice(a, b),)] for a, b in split.ranges(sl.get_shape()[split.dim], self.tp.rank,
                                                                        self.tp.world_size)]
            t = torch.cat(parts, split.dim) if len(parts) > 1 else parts[0]
        self.params[name].data.copy_(t.to(self.device, self.params[name].dtype))
        self.loaded.add(name)

    def add(self, key: str, f):
        """Checkpoint tensor `key` of the open safetensors file `f`."""
        name = _canonical(key)
        if name is None:
            return
        m = _PER_EXPERT.match(name)
        if m:
            read = lambda: f.get_tensor(key)  # noqa: E731 -- only for this rank's experts
            self._add_expert(m.group(1), int(m.group(2)), m.group(3), m.group(4), read)
            return
        if name.endswith(".linear_attn.in_proj_qkvz.weight") or name.endswith(".linear_attn.in_proj_ba.weight"):
            if f.get_slice(key).get_dtype() == "F8_E4M3":
                self.problems.append(f"{key}: Qwen3-Next's packed projections in float8 load only dequantised")
                return
            self._add_qwen3_next_projection(name, f.get_tensor(key).to(self.device, self.dtype))
            return
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return  # tied: the embedding is the head
        self._read(f, key, name)

    def _add_expert(self, prefix: str, e: int, which: str, suffix: str, read):
        """Expert e's `which` projection `.weight` or (FP8) `.weight_scale_inv`: its rows of the fused tensor."""
        target = f"{prefix}.down_proj" if which == "down_proj" else f"{prefix}.gate_up_proj"
        if suffix != "weight":
            target += "_scale_inv"
        if target not in self.params or e >= self.cfg.num_experts:
            self.problems.append(f"unexpected tensor {prefix}.{e}.{which}.{suffix}")
            return
        half = self.params[target].shape[1] // 2  # gate rows, then up rows (scale rows too: see Experts)
        first, local = self.tp.rank * self.params[target].shape[0], self.params[target].shape[0]
        if not first <= e < first + local:
            return  # another rank's expert
        e -= first
        if which == "down_proj":
            index = (e,)
        else:
            index = (e, slice(0, half)) if which == "gate_proj" else (e, slice(half, 2 * half))
        t = read()
        dst = self.params[target].data[index]
        if tuple(dst.shape) != tuple(t.shape):
            self.problems.append(f"mis-shaped tensor {prefix}.{e + first}.{which}.{suffix}: checkpoint "
                                 f"{tuple(t.shape)}, model {tuple(dst.shape)}")
            return
        if (t.dtype == FP8_DTYPE) != (dst.dtype == FP8_DTYPE):
            self.problems.append(f"{prefix}.{e + first}.{which}.{suffix}: stored as {t.dtype}, but the model's "
                                 f"layout holds {dst.dtype} (quantization_config.modules_to_not_convert)")
            return
        dst.copy_(t.to(self.device, dst.dtype))
        pieces = self.partial.setdefault(target, set())
        pieces.add((e, which))
        if len(pieces) == local * (1 if which == "down_proj" else 2):
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
            self._put(f"{base}.in_proj_qkv.weight", torch.cat([q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)]))
            self._put(f"{base}.in_proj_z.weight", z.reshape(-1, H))
        else:
            b, a = t.view(nk, 2 * r, H).split([r, r], dim=1)
            self._put(f"{base}.in_proj_b.weight", b.reshape(-1, H))
            self._put(f"{base}.in_proj_a.weight", a.reshape(-1, H))

    def finish(self):
        missing = sorted(set(self.params) - self.loaded)
        self.problems += [f"missing tensor {n}" for n in missing]
        if self.problems:
            raise CheckpointError("checkpoint does not match the model:\n  " + "\n  ".join(self.problems))


class _TensorSlice:
    """A loaded tensor behind the safetensors slice interface (`get_shape`, indexing)."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    def get_shape(self):
        return list(self.t.shape)

    def get_dtype(self):
        return "dequantised"

    def __getitem__(self, index):
        return self.t[index]


class _Fp8File:
    """An open safetensors file whose float8 weights read as fp32 (dequantised with their `weight_scale_inv`,
    which may lie in another shard); the scale tensors themselves are not listed. Problems go to `problems`."""

    def __init__(self, f, quant: Fp8Quantization, scale_files: dict[str, str], device, problems: list[str],
                 used_scales: set[str]):
        from tandem.model import fp8

        self.fp8 = fp8
        self.f, self.quant, self.scale_files, self.device = f, quant, scale_files, device
        self.problems, self.used_scales = problems, used_scales
        self._last: tuple[str, torch.Tensor] | None = None  # the loader asks for a slice, then the tensor

    def keys(self):
        return [k for k in self.f.keys() if not k.endswith(self.fp8.SCALE_SUFFIX)]

    def _is_fp8(self, key: str) -> bool:
        return self.f.get_slice(key).get_dtype() == "F8_E4M3"

    def _scale(self, key: str):
        file = self.scale_files.get(key + self.fp8.SCALE_SUFFIX)
        if file is None:
            return None
        self.used_scales.add(key + self.fp8.SCALE_SUFFIX)
        with safe_open(file, framework="pt", device=str(self.device)) as g:
            return g.get_tensor(key + self.fp8.SCALE_SUFFIX)

    def get_tensor(self, key: str) -> torch.Tensor:
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        if not self._is_fp8(key):
            if key + self.fp8.SCALE_SUFFIX in self.scale_files:
                self.used_scales.add(key + self.fp8.SCALE_SUFFIX)
                self.problems.append(f"{key}: has a {self.fp8.SCALE_SUFFIX} but is not float8_e4m3fn")
            return self.f.get_tensor(key)
        module = key.removesuffix(".weight")
        if any(self.fp8.module_matches(module, p) for p in self.quant.modules_to_not_convert):
            self.problems.append(f"{key}: stored as float8 but quantization_config.modules_to_not_convert names it")
        scale = self._scale(key)
        w = self.f.get_tensor(key)
        if scale is None:
            self.problems.append(f"missing scale tensor {key}{self.fp8.SCALE_SUFFIX} for the float8 weight {key}")
            return w.float()  # a placeholder of the right shape; the load fails in finish()
        try:
            return self.fp8.dequantize_block_fp8(w, scale, self.quant.weight_block_size)
        except self.fp8.Fp8FormatError as e:
            self.problems.append(f"mis-shaped scale tensor {key}{self.fp8.SCALE_SUFFIX}: {e}")
            return w.float()

    def get_slice(self, key: str):
        if not self._is_fp8(key):
            return self.f.get_slice(key)
        if self._last is None or self._last[0] != key:
            self._last = (key, self.get_tensor(key))
        return _TensorSlice(self._last[1])


def _has_mtp_tensors(files: list[str]) -> bool:
    for file in files:
        with safe_open(file, framework="pt") as f:
            if any(k.startswith("mtp.") for k in f.keys()):
                return True
    return False


def load_checkpoint(path: str, cfg: ModelConfig, device: str, dtype: torch.dtype, progress: bool = True,
                    tp: TPGroup = SINGLE, fp8_compute: bool | None = None):
    """Returns the model with every tensor loaded from the checkpoint in `path`; it has an MTP head (`.mtp`)
    when the config declares one and the checkpoint holds its `mtp.*` weights. Under tensor parallelism, this
    rank's shard of it. Its projections are fused (`fuse_projections`) once everything is loaded. An FP8
    checkpoint keeps its e4m3 weights when `fp8_compute` (None: `fp8.uses_fp8_compute`), else is dequantised."""
    from tandem.model.fp8 import uses_fp8_compute

    files = _checkpoint_files(path)
    quant = ModelConfig.from_dir(path).quantization if os.path.exists(os.path.join(path, "config.json")) else None
    native = quant is not None and uses_fp8_compute(device, tp, fp8_compute)
    with_mtp = cfg.num_mtp_layers > 0 and _has_mtp_tensors(files)
    model = build_empty_model(cfg, device, dtype, with_mtp, tp, fp8=quant if native else None)
    writer = _Writer(model)
    scale_files, used_scales = {}, set()
    if quant is not None and not native:
        from tandem.model.fp8 import SCALE_SUFFIX

        for file in files:
            with safe_open(file, framework="pt") as f:
                scale_files.update({k: file for k in f.keys() if k.endswith(SCALE_SUFFIX)})
    with torch.no_grad():
        for file in tqdm(files, desc="loading shards", disable=not progress or len(files) < 2):
            with safe_open(file, framework="pt", device=str(device)) as f:
                if quant is not None and not native:
                    f = _Fp8File(f, quant, scale_files, device, writer.problems, used_scales)
                for name in f.keys():
                    writer.add(name, f)
    writer.problems += [f"unexpected tensor {k} (its weight is not float8 or missing)"
                        for k in sorted(set(scale_files) - used_scales)]
    writer.finish()
    return model.fuse_projections()
