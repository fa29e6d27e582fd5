"""A gRPC server with what every Tandem process serves: grpc.health.v1 (Kubernetes' native gRPC probes) and
reflection (grpcurl; v1 and v1alpha), plus message-size limits, requests that do not parse answered with
INVALID_ARGUMENT, a port of its own (a taken port is an error, not shared) and a drain that turns readiness off
before stopping."""

from __future__ import annotations

import logging
import ssl
from concurrent import futures
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.rpc.reflection import SERVICE_NAMES as REFLECTION_NAMES, add_reflection

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def channel_options(max_receive: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", max_receive)]


def worker_channel_options() -> list[tuple[str, int]]:
    """The router's channels to workers: a restarted worker is reconnected within a second, not after gRPC's
    default exponential backoff (up to two minutes)."""
    return [*channel_options(), ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1000)]


@dataclass(frozen=True)
class Tls:
    """PEM files of one process. cert+key: it serves TLS and presents the cert as a client; ca: it verifies its
    peers against this CA, and as a server it then requires client certificates (mTLS)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    @staticmethod
    def from_args(args) -> "Tls | None":
        cert, key, ca = getattr(args, "tls_cert", None), getattr(args, "tls_key", None), getattr(args, "tls_ca", None)
        if bool(cert) != bool(key):
            raise SystemExit("--tls-cert and --tls-key go together")
        if ca and not cert:  # every process serves: mTLS needs its own certificate too
            raise SystemExit("--tls-ca needs --tls-cert and --tls-key")
        return Tls(cert, key, ca) if cert or ca else None

    def _read(self, path):
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self._read(self.key), self._read(self.cert))],
                                           root_certificates=self._read(self.ca), require_client_auth=bool(self.ca))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self._read(self.ca), private_key=self._read(self.key),
                                            certificate_chain=self._read(self.cert))

    def server_context(self, require_client_cert: bool = True) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        if self.ca and require_client_cert:
            ctx.load_verify_locations(self.ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca) if self.ca else ssl.create_default_context()
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx


def add_tls_args(ap) -> None:
    ap.add_argument("--tls-cert", default=None, help="PEM certificate: serve gRPC (and the hand-off) over TLS")
    ap.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    ap.add_argument("--tls-ca", default=None, help="PEM CA that peers' certificates must chain to; as a server, "
                    "client certificates are then required (mTLS)")


def make_channel(address: str, tls: Tls | None, options=None) -> grpc.Channel:
    options = options if options is not None else channel_options()
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)


def time_left(context, cap: float | None = None) -> float | None:
    """Seconds until the caller's deadline (None when it set none: grpc then reports ~1e19), at most `cap`."""
    remaining = context.time_remaining()
    if remaining is None or remaining > 1e9:
        return cap
    return remaining if cap is None else min(cap, remaining)


def wait_result(future, context, what: str = "the call"):
    """The future's result, polled so that a caller who went away (cancelled, or past its deadline) ends the wait
    with CANCELLED instead of leaving this handler thread blocked."""
    while True:
        try:
            return future.result(timeout=0.5)
        except futures.TimeoutError:
            if not context.is_active():
                context.abort(grpc.StatusCode.CANCELLED, f"{what} was cancelled")


def on_end(context, fn) -> None:
    """Runs `fn` when the RPC ends however it ends; at once when it has already ended (a client that cancelled
    before the handler got this far), where grpc would silently drop the callback."""
    if not context.add_callback(fn):
        fn()


_HANDLER_MAKERS = {(False, False): grpc.unary_unary_rpc_method_handler,
                   (False, True): grpc.unary_stream_rpc_method_handler,
                   (True, False): grpc.stream_unary_rpc_method_handler,
                   (True, True): grpc.stream_stream_rpc_method_handler}


def with_behavior(handler: grpc.RpcMethodHandler, behavior, request_deserializer=None) -> grpc.RpcMethodHandler:
    """A handler of the same kind and response serializer as `handler`, calling `behavior` instead."""
    return _HANDLER_MAKERS[handler.request_streaming, handler.response_streaming](
        behavior, request_deserializer=request_deserializer, response_serializer=handler.response_serializer)


class RequestNotParsed(grpc.RpcError):
    """A streamed request that did not parse: the consumer of the stream ends as if the stream had failed."""


class ParseRequests(grpc.ServerInterceptor):
    """Deserializes requests itself: bytes that are not the method's message end the call with INVALID_ARGUMENT
    (grpc's own deserializer ends it with INTERNAL, as if the server had failed)."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse, message = handler.request_deserializer, f"{details.method}: the request is not its protobuf message"
        behavior = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        if not handler.request_streaming:
            def unary(raw, context):
                try:
                    request = parse(raw)
                except DecodeError:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
                return behavior(request, context)
            return with_behavior(handler, unary)

        def parsed(raws, context):
            for raw in raws:
                try:
                    yield parse(raw)
                except DecodeError:
                    # the status the call ends with; the stream's consumer may be another thread than the handler's
                    context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
                    context.set_details(message)
                    raise RequestNotParsed(message) from None

        return with_behavior(handler, lambda raws, context: behavior(parsed(raws, context), context))


class Server:
    """Wraps grpc.server: `add(register_fn, servicer, full_service_name)`, then `start(host, port)`."""

    def __init__(self, max_workers: int = 256, interceptors=(), tls: Tls | None = None,
                 max_receive: int = MAX_MESSAGE_BYTES, max_concurrent_rpcs: int | None = None):
        self.tls = tls
        # max_concurrent_rpcs: beyond it grpc answers RESOURCE_EXHAUSTED at once instead of queueing the call
        # so_reuseport off: a second server on a taken port fails to bind instead of taking part of its calls.
        # ParseRequests last: it sees the service's own handler; callers are authenticated before their bytes are read
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                                options=[*channel_options(max_receive), ("grpc.so_reuseport", 0)],
                                interceptors=[*interceptors, ParseRequests()],
                                maximum_concurrent_rpcs=max_concurrent_rpcs)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        self._names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]

    def add(self, register, servicer, service_name: str) -> None:
        register(servicer, self.grpc)
        self._names.append(service_name)

    def start(self, host: str, port: int) -> int:
        add_reflection(self.grpc, self._names)
        try:
            bound = (self.grpc.add_secure_port(f"{host}:{port}", self.tls.server_credentials()) if self.tls
                     else self.grpc.add_insecure_port(f"{host}:{port}"))
        except RuntimeError:  # grpc's "Failed to bind"
            bound = 0
        if not bound:
            raise OSError(f"cannot listen on {host}:{port} (gRPC): the port is in use or not available")
        self.grpc.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.set_serving(True)
        return bound

    def set_serving(self, serving: bool) -> None:
        """Readiness: the service names. The empty name (liveness) stays SERVING through a drain, so Kubernetes
        stops routing to a draining pod without restarting it."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in [*self._names, *REFLECTION_NAMES]:
            self.health.set(name, status)

    def stop(self, grace: float | None = None) -> None:
        self.set_serving(False)
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self.grpc.stop(grace).wait()
