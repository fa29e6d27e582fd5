"""The router's view of its workers: addresses from flags or a DNS name (a Kubernetes headless Service, re-resolved
periodically), health and load from polling each worker's GetLoad, and what the router itself has in flight
there (fresher than the last poll)."""

from __future__ import annotations

import logging
import random
import socket
import threading
from dataclasses import dataclass, field

import grpc

from router.decode_stream import DecodeStream
from router.routing import Route, RoutingConfig, RoutingPolicy
from tandem.rpc import common_pb2, worker_pb2, worker_pb2_grpc
from tandem.rpc.auth import with_internal_token
from tandem.rpc.server import Tls, make_channel, worker_channel_options

log = logging.getLogger(__name__)


@dataclass
class Worker:
    address: str
    role: str
    stub: object
    channel: grpc.Channel
    healthy: bool = False
    load: common_pb2.Load = field(default_factory=common_pb2.Load)
    inflight_requests: int = 0
    inflight_prompt_tokens: int = 0
    prefill_stub: object = None  # a decode worker's PrefillWorker service (colocated: Prefill of its own leases)
    stream: DecodeStream | None = None  # a decode worker's: the one stream of all its requests' tokens


def resolve(dns: str) -> list[str]:
    """"name:port" -> one "ip:port" per address the name resolves to (empty when it does not resolve)."""
    host, port = dns.rsplit(":", 1)
    try:
        infos = socket.getaddrinfo(host, int(port), proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return []
    return sorted({f"[{i[4][0]}]:{port}" if ":" in i[4][0] else f"{i[4][0]}:{port}" for i in infos})


class WorkerPool:
    def __init__(self, role: str, addresses: list[str], dns: str | None, poll_seconds: float = 1.0, metrics=None,
                 tls: Tls | None = None, internal_token: str | None = None, routing: RoutingConfig | None = None):
        self.tls, self.internal_token = tls, internal_token
        self.routing = RoutingPolicy(routing or RoutingConfig(), role)
        if not addresses and not dns:
            raise ValueError(f"no {role} workers: give addresses or a DNS name")
        self.role, self._static, self._dns, self._poll = role, list(addresses), dns, poll_seconds
        self.metrics = metrics
        self._stub_cls = worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
        self._lock = threading.Lock()
        self.workers: dict[str, Worker] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{role}-pool", daemon=True)

    def start(self) -> "WorkerPool":
        self.refresh()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            for w in self.workers.values():
                w.channel.close()

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            self.refresh()

    def refresh(self) -> None:
        """Re-resolves the worker list, then polls every worker's load (a failed poll marks it unhealthy)."""
        addresses = set(self._static) | (set(resolve(self._dns)) if self._dns else set())
        with self._lock:
            for gone in set(self.workers) - addresses:
                self.workers.pop(gone).channel.close()
                self.routing.forget(gone)
                if self.metrics is not None:
                    self.metrics.remove_worker(gone, self.role)
            for a in addresses - set(self.workers):
                ch = with_internal_token(make_channel(a, self.tls, worker_channel_options()), self.internal_token)
                stub, decode = self._stub_cls(ch), self.role == "decode"
                self.workers[a] = Worker(a, self.role, stub, ch,
                                         prefill_stub=worker_pb2_grpc.PrefillWorkerStub(ch) if decode else None,
                                         stream=DecodeStream(stub) if decode else None)
            workers = list(self.workers.values())
        for w in workers:
            try:
                w.load = w.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=max(self._poll, 1.0))
                if not w.healthy:
                    log.info("%s worker %s is healthy", self.role, w.address)
                w.healthy = True
            except grpc.RpcError as e:
                if w.healthy:
                    log.warning("%s worker %s is unhealthy: %s", self.role, w.address, e.code())
                w.healthy = False
                self.routing.forget(w.address)  # back, it may have restarted with an empty cache
            if self.metrics is not None:
                self.metrics.set_worker_healthy(w.address, self.role, w.healthy)

    def candidates(self, tokens: int = 0, route: Route | None = None) -> list[Worker]:
        """Healthy workers, best first, by the routing policy (`router/routing.py`) when given the request's
        `route`, else by load: a prefill worker by queued prompt tokens; a decode worker first by whether its free
        KV tokens and state slots (at the last poll) hold a lease of `tokens` tokens, then by free KV blocks and
        state slots (as fractions) and running requests."""
        with self._lock:
            ws = [w for w in self.workers.values() if w.healthy]
        # ties go to a random worker: requests arriving together would otherwise all pick the same one
        if self.role == "prefill":
            ranked = sorted(ws, key=lambda w: (self.load(w), w.inflight_requests, random.random()))
            return self.routing.order(ranked, self.load, route)

        def cost(w):  # requests per unit of free capacity: spreads load, avoids nearly full workers
            ld = w.load
            kv = ld.free_kv_blocks / ld.total_kv_blocks if ld.total_kv_blocks else 0.0
            slots = ld.free_state_slots / ld.total_state_slots if ld.total_state_slots else 0.0
            return (1 + w.inflight_requests + ld.running_requests) / max(min(kv, slots), 1e-3)

        def fits(w):
            return w.load.free_kv_tokens >= tokens and w.load.free_state_slots > 0
        ranked = sorted(ws, key=lambda w: (not fits(w), cost(w), random.random()))
        return self.routing.order(ranked, self.load, route, fits)

    def load(self, w: Worker) -> int:
        """What the routing policy balances, in tokens: a prefill worker's queued prompt tokens (with those the
        router sent since the last poll), a decode worker's KV tokens in use (at the last poll)."""
        if self.role == "prefill":
            return w.inflight_prompt_tokens + w.load.queued_prompt_tokens
        return w.load.total_kv_tokens - w.load.free_kv_tokens

    def placed(self, w: Worker, route: Route, tokens: list[int] | None = None) -> None:
        """The request was sent to `w` (`tokens`: what `w` holds by its end, when more than the prompt)."""
        self.routing.placed(w, route, tokens)

    def count(self, w: Worker, route: Route) -> None:
        """`w` prefilled the request: tandem:router_requests_total by why it went there."""
        if self.metrics is not None:
            self.metrics.router_requests_total(route.reason(self.role, w.address)).inc()

    def max_model_len(self) -> int:
        """The shortest max_model_len the healthy workers reported (0: none reported yet)."""
        with self._lock:
            lens = [w.load.max_model_len for w in self.workers.values() if w.healthy and w.load.max_model_len]
        return min(lens, default=0)

    def all(self) -> list[Worker]:
        with self._lock:
            return list(self.workers.values())
