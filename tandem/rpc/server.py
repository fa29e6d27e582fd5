"""A gRPC server with what every Tandem process serves: grpc.health.v1 (Kubernetes' native gRPC probes) and
reflection (grpcurl), plus message-size limits and a drain that turns readiness off before stopping."""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def channel_options() -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def time_left(context, cap: float | None = None) -> float | None:
    """Seconds until the caller's deadline (None when it set none: grpc then reports ~1e19), at most `cap`."""
    remaining = context.time_remaining()
    if remaining is None or remaining > 1e9:
        return cap
    return remaining if cap is None else min(cap, remaining)


def on_end(context, fn) -> None:
    """Runs `fn` when the RPC ends however it ends; at once when it has already ended (a client that cancelled
    before the handler got this far), where grpc would silently drop the callback."""
    if not context.add_callback(fn):
        fn()


class Server:
    """Wraps grpc.server: `add(register_fn, servicer, full_service_name)`, then `start(host, port)`."""

    def __init__(self, max_workers: int = 256, interceptors=()):
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=channel_options(),
                                interceptors=list(interceptors))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        self._names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]

    def add(self, register, servicer, service_name: str) -> None:
        register(servicer, self.grpc)
        self._names.append(service_name)

    def start(self, host: str, port: int) -> int:
        reflection.enable_server_reflection(self._names, self.grpc)
        bound = self.grpc.add_insecure_port(f"{host}:{port}")
        if not bound:
            raise OSError(f"cannot listen on {host}:{port}")
        self.grpc.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.set_serving(True)
        return bound

    def set_serving(self, serving: bool) -> None:
        """Readiness: the service names. The empty name (liveness) stays SERVING through a drain, so Kubernetes
        stops routing to a draining pod without restarting it."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self._names:
            self.health.set(name, status)

    def stop(self, grace: float | None = None) -> None:
        self.set_serving(False)
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self.grpc.stop(grace).wait()
