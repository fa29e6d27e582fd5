"""P -> D hand-off of a request's cache state: pack named tensors, send them, verify and install on D."""

from .client import TransferClient
from .kinds import BACKENDS, default_backend
from .server import TransferServer
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
