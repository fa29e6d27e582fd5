"""Payload over a two-rank torch.distributed group per connection (P = rank 0, D = rank 1).

The group is built directly from a TCPStore that D hosts for this pair, not via init_process_group, so one
process can hold any number of pairs. NCCL when both ends are on CUDA, otherwise Gloo (a CUDA end then stages
through host memory).
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from .backend import Receiver, Sender
from .errors import TransferError, TransferRejected
from .manifest import Manifest
from .wire import Channel

NAME = "torch_distributed"
TAG = 0  # transfers on a pair are sequential (the connection lock), so one tag suffices
P_RANK, D_RANK = 0, 1


def _group(store: dist.Store, rank: int, kind: str, local_host: str, timeout: timedelta):
    if kind == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        # Bind gloo to the address the control connection already uses: reachable from the peer by construction.
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    from torch.distributed import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    opts.is_high_priority_stream = False
    return ProcessGroupNCCL(store, rank, 2, opts)


def _destroy(pg) -> None:
    if pg is None:
        return
    try:
        pg.shutdown()  # NCCL frees its communicators here; gloo may not implement it
    except Exception:
        pass


def _wait(work, timeout: float) -> None:
    if not work.wait(timedelta(seconds=timeout)):
        raise TransferError("torch.distributed transfer did not complete")


class DistSender(Sender):
    def __init__(self, device: torch.device):
        super().__init__(device)
        self._pg = self._store = None
        self._kind = ""

    def prepare(self, ch: Channel, manifest: Manifest, flat: torch.Tensor, timeout: float) -> dict:
        if self._pg is None:
            self._connect(ch, flat.device, timeout)
        return {}

    def _connect(self, ch: Channel, device: torch.device, timeout: float) -> None:
        ch.send_frame({"type": "dist_hello", "backend": NAME, "device": device.type})
        reply = ch.recv_frame()
        if not reply.get("ok"):
            raise TransferRejected(reply.get("error", "dist_hello refused"))
        td = timedelta(seconds=timeout)
        store = dist.TCPStore(ch.peer_host(), int(reply["port"]), None, False, td)
        pg = _group(dist.PrefixStore(reply["prefix"], store), P_RANK, reply["kind"], ch.local_host(), td)
        done = ch.recv_frame()  # D's side of the group construction
        if not done.get("ok"):
            _destroy(pg)
            raise TransferError(f"torch.distributed group setup failed on D: {done.get('error')}")
        self._pg, self._store, self._kind = pg, store, reply["kind"]

    def push(self, ch: Channel, manifest: Manifest, flat: torch.Tensor, timeout: float) -> None:
        if self._kind == "nccl":
            with torch.cuda.device(flat.device):
                _wait(self._pg.send([flat], D_RANK, TAG), timeout)
        else:
            _wait(self._pg.send([flat.cpu()], D_RANK, TAG), timeout)

    def close(self) -> None:
        _destroy(self._pg)
        self._pg = self._store = None


class DistReceiver(Receiver):
    def __init__(self, device: torch.device, timeout: float):
        super().__init__(device, timeout)
        self._pg = self._store = None
        self._kind = ""

    def control(self, ch: Channel, frame: dict) -> None:
        if frame.get("type") != "dist_hello":
            return super().control(ch, frame)
        self.close()  # a repeated hello replaces the pair's group
        kind = "nccl" if frame.get("device") == "cuda" and self.device.type == "cuda" else "gloo"
        td = timedelta(seconds=self.timeout)
        try:
            store = dist.TCPStore(ch.local_host(), 0, None, True, td, wait_for_workers=False)
        except Exception as e:
            raise TransferRejected(f"cannot host a TCPStore for the pair: {e}") from e
        prefix = f"tandem-transfer/{uuid.uuid4().hex}"
        ch.send_frame({"ok": True, "port": store.port, "prefix": prefix, "kind": kind})
        try:
            pg = _group(dist.PrefixStore(prefix, store), D_RANK, kind, ch.local_host(), td)
        except Exception as e:  # P learns it from the frame instead of waiting out its timeout
            ch.send_frame({"ok": False, "error": f"{type(e).__name__}: {e}"})
            return
        self._pg, self._store, self._kind = pg, store, kind
        ch.send_frame({"ok": True})

    def pull(self, ch: Channel, manifest: Manifest, extra: dict, buf: torch.Tensor) -> None:
        if self._pg is None:
            raise TransferRejected("torch_distributed transfer before dist_hello")
        if self._kind == "nccl":
            with torch.cuda.device(buf.device):
                _wait(self._pg.recv([buf], P_RANK, TAG), self.timeout)
        elif buf.device.type == "cpu":
            _wait(self._pg.recv([buf], P_RANK, TAG), self.timeout)
        else:
            host = torch.empty(buf.numel(), dtype=torch.uint8)
            _wait(self._pg.recv([host], P_RANK, TAG), self.timeout)
            buf.copy_(host)

    def close(self) -> None:
        _destroy(self._pg)
        self._pg = self._store = None
