"""The hand-off server on a decode worker: a TCP control channel per prefill worker, the payload over the backend
the prefill worker names (see backend.py for the per-transfer sequence). Replies are {"ok": true} or
{"ok": false, "error": msg}.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable

import torch

from .backend import Receiver
from .errors import TransferError, TransferRejected, error_text
from .kinds import RECEIVERS
from .manifest import Manifest, checksum
from .wire import Channel, MalformedFrame

log = logging.getLogger(__name__)


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
        if backend not in RECEIVERS:
            ch.send_frame({"ok": False, "error": f"unknown backend {backend!r}"})
            return
        if backend not in receivers:
            receivers[backend] = RECEIVERS[backend](self.device, self.timeout)
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
            ch.send_frame({"ok": False, "error": error_text(e)})
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
            ch.send_frame({"ok": False, "error": error_text(e)})
            return
        ch.send_frame({"ok": True})
