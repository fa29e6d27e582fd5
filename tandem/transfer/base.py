"""Hand-off server (on D) and client (on P) over a TCP control channel, with pluggable payload backends.

See backend.py for the per-transfer sequence. Replies are {"ok": true} or {"ok": false, "error": msg}.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable

import torch

from .backend import Receiver, Sender
from .cuda_ipc import IpcReceiver, IpcSender
from .errors import TransferError, TransferRejected
from .manifest import Manifest, checksum
from .tcp import TcpReceiver, TcpSender
from .torch_distributed import DistReceiver, DistSender
from .wire import Channel, MalformedFrame

log = logging.getLogger(__name__)

BACKENDS = ("tcp", "torch_distributed", "cuda_ipc")
_SENDERS: dict[str, type[Sender]] = {"tcp": TcpSender, "torch_distributed": DistSender, "cuda_ipc": IpcSender}
_RECEIVERS: dict[str, type[Receiver]] = {
    "tcp": TcpReceiver,
    "torch_distributed": DistReceiver,
    "cuda_ipc": IpcReceiver,
}


def default_backend(device: str | torch.device, same_host: bool) -> str:
    if torch.device(device).type != "cuda":
        return "tcp"
    return "cuda_ipc" if same_host else "torch_distributed"


def _error_text(e: BaseException) -> str:
    return str(e) if isinstance(e, TransferRejected) else f"{type(e).__name__}: {e}"


class TransferServer:
    """Receives hand-offs on D. One thread per connection; callbacks may run concurrently from several threads.

    on_header(manifest) vets the request (lease, token, fingerprint, specs) and raises TransferRejected to refuse;
    on_payload(manifest, flat) installs the state. An error in either reaches the client as TransferRejected.
    """

    def __init__(
        self,
        host: str,
        port: int,
        device: str | torch.device,
        on_header: Callable[[Manifest], None],
        on_payload: Callable[[Manifest, torch.Tensor], None],
        timeout: float = 60.0,  # bounds one payload receive, so a dead P frees its connection thread
        ssl_context=None,  # server-side ssl.SSLContext: TLS (mTLS when it requires client certificates)
    ):
        self.ssl_context = ssl_context
        self.host, self.port = host, port
        self.device = torch.device(device)
        self.on_header, self.on_payload = on_header, on_payload
        self.timeout = timeout
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: dict[Channel, threading.Thread] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> TransferServer:
        listener = socket.create_server((self.host, self.port))
        listener.settimeout(0.2)  # the accept loop polls the stop flag
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._accept_thread = threading.Thread(target=self._accept_loop, name="transfer-accept", daemon=True)
        self._accept_thread.start()
        return self

    def stop(self, join_timeout: float = 5.0) -> None:
        self._stopping.set()
        if self._accept_thread is not None:
            self._accept_thread.join(join_timeout)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns = list(self._conns.items())
        for ch, _ in conns:
            ch.close()  # wakes threads blocked on the socket
        deadline = time.monotonic() + join_timeout
        for _, t in conns:
            t.join(max(0.0, deadline - time.monotonic()))

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if not self._stopping.is_set():
                    log.exception("transfer server accept failed")
                return
            sock.settimeout(None)
            if self.ssl_context is not None:  # the handshake runs on the connection's own thread (_serve)
                sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            ch = Channel(sock)
            t = threading.Thread(target=self._serve, args=(ch,), name="transfer-conn", daemon=True)
            with self._lock:
                self._conns[ch] = t
            t.start()

    def _serve(self, ch: Channel) -> None:
        receivers: dict[str, Receiver] = {}
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # per thread: the callbacks' default device is D's
        try:
            if self.ssl_context is not None:
                ch.settimeout(10.0)  # a peer that never finishes its handshake does not hold the thread
                ch.sock.do_handshake()
            while not self._stopping.is_set():
                ch.settimeout(None)  # idle persistent connection: wait for the next transfer
                try:
                    frame = ch.recv_frame()
                except MalformedFrame as e:
                    ch.send_frame({"ok": False, "error": str(e)})
                    continue
                ch.settimeout(self.timeout)
                self._dispatch(ch, frame, receivers)
        except (ConnectionError, OSError, TransferError) as e:
            if not self._stopping.is_set():
                log.info("transfer connection closed: %s", e)
        except Exception:
            log.exception("transfer connection failed")
        finally:
            for rx in receivers.values():
                rx.close()
            ch.close()
            with self._lock:
                self._conns.pop(ch, None)

    def _dispatch(self, ch: Channel, frame: dict, receivers: dict[str, Receiver]) -> None:
        backend = frame.get("backend")
        if backend not in _RECEIVERS:
            ch.send_frame({"ok": False, "error": f"unknown backend {backend!r}"})
            return
        if backend not in receivers:
            receivers[backend] = _RECEIVERS[backend](self.device, self.timeout)
        rx = receivers[backend]
        if frame.get("type") != "transfer":
            try:
                rx.control(ch, frame)
            except TransferRejected as e:
                ch.send_frame({"ok": False, "error": str(e)})
            return
        try:
            manifest = Manifest.from_dict(frame.get("manifest"))
            self.on_header(manifest)
        except Exception as e:
            ch.send_frame({"ok": False, "error": _error_text(e)})
            return
        ch.send_frame({"ok": True})
        flat = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=self.device)
        if manifest.total_bytes:
            extra = frame.get("extra")
            try:
                rx.pull(ch, manifest, extra if isinstance(extra, dict) else {}, flat)
            except TransferRejected as e:  # the backend says the stream is still in sync
                ch.send_frame({"ok": False, "error": str(e)})
                return
        if manifest.checksum is not None:
            got = checksum(flat)
            if got != manifest.checksum:
                ch.send_frame({
                    "ok": False,
                    "error": f"hand-off checksum mismatch for request {manifest.request_id}: "
                    f"manifest {manifest.checksum:#018x}, received {got:#018x}",
                })
                return
        try:
            self.on_payload(manifest, flat)
        except Exception as e:
            ch.send_frame({"ok": False, "error": _error_text(e)})
            return
        ch.send_frame({"ok": True})


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
                        log.info("hand-off connection to %s was stale (%s); reconnecting", address, _error_text(e))
                        continue
                    raise TransferError(f"hand-off of {manifest.request_id} to {address} failed: "
                                        f"{_error_text(e)}") from e
            return manifest.total_bytes, time.perf_counter() - t0

    def _send_locked(self, peer: _Peer, manifest: Manifest, flat: torch.Tensor, timeout: float,
                     before_payload=None, sent=None) -> None:
        if peer.ch is None:
            peer.ch = Channel.connect(peer.address, timeout, self.ssl_context)
            peer.sender = _SENDERS[self.backend](self.device)
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
