"""The interface every payload backend implements; client.py and server.py drive it.

Per transfer on one connection (P = client, D = server):
    P: extra = sender.prepare(ch, manifest, flat, timeout)   may exchange its own control frames first
    P: -> {"type": "transfer", "backend", "manifest", "extra"}
    D: on_header(manifest); <- {"ok"}
    P: sender.push(ch, manifest, flat, timeout)              D: receiver.pull(ch, manifest, extra, buf)
    D: checksum, on_payload; <- {"ok"}
Frames of any other type that name a backend go to that backend's receiver.control(ch, frame).
Zero-byte payloads skip prepare/push/pull. One Sender / Receiver lives per connection and is closed with it.
"""

from __future__ import annotations

import torch

from .errors import TransferRejected
from .manifest import Manifest
from .wire import Channel


class Sender:
    def __init__(self, device: torch.device):
        self.device = device

    def prepare(self, ch: Channel, manifest: Manifest, flat: torch.Tensor, timeout: float) -> dict:
        return {}

    def push(self, ch: Channel, manifest: Manifest, flat: torch.Tensor, timeout: float) -> None:
        pass

    def close(self) -> None:
        pass


class Receiver:
    def __init__(self, device: torch.device, timeout: float):
        self.device = device
        self.timeout = timeout

    def control(self, ch: Channel, frame: dict) -> None:
        """A backend's own control frame. TransferRejected = reply the error and keep the connection."""
        raise TransferRejected(f"unexpected frame type {frame.get('type')!r}")

    def pull(self, ch: Channel, manifest: Manifest, extra: dict, buf: torch.Tensor) -> None:
        """Fill buf. TransferRejected = clean failure (connection still in sync); anything else drops it."""
        raise NotImplementedError

    def close(self) -> None:
        pass
