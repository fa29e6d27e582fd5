"""Prometheus metrics for the router and the workers.

Names follow vLLM's (`vllm:time_to_first_token_seconds` -> `tandem:time_to_first_token_seconds`, same buckets) so
that dashboards and alerts written for vLLM carry over; every series has the labels `model_name` and `worker`
(`router`, `prefill-0`, `decode-1`, or the pod name on Kubernetes). Each process owns one `CollectorRegistry`.

    m = Metrics("qwen3.5-35b-a3b", "decode-0")
    m.start_http_server(9090)
    m.num_requests_running.set(3)
    m.time_to_first_token_seconds.observe(0.042)
    m.request_success_total("stop").inc()
    m.record_spec_decode(num_drafts=4, num_draft_tokens=8, accepted_per_position=[4, 3])

Only the series a role produces are created up front (at zero, so `rate()` sees the first increment); any other
metric is bound on first use, so a router does not export a KV-cache usage of 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "tandem:"
LABELS = ("model_name", "worker")
FINISHED_REASONS = ("stop", "length", "abort", "error")
ROLES = ("router", "prefill", "decode")
STEP_KINDS = ("decode", "mixed", "prefill")  # an engine step ran decode rows only, both, or prompt chunks only
# why the router placed a request's prefill where it did (router/routing.py)
ROUTES = ("prefix_hit", "least_loaded", "round_robin")

# vLLM's boundaries (vllm/v1/metrics/loggers.py): TTFT, inter-token latency, and one list shared by the
# per-request phase histograms (e2e, queue, prefill, decode).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
# Ours (vLLM has no hand-off): a CUDA IPC copy of one request's state takes tens of microseconds, a TCP push of a
# long prompt's KV seconds.
HANDOFF_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0)
# Ours: a decode step of a large model on one GPU takes milliseconds to tens of them, a cold prefill seconds.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
                5.0, 10.0)


@dataclass(frozen=True)
class _Spec:
    attr: str  # the Python attribute and, with PREFIX, the exported name (counters end in _total already)
    kind: type
    doc: str
    roles: tuple[str, ...]  # roles whose processes create the series at start-up
    extra: tuple[str, ...] = ()  # labels beyond model_name/worker
    buckets: tuple[float, ...] = ()


_R, _P, _D = ("router",), ("prefill",), ("decode",)
_SPECS = (
    _Spec("num_requests_running", Gauge, "Requests being processed (router: in flight; workers: in the batch).",
          ROLES),
    _Spec("num_requests_waiting", Gauge, "Requests queued, not yet scheduled.", ROLES),
    _Spec("kv_cache_usage_perc", Gauge, "Fraction of attention KV blocks in use (0..1).", _P + _D),
    _Spec("gdn_state_slot_usage_perc", Gauge, "Fraction of Gated-DeltaNet state slots in use (0..1).", _P + _D),
    _Spec("num_preemptions_total", Counter, "Requests preempted (blocks and slot freed, recomputed later) because "
          "the running ones needed more KV blocks than were free.", _P + _D),
    _Spec("prefix_cache_queries_total", Counter, "Prompt tokens looked up in the prefix cache.", _P + _D),
    _Spec("prefix_cache_hits_total", Counter, "Prompt tokens found in the prefix cache (their KV and GDN state "
          "not computed again).", _P + _D),
    _Spec("cache_config_info", Gauge, "Information of the cache config (1; the labels say it): KV blocks (the null "
          "block included), tokens a block holds, GDN state slots.", _P + _D,
          ("num_gpu_blocks", "block_size", "num_state_slots")),
    _Spec("request_success_total", Counter, "Finished requests by finish reason.", _R, ("finished_reason",)),
    _Spec("prompt_tokens_total", Counter, "Prompt tokens processed.", _R + _P),
    _Spec("generation_tokens_total", Counter, "Tokens generated.", _R + _D),
    _Spec("time_to_first_token_seconds", Histogram, "Time to first token in seconds.", _R, buckets=TTFT_BUCKETS),
    _Spec("inter_token_latency_seconds", Histogram, "Inter-token latency in seconds.", _R, buckets=ITL_BUCKETS),
    _Spec("e2e_request_latency_seconds", Histogram, "End-to-end request latency in seconds.", _R,
          buckets=REQUEST_LATENCY_BUCKETS),
    _Spec("request_queue_time_seconds", Histogram, "Time a request waited before being scheduled.", _P + _D,
          buckets=REQUEST_LATENCY_BUCKETS),
    _Spec("request_prefill_time_seconds", Histogram, "Time a request spent in prefill.", _P,
          buckets=REQUEST_LATENCY_BUCKETS),
    _Spec("request_decode_time_seconds", Histogram, "Time a request spent in decode.", _D,
          buckets=REQUEST_LATENCY_BUCKETS),
    _Spec("spec_decode_num_drafts_total", Counter, "Speculative decoding steps that proposed drafts.", _D),
    _Spec("spec_decode_num_draft_tokens_total", Counter, "Draft tokens proposed.", _D),
    _Spec("spec_decode_num_accepted_tokens_total", Counter, "Draft tokens accepted.", _D),
    _Spec("spec_decode_num_accepted_tokens_per_pos_total", Counter, "Draft tokens accepted, by draft position.", _D,
          ("position",)),
    _Spec("handoff_bytes_total", Counter, "Bytes of prefill->decode state moved (sent on P, received on D).",
          _P + _D),
    _Spec("handoff_seconds", Histogram, "Duration of one prefill->decode state hand-off.", _P + _D,
          buckets=HANDOFF_BUCKETS),
    _Spec("handoff_failures_total", Counter, "Failed hand-offs by reason.", _P + _D, ("reason",)),
    _Spec("lease_expiries_total", Counter, "Decode reservations that expired or were aborted before admission.",
          _D),
    _Spec("leases_active", Gauge, "Decode reservations currently held.", _D),
    _Spec("engine_step_seconds", Histogram, "Duration of one engine step (host time up to its sampled tokens), by "
          "what it ran: decode (decode/verify rows only), mixed (decode rows and prompt chunks), prefill (prompt "
          "chunks only).", _P + _D, ("kind",), buckets=STEP_BUCKETS),
    _Spec("engine_step_prompt_tokens_total", Counter, "Prompt tokens the engine steps ran, by step kind: with "
          "engine_step_seconds, the time a mixed or prefill step spends per prompt token.", _P + _D, ("kind",)),
    _Spec("worker_healthy", Gauge, "1 when the router sees the worker healthy, else 0.", _R,
          ("target_worker", "role")),
    _Spec("router_requests_total", Counter, "Prefills the router placed, by route: prefix_hit (on the worker with "
          "the longest expected prefix-cache hit), least_loaded (by load), round_robin.", _R, ("route",)),
)
_BY_ATTR = {s.attr: s for s in _SPECS}
_LABELLED = {s.attr for s in _SPECS if s.extra}


def _base_name(spec: _Spec) -> str:
    # prometheus_client appends _total to counters itself; give it the name without it.
    name = PREFIX + spec.attr
    return name[: -len("_total")] if spec.kind is Counter else name


def _exported(spec: _Spec) -> list[str]:
    base = _base_name(spec)
    if spec.kind is Counter:
        return [base + "_total"]
    if spec.kind is Histogram:
        return [base + "_bucket", base + "_sum", base + "_count"]
    return [base]


def _role_of(worker: str) -> str | None:
    for role in ROLES:
        if role in worker:
            return role
    return None


class Metrics:
    """One process's metrics. Unlabelled metrics are attributes bound to (model_name, worker); metrics with an
    extra label are methods taking it and returning the bound child."""

    def __init__(self, model_name: str, worker: str, registry: CollectorRegistry | None = None,
                 role: str | None = None):
        # The `_created` series double the series count and no dashboard reads them (process-wide switch).
        prometheus_client.disable_created_metrics()
        self.model_name, self.worker = model_name, worker
        self.role = role if role is not None else _role_of(worker)
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"role: {self.role!r} is not one of {ROLES}")
        self.registry = registry if registry is not None else CollectorRegistry()
        self._totals_seen: dict[str, int] = {}  # engine counters so far, by metric
        self._cache_config_set = False
        self.families = {}
        for s in _SPECS:
            kw = {"buckets": s.buckets} if s.buckets else {}
            self.families[s.attr] = s.kind(_base_name(s), s.doc, LABELS + s.extra, registry=self.registry, **kw)
        for s in _SPECS:
            if self.role is None or self.role in s.roles:
                if not s.extra:
                    getattr(self, s.attr)  # binds now, so the series exists at 0
                elif s.attr == "request_success_total":
                    for reason in FINISHED_REASONS:
                        self.request_success_total(reason)
                elif s.attr in ("engine_step_seconds", "engine_step_prompt_tokens_total"):
                    for kind in STEP_KINDS:
                        getattr(self, s.attr)(kind)
                elif s.attr == "router_requests_total":
                    for route in ROUTES:
                        self.router_requests_total(route)

    def __getattr__(self, attr):
        # Unlabelled metrics not pre-bound for this role are bound on first use.
        spec = _BY_ATTR.get(attr)
        if spec is None or spec.extra or "families" not in self.__dict__:
            raise AttributeError(attr)
        child = self.families[attr].labels(self.model_name, self.worker)
        setattr(self, attr, child)
        return child

    # --- metrics with an extra label -------------------------------------------------------------------------
    def request_success_total(self, finished_reason: str):
        if finished_reason not in FINISHED_REASONS:  # keeps the label's cardinality bounded
            raise ValueError(f"finished_reason: {finished_reason!r} is not one of {FINISHED_REASONS}")
        return self.families["request_success_total"].labels(self.model_name, self.worker, finished_reason)

    def spec_decode_num_accepted_tokens_per_pos_total(self, position: int):
        return self.families["spec_decode_num_accepted_tokens_per_pos_total"].labels(
            self.model_name, self.worker, str(int(position)))

    def engine_step_seconds(self, kind: str):
        return self._by_step_kind("engine_step_seconds", kind)

    def engine_step_prompt_tokens_total(self, kind: str):
        return self._by_step_kind("engine_step_prompt_tokens_total", kind)

    def _by_step_kind(self, attr: str, kind: str):
        if kind not in STEP_KINDS:
            raise ValueError(f"kind: {kind!r} is not one of {STEP_KINDS}")
        return self.families[attr].labels(self.model_name, self.worker, kind)

    def cache_config_info(self, num_gpu_blocks: int, block_size: int, num_state_slots: int):
        return self.families["cache_config_info"].labels(self.model_name, self.worker, str(num_gpu_blocks),
                                                         str(block_size), str(num_state_slots))

    def handoff_failures_total(self, reason: str):
        return self.families["handoff_failures_total"].labels(self.model_name, self.worker, reason)

    def router_requests_total(self, route: str):
        if route not in ROUTES:
            raise ValueError(f"route: {route!r} is not one of {ROUTES}")
        return self.families["router_requests_total"].labels(self.model_name, self.worker, route)

    def worker_healthy(self, target_worker: str, role: str):
        return self.families["worker_healthy"].labels(self.model_name, self.worker, target_worker, role)

    # --- one-line helpers for call sites ---------------------------------------------------------------------
    def request_finished(self, finished_reason: str, *, e2e: float | None = None, queue: float | None = None,
                         prefill: float | None = None, decode: float | None = None) -> None:
        """Counts one finished request and observes whichever phase durations (seconds) this process knows."""
        self.request_success_total(finished_reason).inc()
        for value, attr in ((e2e, "e2e_request_latency_seconds"), (queue, "request_queue_time_seconds"),
                            (prefill, "request_prefill_time_seconds"), (decode, "request_decode_time_seconds")):
            if value is not None:
                getattr(self, attr).observe(value)

    def record_spec_decode(self, num_drafts: int, num_draft_tokens: int,
                           accepted_per_position: Sequence[int]) -> None:
        """One engine step's speculation counts; accepted total is the sum over positions (0-based)."""
        self.spec_decode_num_drafts_total.inc(num_drafts)
        self.spec_decode_num_draft_tokens_total.inc(num_draft_tokens)
        self.spec_decode_num_accepted_tokens_total.inc(sum(accepted_per_position))
        for pos, n in enumerate(accepted_per_position):
            self.spec_decode_num_accepted_tokens_per_pos_total(pos).inc(n)

    def record_preemptions(self, total: int) -> None:
        """The engine's preemptions so far (its counter); the metric gains what is new."""
        self._advance("num_preemptions_total", total)

    def record_prefix_cache(self, queries: int, hits: int) -> None:
        """The engine's prefix-cache token counts so far."""
        self._advance("prefix_cache_queries_total", queries)
        self._advance("prefix_cache_hits_total", hits)

    def _advance(self, attr: str, total: int) -> None:
        seen = self._totals_seen.get(attr, 0)
        if total != seen:
            getattr(self, attr).inc(total - seen)
            self._totals_seen[attr] = total

    def set_cache_config(self, num_gpu_blocks: int, block_size: int, num_state_slots: int) -> None:
        if not self._cache_config_set:  # fixed for the process's life: one series
            self.cache_config_info(num_gpu_blocks, block_size, num_state_slots).set(1)
            self._cache_config_set = True

    def handoff_done(self, nbytes: int, seconds: float) -> None:
        self.handoff_bytes_total.inc(nbytes)
        self.handoff_seconds.observe(seconds)

    def handoff_failed(self, reason: str) -> None:
        self.handoff_failures_total(reason).inc()

    def set_worker_healthy(self, target_worker: str, role: str, healthy: bool) -> None:
        self.worker_healthy(target_worker, role).set(1.0 if healthy else 0.0)

    def remove_worker(self, target_worker: str, role: str) -> None:
        """Drops a worker's health series once discovery no longer lists it (no stale 0 left to alert on)."""
        try:
            self.families["worker_healthy"].remove(self.model_name, self.worker, target_worker, role)
        except KeyError:
            pass

    # --- exposition ------------------------------------------------------------------------------------------
    def start_http_server(self, port: int, host: str = "0.0.0.0"):
        return start_http_server(port, host, self.registry)

    def generate_latest(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)

    @staticmethod
    def names() -> list[str]:
        """Every sample name this module can export, as Prometheus stores it."""
        return sorted(n for s in _SPECS for n in _exported(s))


def observe_engine(m: Metrics, engine) -> None:
    """The gauges a worker reads off its engine (its loop calls this after each step and each batch of calls)."""
    sched, pools = engine.scheduler, engine.pools
    m.num_requests_running.set(len(sched.running))
    m.num_requests_waiting.set(len(sched.waiting))
    m.kv_cache_usage_perc.set(pools.blocks.num_used / pools.blocks.capacity)
    m.gdn_state_slot_usage_perc.set(pools.slots.num_used / pools.slots.capacity)
    m.record_preemptions(sched.num_preemptions)
    if sched.prefix is not None:
        m.record_prefix_cache(sched.prefix.queries, sched.prefix.hits)
    m.set_cache_config(engine.ecfg.num_kv_blocks, engine.ecfg.block_size, engine.ecfg.num_state_slots)


def start_http_server(port: int, host: str = "0.0.0.0", registry: CollectorRegistry | None = None):
    """Serves `registry` at /metrics on a daemon thread; returns (server, thread). Port 0 picks a free port
    (`server.server_port`)."""
    if registry is None:
        raise ValueError("registry is required: each process serves its own, never the global default")
    return prometheus_client.start_http_server(port, addr=host, registry=registry)
