"""Errors of the P -> D hand-off."""


class TransferError(RuntimeError):
    """The hand-off failed: connection, timeout, protocol or malformed data."""


class TransferRejected(TransferError):
    """D refused the hand-off (bad lease/token/fingerprint, checksum mismatch, install failure)."""
