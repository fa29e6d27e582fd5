"""The hand-off contract: what a prefill worker gives a decode worker for one request, as one typed object, and
its round trip through the wire form (a manifest whose JSON `meta` holds the scalars, and the flat tensor
buffer). Both workers build and read it here, so the two sides cannot drift apart key by key."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import torch

from .errors import TransferError
from .manifest import Manifest, checksum, pack, unpack


@dataclass
class HandOff:
    first_token: int  # sampled by the prefill worker; the decode worker continues after it
    drafts: list[int]  # the MTP head's drafts after the first token, verified by the first decode step
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # KV blocks and GDN states (cache/handoff.py)
    first_logprobs: dict[int, float] | None = None  # when the request asked for logprobs
    rng_state: torch.Tensor | None = None  # a seeded request's generator after the first token (uint8 bytes)

    def to_wire(self, request_id: str, lease_id: str, transfer_token: bytes,
                fingerprint: str) -> tuple[Manifest, torch.Tensor]:
        flat, specs = pack(list(self.tensors.items()))
        meta = {"first_token": self.first_token, "drafts": list(self.drafts),
                "first_logprobs": ({str(t): v for t, v in self.first_logprobs.items()}
                                   if self.first_logprobs else None),
                "rng_state": (base64.b64encode(self.rng_state.numpy().tobytes()).decode()
                              if self.rng_state is not None else None)}
        manifest = Manifest(request_id=request_id, lease_id=lease_id, transfer_token=transfer_token.hex(),
                            fingerprint=fingerprint, specs=specs, total_bytes=flat.numel(), checksum=checksum(flat),
                            meta=meta)
        return manifest, flat

    @classmethod
    def from_wire(cls, manifest: Manifest, flat: torch.Tensor) -> HandOff:
        """The hand-off a peer sent; TransferError when its meta is not what `to_wire` writes."""
        meta = manifest.meta
        first, drafts = meta.get("first_token"), meta.get("drafts")
        if not _is_token(first) or not isinstance(drafts, list) or not all(map(_is_token, drafts)):
            raise TransferError("manifest: meta needs first_token and drafts as token ids")
        lps, rng = meta.get("first_logprobs"), meta.get("rng_state")
        try:
            first_logprobs = {int(t): float(v) for t, v in lps.items()} if lps else None
            rng_state = (torch.frombuffer(bytearray(base64.b64decode(rng, validate=True)), dtype=torch.uint8)
                         if rng else None)
        except (AttributeError, TypeError, ValueError) as e:
            raise TransferError(f"manifest: malformed first_logprobs or rng_state ({e})") from None
        return cls(first, drafts, unpack(flat, manifest.specs), first_logprobs, rng_state)


def _is_token(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
