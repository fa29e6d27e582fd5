"""The payload backends by name, and the one a worker takes by default."""

from __future__ import annotations

import torch

from .backend import Receiver, Sender
from .cuda_ipc import IpcReceiver, IpcSender
from .tcp import TcpReceiver, TcpSender
from .torch_distributed import DistReceiver, DistSender

BACKENDS = ("tcp", "torch_distributed", "cuda_ipc")
SENDERS: dict[str, type[Sender]] = {"tcp": TcpSender, "torch_distributed": DistSender, "cuda_ipc": IpcSender}
RECEIVERS: dict[str, type[Receiver]] = {"tcp": TcpReceiver, "torch_distributed": DistReceiver,
                                        "cuda_ipc": IpcReceiver}


def default_backend(device: str | torch.device, same_host: bool) -> str:
    if torch.device(device).type != "cuda":
        return "tcp"
    return "cuda_ipc" if same_host else "torch_distributed"
