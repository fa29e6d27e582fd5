"""API keys on the public endpoints: `authorization: Bearer <key>` on gRPC calls to tandem.v1.Tandem and on HTTP
/v1/* requests. Health and reflection stay open (probes carry no key). Keys compare in constant time."""

from __future__ import annotations

from tandem.rpc.auth import MetadataAuth, load_secret, same_secret

PROTECTED_PREFIX = "/tandem.v1.Tandem/"


def load_api_key(path: str | None) -> str | None:
    """From --api-key-file, else the TANDEM_API_KEY environment variable (the Kubernetes Secret); None: no auth."""
    return load_secret(path, "TANDEM_API_KEY")


def bearer_ok(header: str | None, key: str) -> bool:
    if not header or not header.startswith("Bearer "):
        return False
    return same_secret(header[len("Bearer "):].strip(), key)


class ApiKeyInterceptor(MetadataAuth):
    def __init__(self, key: str):
        super().__init__((PROTECTED_PREFIX,), lambda md: bearer_ok(md.get("authorization"), key),
                         "missing or invalid API key (authorization: Bearer ...)")
