"""P -> D hand-off of a request's cache state: pack named tensors, send them, verify and install on D."""

from .base import BACKENDS, TransferClient, TransferServer, default_backend
from .errors import TransferError, TransferRejected
from .manifest import Manifest, TensorSpec, checksum, model_fingerprint, pack, unpack

__all__ = [
    "BACKENDS",
    "Manifest",
    "TensorSpec",
    "TransferClient",
    "TransferError",
    "TransferRejected",
    "TransferServer",
    "checksum",
    "default_backend",
    "model_fingerprint",
    "pack",
    "unpack",
]
