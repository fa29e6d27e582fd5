"""Payload bytes straight over the control socket. CUDA tensors go through a reused pinned host buffer."""

from __future__ import annotations

import torch

from .backend import Receiver, Sender
from .manifest import Manifest
from .wire import Channel, host_view

STAGE_BYTES = 16 << 20  # pinned bounce buffer size per connection for CUDA tensors


def _pinned(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, pin_memory=True)


class TcpSender(Sender):
    def __init__(self, device: torch.device):
        super().__init__(device)
        self._stage: torch.Tensor | None = None

    def push(self, ch: Channel, manifest: Manifest, flat: torch.Tensor, timeout: float) -> None:
        if flat.device.type == "cpu":
            ch.send_bytes(host_view(flat))
            return
        if self._stage is None:
            self._stage = _pinned(STAGE_BYTES)
        for off in range(0, flat.numel(), STAGE_BYTES):
            part = flat[off : off + STAGE_BYTES]
            stage = self._stage[: part.numel()]
            stage.copy_(part)  # blocking device->host copy, so the bytes are there before sendall
            ch.send_bytes(host_view(stage))


class TcpReceiver(Receiver):
    def __init__(self, device: torch.device, timeout: float):
        super().__init__(device, timeout)
        self._stage: torch.Tensor | None = None

    def pull(self, ch: Channel, manifest: Manifest, extra: dict, buf: torch.Tensor) -> None:
        if buf.device.type == "cpu":
            ch.recv_into(host_view(buf))
            return
        if self._stage is None:
            self._stage = _pinned(STAGE_BYTES)
        for off in range(0, buf.numel(), STAGE_BYTES):
            part = buf[off : off + STAGE_BYTES]
            stage = self._stage[: part.numel()]
            ch.recv_into(host_view(stage))
            part.copy_(stage)  # blocking: the stage is reused by the next chunk
