"""What a hand-off carries: named tensors packed into one flat byte buffer, described by a JSON manifest."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

import torch

from .errors import TransferError

ALIGN = 64  # every tensor starts on a 64-byte boundary, so views of any dtype (and vector loads) are aligned

# Checksum weights are (position + 1) * _MUL mod 2**64. _MUL is odd, hence invertible mod 2**64: a single changed
# byte or two swapped bytes always change the sum (the difference is a nonzero multiple of _MUL that cannot wrap
# to zero for buffers below 2**55 bytes).
_MUL = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64
_CHECKSUM_CHUNK = 1 << 24  # bounds the int64 temporaries to 128 MiB per step
_U64 = (1 << 64) - 1


@dataclass
class TensorSpec:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: list[int]
    offset: int  # byte offset into the flat buffer (ALIGN-aligned)
    nbytes: int


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise TransferError(f"unknown dtype {name!r}")
    return dt


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(shape: list[int], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _slot(flat: torch.Tensor, spec: TensorSpec, dtype: torch.dtype) -> torch.Tensor:
    # A typed view of the spec's bytes; the aligned offset makes the dtype reinterpretation legal.
    return flat[spec.offset : spec.offset + spec.nbytes].view(dtype).view(spec.shape)


def pack(named: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[TensorSpec]]:
    """Copy the tensors into one contiguous uint8 buffer on their (common) device."""
    if not named:
        return torch.empty(0, dtype=torch.uint8), []
    device = named[0][1].device
    specs, seen, offset = [], set(), 0
    for name, t in named:
        if t.device != device:
            raise TransferError(f"pack: {name!r} is on {t.device}, expected {device}")
        if name in seen:
            raise TransferError(f"pack: duplicate tensor name {name!r}")
        seen.add(name)
        offset = _align(offset)
        nbytes = _nbytes(list(t.shape), t.dtype)
        specs.append(TensorSpec(name, dtype_name(t.dtype), list(t.shape), offset, nbytes))
        offset += nbytes
    flat = torch.empty(offset, dtype=torch.uint8, device=device)
    end = 0
    for (_, t), spec in zip(named, specs):
        if spec.offset > end:  # zero the padding so equal inputs give equal bytes (and checksums)
            flat[end : spec.offset].zero_()
        _slot(flat, spec, t.dtype).copy_(t.detach())  # copies non-contiguous inputs directly, no temporary
        end = spec.offset + spec.nbytes
    return flat, specs


def unpack(flat: torch.Tensor, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """Views into `flat` (no copies) with each spec's dtype and shape."""
    if flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous():
        raise TransferError("unpack: expected a contiguous 1-D uint8 tensor")
    out = {}
    for spec in specs:
        dtype = dtype_from_name(spec.dtype)
        if spec.offset % ALIGN or spec.offset + spec.nbytes > flat.numel():
            raise TransferError(f"unpack: {spec.name!r} at [{spec.offset}, +{spec.nbytes}) does not fit")
        if _nbytes(spec.shape, dtype) != spec.nbytes:
            raise TransferError(f"unpack: {spec.name!r} nbytes {spec.nbytes} != shape {spec.shape} x {spec.dtype}")
        out[spec.name] = _slot(flat, spec, dtype)
    return out


def checksum(flat: torch.Tensor) -> int:
    """Position-weighted wrapped int64 sum of the bytes, computed on the tensor's device.

    Integer addition mod 2**64 is associative, so the result does not depend on the reduction order: CPU and CUDA
    agree. Only the final scalar is copied to the host.
    """
    b = flat.reshape(-1)
    if b.dtype != torch.uint8:
        b = b.contiguous().view(torch.uint8)
    total = torch.zeros((), dtype=torch.int64, device=b.device)
    for start in range(0, b.numel(), _CHECKSUM_CHUNK):
        part = b[start : start + _CHECKSUM_CHUNK]
        w = torch.arange(start + 1, start + 1 + part.numel(), dtype=torch.int64, device=b.device).mul_(_MUL)
        total += w.mul_(part.to(torch.int64).add_(1)).sum()  # +1 so zero bytes still count
    return int(total.item()) & _U64


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _spec_from_dict(d, total_bytes: int) -> TensorSpec:
    if not isinstance(d, dict):
        raise TransferError("manifest: spec is not an object")
    try:
        spec = TensorSpec(d["name"], d["dtype"], d["shape"], d["offset"], d["nbytes"])
    except KeyError as e:
        raise TransferError(f"manifest: spec lacks {e}") from None
    ok = (
        isinstance(spec.name, str)
        and isinstance(spec.shape, list)
        and all(_is_int(s) and s >= 0 for s in spec.shape)
        and _is_int(spec.offset)
        and _is_int(spec.nbytes)
        and spec.offset >= 0
        and spec.offset % ALIGN == 0
    )
    if not ok:
        raise TransferError(f"manifest: malformed spec {d!r}")
    try:
        dtype = dtype_from_name(spec.dtype)
    except TransferError as e:
        raise TransferError(f"manifest: spec {spec.name!r}: {e}") from None
    if _nbytes(spec.shape, dtype) != spec.nbytes:
        raise TransferError(f"manifest: spec {spec.name!r} nbytes does not match shape and dtype")
    if spec.offset + spec.nbytes > total_bytes:
        raise TransferError(f"manifest: spec {spec.name!r} extends past total_bytes")
    return spec


@dataclass
class Manifest:
    request_id: str
    lease_id: str
    transfer_token: str  # one-time token from D's lease; D rejects a reused or unknown token
    fingerprint: str  # model_fingerprint(): P and D must serve the same model with the same cache layout
    specs: list[TensorSpec]
    total_bytes: int
    checksum: int | None = None  # checksum(flat) when P asks D to verify the bytes
    meta: dict = field(default_factory=dict)  # JSON-able extras (boundary, t_N, layer list, ...)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, d) -> Manifest:
        if not isinstance(d, dict):
            raise TransferError("manifest: not a JSON object")
        missing = [k for k in ("request_id", "lease_id", "transfer_token", "fingerprint", "specs", "total_bytes")
                   if k not in d]
        if missing:
            raise TransferError(f"manifest: missing {', '.join(missing)}")
        for k in ("request_id", "lease_id", "transfer_token", "fingerprint"):
            if not isinstance(d[k], str):
                raise TransferError(f"manifest: {k} must be a string")
        total, cs, meta = d["total_bytes"], d.get("checksum"), d.get("meta", {})
        if not _is_int(total) or total < 0:
            raise TransferError("manifest: total_bytes must be a non-negative integer")
        if cs is not None and not (_is_int(cs) and 0 <= cs <= _U64):
            raise TransferError("manifest: checksum must be null or an unsigned 64-bit integer")
        if not isinstance(meta, dict):
            raise TransferError("manifest: meta must be an object")
        if not isinstance(d["specs"], list):
            raise TransferError("manifest: specs must be a list")
        specs = [_spec_from_dict(s, total) for s in d["specs"]]
        if len({s.name for s in specs}) != len(specs):
            raise TransferError("manifest: duplicate tensor names")
        return cls(d["request_id"], d["lease_id"], d["transfer_token"], d["fingerprint"], specs, total, cs, meta)

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        try:
            d = json.loads(data)
        except (ValueError, TypeError) as e:  # UnicodeDecodeError is a ValueError
            raise TransferError(f"manifest: invalid JSON ({e})") from None
        return cls.from_dict(d)


def model_fingerprint(config_dict: dict, dtype: str, block_size: int, model_id: str) -> str:
    """sha256 of the canonical JSON of everything that fixes the hand-off layout."""
    doc = {"config": config_dict, "dtype": dtype, "block_size": block_size, "model_id": model_id}
    canon = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(canon.encode()).hexdigest()
