"""Secrets carried as gRPC call metadata: the check a server makes (constant time, per method prefix; health and
reflection stay open for probes) and the client side that attaches them to every call of a channel.

The internal token guards the workers' services (tandem.v1.PrefillWorker and DecodeWorker): only the router, which
holds the same token, may call them. It comes from a file or the TANDEM_INTERNAL_TOKEN environment variable (a
Kubernetes Secret); `tandem serve` makes one per launch and hands it to its children in that variable."""

from __future__ import annotations

import collections
import hmac
import os
from typing import Callable

import grpc

from tandem.rpc.server import with_behavior

INTERNAL_TOKEN_ENV = "TANDEM_INTERNAL_TOKEN"
INTERNAL_TOKEN_HEADER = "x-tandem-internal-token"
INTERNAL_PREFIXES = ("/tandem.v1.PrefillWorker/", "/tandem.v1.DecodeWorker/")


def load_secret(path: str | None, env: str) -> str | None:
    """The file's contents (stripped) when a path is given, else the environment variable's; None when empty."""
    if path:
        with open(path) as f:
            value = f.read().strip()
    else:
        value = os.environ.get(env, "").strip()
    return value or None


def same_secret(given: str | None, secret: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), secret.encode())


class MetadataAuth(grpc.ServerInterceptor):
    """Calls to methods under `prefixes` whose metadata `accept` refuses end with UNAUTHENTICATED, their request
    left unparsed."""

    def __init__(self, prefixes: tuple[str, ...], accept: Callable[[dict], bool], message: str):
        self.prefixes, self.accept, self.message = prefixes, accept, message

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not details.method.startswith(self.prefixes):
            return handler
        if self.accept(dict(details.invocation_metadata or ())):
            return handler

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, self.message)

        return with_behavior(handler, deny)


def internal_auth(token: str) -> MetadataAuth:
    return MetadataAuth(INTERNAL_PREFIXES, lambda md: same_secret(md.get(INTERNAL_TOKEN_HEADER), token),
                        "internal service: missing or invalid internal token (only the router may call it)")


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self.metadata = metadata

    def _details(self, d):
        return _CallDetails(d.method, d.timeout, (*(d.metadata or ()), *self.metadata), d.credentials,
                            d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    intercept_stream_stream = intercept_stream_unary


def with_internal_token(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """`channel`, sending the internal token with every call (unchanged when there is none)."""
    return grpc.intercept_channel(channel, _AddMetadata(((INTERNAL_TOKEN_HEADER, token),))) if token else channel
