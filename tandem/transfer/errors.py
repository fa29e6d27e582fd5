"""Errors of the P -> D hand-off."""


class TransferError(RuntimeError):
    """The hand-off failed: connection, timeout, protocol or malformed data."""


class TransferRejected(TransferError):
    """D refused the hand-off (bad lease/token/fingerprint, checksum mismatch, install failure)."""


def error_text(e: BaseException) -> str:
    """What the other side is told: a refusal's own words, else the exception's type and message."""
    return str(e) if isinstance(e, TransferRejected) else f"{type(e).__name__}: {e}"
