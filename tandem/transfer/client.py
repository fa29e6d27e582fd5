"""The hand-off client on a prefill worker: one persistent control connection per decode worker, the payload over
its backend (see backend.py for the per-transfer sequence)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from .backend import Sender
from .errors import TransferError, TransferRejected, error_text
from .kinds import BACKENDS, SENDERS
from .manifest import Manifest
from .wire import Channel

log = logging.getLogger(__name__)


class _Peer:
    """One persistent connection to a D, with its backend state, used under its own lock."""

    def __init__(self, address: str):
        self.address = address
        self.lock = threading.Lock()
        self.ch: Channel | None = None
        self.sender: Sender | None = None

    def reset(self) -> None:
        # After a failure mid-transfer the stream state is unknown: start over on the next send.
        if self.sender is not None:
            self.sender.close()
        if self.ch is not None:
            self.ch.close()
        self.ch = self.sender = None


class TransferClient:
    """Sends hand-offs from P. Thread-safe; sends to different D addresses run in parallel."""

    def __init__(self, backend: str, device: str | torch.device, ssl_context=None):
        self.ssl_context = ssl_context
        if backend not in BACKENDS:
            raise ValueError(f"unknown transfer backend {backend!r}, expected one of {BACKENDS}")
        self.backend = backend
        self.device = torch.device(device)
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()

    def _peer(self, address: str) -> _Peer:
        with self._lock:
            if address not in self._peers:
                self._peers[address] = _Peer(address)
            return self._peers[address]

    def send(self, address: str, manifest: Manifest, flat: torch.Tensor, timeout: float = 30.0,
             before_payload: Callable[[], None] | None = None) -> tuple[int, float]:
        """Hand `flat` (from manifest.pack) to the D at address. Returns (bytes, seconds).

        A CUDA `flat` must be ready on the current stream. Raises TransferRejected when D refuses (the connection
        stays open) and TransferError on connection problems or timeouts (the connection is dropped and the next
        send reconnects).
        """
        if flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous():
            raise TransferError("send: payload must be a contiguous 1-D uint8 tensor")
        if flat.numel() != manifest.total_bytes:
            raise TransferError(f"send: payload has {flat.numel()} bytes, manifest says {manifest.total_bytes}")
        peer = self._peer(address)
        with peer.lock:
            t0 = time.perf_counter()
            for attempt in (0, 1):
                reused, sent = peer.ch is not None, [False]
                try:
                    self._send_locked(peer, manifest, flat, timeout, before_payload, sent)
                    break
                except TransferRejected:
                    raise  # D answered cleanly: the connection stays usable
                except Exception as e:
                    peer.reset()
                    # a kept-alive connection to a D that has since restarted fails before D ever read the header
                    # (so the lease's token is unspent): one retry on a fresh connection
                    if attempt == 0 and reused and not sent[0]:
                        log.info("hand-off connection to %s was stale (%s); reconnecting", address, error_text(e))
                        continue
                    raise TransferError(f"hand-off of {manifest.request_id} to {address} failed: "
                                        f"{error_text(e)}") from e
            return manifest.total_bytes, time.perf_counter() - t0

    def _send_locked(self, peer: _Peer, manifest: Manifest, flat: torch.Tensor, timeout: float,
                     before_payload=None, sent=None) -> None:
        if peer.ch is None:
            peer.ch = Channel.connect(peer.address, timeout, self.ssl_context)
            peer.sender = SENDERS[self.backend](self.device)
        ch = peer.ch
        ch.settimeout(timeout)
        n = manifest.total_bytes
        extra = peer.sender.prepare(ch, manifest, flat, timeout) if n else {}
        ch.send_frame({"type": "transfer", "backend": self.backend, "manifest": manifest.to_dict(), "extra": extra})
        _expect_ok(ch.recv_frame())
        if sent is not None:
            sent[0] = True  # D accepted the header: its token is spent, no silent retry from here
        if before_payload is not None:  # fault injection (a stalled hand-off); raising drops the connection
            before_payload()
        if n:
            peer.sender.push(ch, manifest, flat, timeout)
        _expect_ok(ch.recv_frame())

    def close(self) -> None:
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
        for peer in peers:
            with peer.lock:
                peer.reset()


def _expect_ok(reply: dict) -> None:
    if reply.get("ok") is not True:
        raise TransferRejected(str(reply.get("error", "hand-off refused by D")))
