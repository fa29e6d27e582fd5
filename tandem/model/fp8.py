"""FP8 block-quantised checkpoints: the official Qwen3 / DeepSeek "fp8" format.

Format. `config.json` carries `quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic", "weight_block_size": [128, 128], "modules_to_not_convert": [...]}`. Each quantised linear weight
`<module>.weight` [out, in] is stored as float8_e4m3fn beside `<module>.weight_scale_inv` (fp32,
[ceil(out / 128), ceil(in / 128)]); it reads back as `weight.float() * scale_inv`, each scale broadcast over its
128 x 128 block (edge blocks are partial). Experts are stored per expert (`mlp.experts.{e}.gate_proj.weight`, ...).
Everything else stays in the checkpoint's dtype: embedding, lm_head, norms, the MoE router (`mlp.gate`),
`shared_expert_gate`, GDN `in_proj_a` / `in_proj_b` / `conv1d` / `A_log` / `dt_bias`, the MTP head's `fc`, and any
module named (or matched, `*` = one name component) by `modules_to_not_convert`.

This module has the maths (`quantize_block_fp8`, `dequantize_block_fp8`), the naming rule (`is_quantized`), the
`quantization_config` parser (`Fp8Quantization.from_hf`) and a converter from a bf16 / fp32 checkpoint directory:

    python -m tandem.model.fp8 SRC_DIR DST_DIR [--block 128 128] [--exclude MODULE ...]

The loader (`tandem/model/loader.py`) dequantises such checkpoints into the model dtype on the CPU and under
tensor parallelism; on one GPU (`uses_fp8_compute`) it keeps the e4m3 weights and their scales, and the model runs
block-scaled W8A8 GEMMs (`tandem/ops/fp8.py`) and FP8 MoE experts (`tandem/ops/moe.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from dataclasses import dataclass

import torch

from tandem.ops.fp8 import (AMAX_FLOOR, FP8_DTYPE, FP8_MAX, Fp8FormatError, dequantize_block_fp8,  # noqa: F401
                             quantize_block_fp8, scale_shape)

SCALE_SUFFIX = "_scale_inv"  # `<name>.weight` -> `<name>.weight_scale_inv`

# The linear layers quantised by convention (the leaf module name). Routers, gates, in_proj_a/b, conv1d, norms,
# embeddings, lm_head and the MTP fc are not.
QUANTIZED_LINEARS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_qkvz",
                               "out_proj", "gate_proj", "up_proj", "down_proj"})


@dataclass(frozen=True)
class Fp8Quantization:
    weight_block_size: tuple[int, int] = (128, 128)
    modules_to_not_convert: tuple[str, ...] = ()
    activation_scheme: str = "dynamic"
    fmt: str = "e4m3"

    @classmethod
    def from_hf(cls, raw: dict | None) -> Fp8Quantization | None:
        """`quantization_config` of a config.json -> the FP8 scheme, None when there is none; every failure names
        the offending field."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise Fp8FormatError(f"quantization_config: expected an object, got {raw!r}")
        method = raw.get("quant_method")
        if method != "fp8":
            raise Fp8FormatError(f"quantization_config.quant_method: {method!r} is not supported (only 'fp8', "
                                 "block-quantised)")
        fmt = raw.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise Fp8FormatError(f"quantization_config.fmt: {fmt!r} is not supported (only 'e4m3')")
        act = raw.get("activation_scheme", "dynamic")
        if act != "dynamic":
            raise Fp8FormatError(f"quantization_config.activation_scheme: {act!r} is not supported (only 'dynamic'; "
                                 "static activation scales are not read)")
        block = raw.get("weight_block_size")
        if block is None:
            raise Fp8FormatError("quantization_config.weight_block_size: missing; per-tensor FP8 (`weight_scale`) is "
                                 "not supported, only block-quantised weights")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise Fp8FormatError("quantization_config.weight_block_size: expected two positive integers, "
                                 f"got {block!r}")
        skip = raw.get("modules_to_not_convert") or []
        if not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) for s in skip):
            raise Fp8FormatError(f"quantization_config.modules_to_not_convert: expected a list of names, got {skip!r}")
        return cls(tuple(block), tuple(skip), act, fmt)

    def to_hf(self) -> dict:
        return {"quant_method": "fp8", "fmt": self.fmt, "activation_scheme": self.activation_scheme,
                "weight_block_size": list(self.weight_block_size),
                "modules_to_not_convert": list(self.modules_to_not_convert)}


def _strip_prefix(name: str) -> str:
    return "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name


def module_matches(module: str, pattern: str) -> bool:
    """Whether `pattern` names `module`: a run of whole dotted components of it (`lm_head`, `mlp.gate`,
    `model.layers.*.mlp.gate`; `*` matches one component), with or without the `model.language_model.` prefix.
    `mlp.gate` does not match `mlp.gate_proj`."""
    module, pattern = _strip_prefix(module), _strip_prefix(pattern)
    rx = r"\.".join(r"[^.]+" if part == "*" else re.escape(part).replace(r"\*", r"[^.]*")
                    for part in pattern.split("."))
    return re.search(rf"(?:^|\.){rx}(?:\.|$)", module) is not None


def is_quantized(name: str, modules_to_not_convert=()) -> bool:
    """Whether checkpoint tensor `name` (per-expert naming) is stored in FP8: the `.weight` of a conventionally
    quantised linear (QUANTIZED_LINEARS) outside the vision tower and not named by `modules_to_not_convert`."""
    if not name.endswith(".weight"):
        return False
    module = name[: -len(".weight")]
    if module.startswith(("model.visual.", "visual.")) or module.rsplit(".", 1)[-1] not in QUANTIZED_LINEARS:
        return False
    return not any(module_matches(module, p) for p in modules_to_not_convert)


# -- the model's FP8 layout ------------------------------------------------------------------------------------------

def uses_fp8_compute(device, tp=None, requested: bool | None = None) -> bool:
    """Whether an FP8 model runs W8A8 (e4m3 weights kept) rather than dequantised: `requested`, else on one CUDA
    device (the kernels are GPU kernels, and the FP8 layout is not split across tensor-parallel ranks)."""
    if requested is not None:
        if requested and tp is not None and tp.world_size > 1:
            raise Fp8FormatError("FP8 compute does not run under tensor parallelism; load it dequantised")
        return requested
    return str(device).startswith("cuda") and (tp is None or tp.world_size == 1)


def _quantised_modules(model, quant: Fp8Quantization):
    """(parent module, child name, child) of each projection (nn.Linear) and experts module the checkpoint
    format quantises, by the naming rule and modules_to_not_convert."""
    from torch import nn

    from tandem.model.qwen3_5 import Experts

    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, nn.Linear) and is_quantized(name + ".weight", quant.modules_to_not_convert):
                yield parent, child_name, child
            elif isinstance(child, Experts) and is_quantized(f"{name}.0.gate_proj.weight",
                                                             quant.modules_to_not_convert):
                yield parent, child_name, child


def _expert_tensors(experts):
    """An experts module's tensors as the format quantises them: gate rows, up rows, down (each [E, out, in])."""
    inter = experts.gate_up_proj.shape[1] // 2
    return experts.gate_up_proj.data[:, :inter], experts.gate_up_proj.data[:, inter:], experts.down_proj.data


@torch.no_grad()
def to_fp8_layout(model, quant: Fp8Quantization, quantize: bool) -> None:
    """In place, before fusing: each quantised projection becomes an `Fp8Linear` and each quantised experts module
    holds e4m3 weights with their scales (`Experts`). `quantize`: from the current weights (random presets);
    else uninitialised (the loader fills them; a meta model stays on meta)."""
    from torch import nn

    from tandem.model.qwen3_5 import Fp8Linear

    block = quant.weight_block_size
    for parent, child_name, child in _quantised_modules(model, quant):
        if isinstance(child, nn.Linear):
            with torch.device(child.weight.device):
                new = Fp8Linear(child.in_features, child.out_features, block)
            if quantize:
                new.weight.data, new.weight_scale_inv.data = quantize_block_fp8(child.weight.data, block)
            setattr(parent, child_name, new)
            continue
        gate, up, down = _expert_tensors(child)
        if quantize:
            (qg, sg), (qu, su), (qd, sd) = (quantize_block_fp8(t, block) for t in (gate, up, down))
            qgu, sgu = torch.cat([qg, qu], 1), torch.cat([sg, su], 1)
        else:
            dev = gate.device
            qgu = torch.empty(child.gate_up_proj.shape, dtype=FP8_DTYPE, device=dev)
            experts, row_blocks, col_blocks = scale_shape(gate.shape, block)
            sgu = torch.empty(experts, 2 * row_blocks, col_blocks, dtype=torch.float32, device=dev)
            qd = torch.empty(down.shape, dtype=FP8_DTYPE, device=dev)
            sd = torch.empty(scale_shape(down.shape, block), dtype=torch.float32, device=dev)
        child.gate_up_proj = nn.Parameter(qgu, requires_grad=False)
        child.gate_up_proj_scale_inv = nn.Parameter(sgu, requires_grad=False)
        child.down_proj = nn.Parameter(qd, requires_grad=False)
        child.down_proj_scale_inv = nn.Parameter(sd, requires_grad=False)
        child.block = block


@torch.no_grad()
def round_trip_fp8(model, quant: Fp8Quantization) -> None:
    """In place: every weight the format quantises becomes dequantize(quantize(w)) in its own dtype, the model
    a dequantising load of the FP8 checkpoint gives (random FP8 presets off the GPU)."""
    block = quant.weight_block_size
    for _, _, child in _quantised_modules(model, quant):
        tensors = _expert_tensors(child) if hasattr(child, "gate_up_proj") else (child.weight.data,)
        for t in tensors:
            t.copy_(dequantize_block_fp8(*quantize_block_fp8(t, block), block))


# -- converter ------------------------------------------------------------------------------------------------------

_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _per_expert(name: str, t: torch.Tensor):
    """Fused 3-D experts ([E, 2I, H] gate|up, [E, H, I] down) -> per-expert tensors in the official naming."""
    m = _FUSED_EXPERTS.match(name)
    if m is None:
        yield name, t
        return
    prefix, which = m.groups()
    for e in range(t.shape[0]):
        if which == "down_proj":
            yield f"{prefix}.{e}.down_proj.weight", t[e]
        else:
            gate, up = t[e].chunk(2, dim=0)
            yield f"{prefix}.{e}.gate_proj.weight", gate
            yield f"{prefix}.{e}.up_proj.weight", up


def _source_shards(src: str) -> list[str]:
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{src}: no .safetensors files")
    return files


def _not_converted(names, quant_skip) -> list[str]:
    """The modules of 2-D-or-more `.weight` tensors kept in high precision (written into modules_to_not_convert)."""
    return sorted({n[: -len(".weight")] for n, ndim in names if n.endswith(".weight") and ndim >= 2
                   and not n.startswith(("model.visual.", "visual.")) and not is_quantized(n, quant_skip)})


def convert_checkpoint(src: str, dst: str, block=(128, 128), exclude=()) -> dict:
    """Writes the FP8 checkpoint of the bf16 / fp32 checkpoint directory `src` into `dst` (one output shard per
    source shard, so memory stays at one shard). Returns the written quantization_config."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if config.get("quantization_config") is not None:
        raise Fp8FormatError(f"{src}: already quantised (quantization_config present)")
    os.makedirs(dst, exist_ok=True)
    shards = _source_shards(src)
    skip = tuple(exclude)
    weight_map, seen, total = {}, [], 0
    for i, shard in enumerate(shards):
        out = {}
        with safe_open(os.path.join(src, shard), framework="pt") as f:
            for key in f.keys():
                for name, t in _per_expert(key, f.get_tensor(key)):
                    seen.append((name, t.ndim))
                    if is_quantized(name, skip):
                        if t.ndim != 2:
                            raise Fp8FormatError(f"{name}: expected a 2-D linear weight, got shape {tuple(t.shape)}")
                        q, s = quantize_block_fp8(t, block)
                        out[name], out[name + SCALE_SUFFIX] = q, s
                    else:
                        out[name] = t.contiguous()
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(out, os.path.join(dst, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in out})
        total += sum(t.numel() * t.element_size() for t in out.values())
    if len(shards) > 1:
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    quant = Fp8Quantization(tuple(block), tuple(dict.fromkeys(_not_converted(seen, skip) + list(skip))))
    config["quantization_config"] = quant.to_hf()
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    for name in os.listdir(src):  # tokenizer, generation config, chat template, ...
        path = os.path.join(src, name)
        if (os.path.isfile(path) and not name.endswith(".safetensors")
                and name not in ("config.json", "model.safetensors.index.json")):
            shutil.copy(path, os.path.join(dst, name))
    return quant.to_hf()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tandem.model.fp8",
                                description="Write the FP8 block-quantised checkpoint of a bf16/fp32 checkpoint.")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--block", type=int, nargs=2, default=(128, 128), metavar=("ROWS", "COLS"))
    p.add_argument("--exclude", nargs="*", default=(), metavar="MODULE",
                   help="extra modules to keep unquantised (added to modules_to_not_convert)")
    a = p.parse_args(argv)
    q = convert_checkpoint(a.src, a.dst, tuple(a.block), tuple(a.exclude))
    print(f"wrote {a.dst} (weight_block_size {q['weight_block_size']}, "
          f"{len(q['modules_to_not_convert'])} modules not converted)")


if __name__ == "__main__":
    main()
