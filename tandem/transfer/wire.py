"""Control channel framing: 4-byte big-endian length + a JSON object, then (tcp backend) raw payload bytes."""

from __future__ import annotations

import json
import socket
import struct

import torch

from .errors import TransferError

MAX_FRAME = 16 << 20  # a manifest is small; anything bigger is a bug or an attack


class MalformedFrame(TransferError):
    """A frame of valid length whose body is not a JSON object: the stream is still in sync."""


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise TransferError(f"bad address {address!r}, expected host:port")
    return host.strip("[]"), int(port)


def host_view(t: torch.Tensor) -> memoryview:
    """Writable byte view of a contiguous uint8 CPU tensor (for send/recv without copies)."""
    return memoryview(t.numpy()).cast("B")


class Channel:
    """A blocking socket with frame helpers. Not thread-safe: one user at a time (callers hold a lock)."""

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # frames are small and latency-bound
        self.sock = sock

    @classmethod
    def connect(cls, address: str, timeout: float, ssl_context=None) -> Channel:
        host, port = parse_address(address)
        sock = socket.create_connection((host, port), timeout=timeout)
        if ssl_context is not None:  # TLS on the control socket (and the tcp backend's payload)
            try:
                sock = ssl_context.wrap_socket(sock, server_hostname=host)
            except Exception:
                sock.close()
                raise
        return cls(sock)

    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def local_host(self) -> str:
        return self.sock.getsockname()[0]

    def peer_host(self) -> str:
        return self.sock.getpeername()[0]

    def send_frame(self, obj: dict) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode()
        if len(data) > MAX_FRAME:
            raise TransferError(f"frame of {len(data)} bytes exceeds {MAX_FRAME}")
        self.sock.sendall(struct.pack(">I", len(data)) + data)

    def recv_frame(self) -> dict:
        (n,) = struct.unpack(">I", self.recv_exact(4))
        if n > MAX_FRAME:
            raise TransferError(f"frame of {n} bytes exceeds {MAX_FRAME}")
        data = self.recv_exact(n)
        try:
            obj = json.loads(data)
        except ValueError as e:
            raise MalformedFrame(f"malformed frame: {e}") from None
        if not isinstance(obj, dict):
            raise MalformedFrame("malformed frame: not a JSON object")
        return obj

    def recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        self.recv_into(memoryview(buf))
        return bytes(buf)

    def recv_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError("connection closed by peer")
            got += k

    def send_bytes(self, view: memoryview) -> None:
        self.sock.sendall(view)

    def close(self) -> None:
        # shutdown first: it wakes a thread blocked in recv on this socket, close alone does not
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
