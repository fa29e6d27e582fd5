"""API keys on the public endpoints: `authorization: Bearer <key>` on gRPC calls to tandem.v1.Tandem and on HTTP
/v1/* requests. Health and reflection stay open (probes carry no key). Keys compare in constant time."""

from __future__ import annotations

import hmac
import os

import grpc

PROTECTED_PREFIX = "/tandem.v1.Tandem/"


def load_api_key(path: str | None) -> str | None:
    """From --api-key-file, else the TANDEM_API_KEY environment variable (the Kubernetes Secret); None: no auth."""
    if path:
        with open(path) as f:
            key = f.read().strip()
    else:
        key = os.environ.get("TANDEM_API_KEY", "").strip()
    return key or None


def bearer_ok(header: str | None, key: str) -> bool:
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), key.encode())


class ApiKeyInterceptor(grpc.ServerInterceptor):
    def __init__(self, key: str):
        self.key = key

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not details.method.startswith(PROTECTED_PREFIX):
            return handler
        header = dict(details.invocation_metadata or ()).get("authorization")
        if bearer_ok(header, self.key):
            return handler

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key (authorization: Bearer ...)")

        make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.unary_unary_rpc_method_handler
        return make(deny, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
