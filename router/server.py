"""The public gRPC service: validates and tokenizes, leases decode capacity, has a prefill worker compute the
prompt and hand its state to that decode worker, then relays the decode stream.

Order per request: Admit on the prefill worker with the fewest queued prompt tokens whose queue has room for the
prompt (when none has: RESOURCE_EXHAUSTED with a retry hint at once, before any capacity is held) -> Reserve on
the decode worker with the most free capacity per request -> Prefill on the admitting prefill worker (it pushes the
state straight to the decode worker), the lease renewed on the decode worker while the call is in flight, so no
time spent queued can outlive it -> the first token goes to the client -> the decode stream follows. A lease that
expired anyway (a renewal came late) is not the client's fault: the request starts over with a new one, a few
times at most. The client's deadline bounds every call below it; a request that ends any other way than finishing
(client cancel or disconnect, deadline, Abort, an error) is aborted on both workers, so nothing stays allocated.

Colocated mode (no prefill workers: `prefill` is None): the same order, but Prefill goes to the decode worker that
issued the lease (its PrefillWorker service on the same channel), which prefills the request in its own engine;
there is no hand-off, and that one worker is the only one to abort.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import random
import threading
import time
import uuid
from dataclasses import dataclass

import grpc

from router.decode_stream import StreamError
from router.routing import Route
from router.workers import Worker, WorkerPool
from tandem import __version__
from tandem.config import ModelConfig
from tandem.detokenizer import IncrementalDetokenizer
from tandem.rpc import common_pb2, router_pb2, router_pb2_grpc, worker_pb2
from tandem.rpc.server import on_end, time_left
from tandem.rpc.convert import finish_reason_name, sampling_from_proto, sampling_to_proto
from tandem.structured import grammar_spec

log = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
MAX_REQUEST_ID = 256
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 1024  # bounds the detokenizer's per-message matching work
RETRY_AFTER_MS = 1000  # the hint sent with RESOURCE_EXHAUSTED (trailing metadata `retry-after-ms`)
LEASE_ATTEMPTS = 3  # leases one request may take when each expired before its prefill was handed over


@dataclass
class _Active:
    """A request in flight, for Abort and for cleanup when its RPC ends."""

    request_id: str
    prefill: Worker | None = None
    decode: Worker | None = None
    finished: bool = False
    aborted: bool = False  # by the Abort RPC: the client gets a last message with finish reason abort
    closed: bool = False  # the client's RPC has ended
    metrics: _RequestMetrics | None = None
    cached_tokens: int = 0  # prompt tokens the worker that prefilled it found in its prefix cache
    route: Route | None = None  # where its prompt went and why (router/routing.py)


class _RequestMetrics:
    """One request's latencies for the router's metrics; every method is a no-op without metrics."""

    def __init__(self, metrics, prompt_tokens: int):
        self.m, self.prompt_tokens = metrics, prompt_tokens
        self.start, self.last, self.done = time.monotonic(), None, False
        if self.m is not None:
            self.m.num_requests_running.inc()

    def tokens(self, n: int) -> None:
        if self.m is None or n == 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.m.time_to_first_token_seconds.observe(now - self.start)
            self.m.prompt_tokens_total.inc(self.prompt_tokens)
        else:
            self.m.inter_token_latency_seconds.observe(now - self.last)
        self.last = now
        self.m.generation_tokens_total.inc(n)

    def finished(self, reason: str) -> None:
        """The first call counts (an error is not counted again as an abort when the RPC ends)."""
        if self.m is None or self.done:
            return
        self.done = True
        self.m.num_requests_running.dec()
        self.m.request_finished(reason, e2e=time.monotonic() - self.start)


class Router(router_pb2_grpc.TandemServicer):
    def __init__(self, cfg: ModelConfig, model_name: str, max_model_len: int | None, num_speculative_tokens: int,
                 prefill: WorkerPool | None, decode: WorkerPool, tokenizer=None, transfer_backend: str = "",
                 queue_timeout: float = 60.0, metrics=None, max_queued_requests: int | None = None,
                 decode_failover: bool = False):
        self.queue_timeout, self.max_queued, self.failover = queue_timeout, max_queued_requests, decode_failover
        self._queued = 0  # requests waiting for decode capacity now (bounded by max_queued)
        self.cfg, self.model_name, self._max_model_len = cfg, model_name, max_model_len
        self.k, self.prefill, self.decode, self.tokenizer = num_speculative_tokens, prefill, decode, tokenizer
        self.transfer_backend, self.metrics = transfer_backend, metrics
        self.mode = "colocated" if prefill is None else "disaggregated"
        self._lock = threading.Lock()
        self._active: dict[str, _Active] = {}
        self.draining = False

    @property
    def max_model_len(self) -> int:
        """--max-model-len, else the shortest the workers report, else (none reported yet) the model's own."""
        if self._max_model_len:
            return self._max_model_len
        return min((n for n in (p.max_model_len() for p in self._pools()) if n),
                   default=self.cfg.max_position_embeddings)

    def busy(self) -> bool:
        with self._lock:
            return bool(self._active)

    def active_requests(self) -> int:
        with self._lock:
            return len(self._active)

    @staticmethod
    def _exhausted(context, msg: str, code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED) -> None:
        """RESOURCE_EXHAUSTED (or `code`) with a retry hint the HTTP side turns into `Retry-After`."""
        context.set_trailing_metadata((("retry-after-ms", str(RETRY_AFTER_MS)),))
        context.abort(code, msg)

    def _pools(self) -> list[WorkerPool]:
        return [p for p in (self.prefill, self.decode) if p is not None]

    def stop(self) -> None:
        for pool in self._pools():
            pool.stop()

    # ---- RPCs -------------------------------------------------------------------------------------------------
    def Generate(self, request, context):
        yield from self._generate(request, context)

    def GenerateUnary(self, request, context):
        out = router_pb2.GenerateResponse()
        for m in self._generate(request, context):
            out.request_id = m.request_id
            out.token_ids.extend(m.token_ids)
            out.text += m.text
            out.logprobs.extend(m.logprobs)
            out.prompt_token_ids.extend(m.prompt_token_ids)
            out.prompt_logprobs.extend(m.prompt_logprobs)
            out.finish_reason, out.prompt_tokens, out.completion_tokens, out.cached_tokens = \
                m.finish_reason, m.prompt_tokens, m.completion_tokens, m.cached_tokens
        return out

    def Abort(self, request, context):
        with self._lock:
            state = self._active.get(request.request_id)
        if state is not None:
            state.aborted = True
            self._abort_on([state.prefill, state.decode], state.request_id)
        return router_pb2.AbortResponse(found=state is not None)

    def GetModelInfo(self, request, context):
        return router_pb2.ModelInfo(model_name=self.model_name, model_type=self.cfg.model_type,
                                    vocab_size=self.cfg.vocab_size, max_model_len=self.max_model_len,
                                    num_speculative_tokens=self.k, eos_token_ids=list(self.cfg.eos_token_ids))

    def GetServerInfo(self, request, context):
        for pool in self._pools():
            pool.refresh()
        workers = [router_pb2.WorkerStatus(address=w.address, role=w.role, healthy=w.healthy, load=w.load)
                   for pool in self._pools() for w in pool.all()]
        return router_pb2.ServerInfo(version=__version__, transfer_backend=self.transfer_backend, workers=workers,
                                     prefill_workers=[w.address for w in self.prefill.all()] if self.prefill else [],
                                     decode_workers=[w.address for w in self.decode.all()], mode=self.mode)

    # ---- validation -------------------------------------------------------------------------------------------
    def _validate(self, request, context):
        def bad(msg):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg)

        if len(request.request_id) > MAX_REQUEST_ID:
            bad(f"request_id is longer than {MAX_REQUEST_ID} characters")
        kind = request.WhichOneof("prompt")
        if kind is None:
            bad("a prompt is required: set text or token_ids")
        if kind == "text":
            if self.tokenizer is None:
                bad("this model has no tokenizer: send token_ids instead of text")
            prompt = self.tokenizer.encode(request.text)
        else:
            prompt = list(request.token_ids.ids)
        if not prompt:
            bad("the prompt is empty")
        over = [t for t in prompt if t >= self.cfg.vocab_size]
        if over:
            bad(f"prompt token ids out of range [0, {self.cfg.vocab_size}): {over[:5]}")
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            bad(f"sampling: {e}")
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            bad(f"sampling: logprobs must be at most {MAX_LOGPROBS}, got {params.logprobs}")
        if params.structured_outputs is not None:  # checked before the request takes a seat anywhere
            if self.tokenizer is None:
                bad("structured_outputs: this model has no tokenizer")
            try:
                grammar_spec(params.structured_outputs)
            except ValueError as e:
                bad(f"structured_outputs: {e}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > MAX_LOGPROBS:
            bad(f"sampling: prompt_logprobs must be at most {MAX_LOGPROBS}, got {params.prompt_logprobs}")
        if len(request.stop) > MAX_STOP_STRINGS or sum(len(x) for x in request.stop) > MAX_STOP_CHARS:
            bad(f"stop: at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters in all")
        if any(t >= self.cfg.vocab_size for t in params.stop_token_ids):
            bad(f"sampling: stop_token_ids out of range [0, {self.cfg.vocab_size})")
        limit = self.max_model_len
        if len(prompt) + params.max_tokens + self.k > limit:
            bad(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens})"
                f"{f' + {self.k} speculative' if self.k else ''} exceeds max_model_len ({limit})")
        return request.request_id or uuid.uuid4().hex, prompt, params

    # ---- one request ------------------------------------------------------------------------------------------
    def _generate(self, request, context):
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the router is draining")
        rid, prompt, params = self._validate(request, context)
        state = _Active(rid)
        with self._lock:
            if rid in self._active:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is in flight")
            self._active[rid] = state
        state.metrics = timing = _RequestMetrics(self.metrics, len(prompt))
        on_end(context, lambda: self._end(state))
        try:
            skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True  # as over HTTP
            detok = IncrementalDetokenizer(self.tokenizer, skip, stop=list(request.stop))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

        def message(ids, logprobs, reason, n):
            text, stopped = detok.add(list(ids))
            if stopped:  # a stop string matched: this message ends the request whatever the workers do
                reason = common_pb2.FINISH_REASON_STOP
            elif reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                text += detok.flush()
            state.finished = reason != common_pb2.FINISH_REASON_UNSPECIFIED
            timing.tokens(len(ids))
            if state.finished:
                timing.finished(finish_reason_name(reason))
            return router_pb2.GenerateResponse(request_id=rid, token_ids=ids, logprobs=logprobs, text=text,
                                               finish_reason=reason, prompt_tokens=len(prompt), completion_tokens=n,
                                               cached_tokens=state.cached_tokens)

        def aborted():
            return message([], [], common_pb2.FINISH_REASON_ABORT, 0)

        try:
            lease, first = self._start(state, prompt, params, context)
            if state.closed:  # the client left while a worker call was under way: free what that call took
                self._abort_on([state.decode], rid)
                return
            if state.aborted or first.finish_reason == common_pb2.FINISH_REASON_ABORT:
                yield aborted()
                return
            state.cached_tokens = first.num_cached_tokens
            lps = [first.first_logprobs] if params.logprobs is not None else []
            msg = message([first.first_token_id], lps, first.finish_reason, 1)
            if params.prompt_logprobs is not None:  # the prompt's, on the first message only
                msg.prompt_token_ids.extend(prompt)
                msg.prompt_logprobs.extend(first.prompt_logprobs)
            if state.finished:  # the first token ended it: give the lease back
                self._abort_on([state.decode], rid)
                yield msg
                return
            yield msg
            generated, n = [first.first_token_id], 1
            while True:
                try:
                    for m in self._decoded(state, lease, context):
                        n += len(m.token_ids)
                        generated.extend(m.token_ids)
                        msg = message(m.token_ids, m.logprobs, m.finish_reason, n)
                        if msg.finish_reason != m.finish_reason:  # ended here by a stop string: free the worker
                            self._abort_on([state.decode], rid)
                            yield msg
                            return
                        yield msg
                    self.decode.placed(state.decode, state.route, prompt + generated)  # the next turn's prefix
                    return
                except grpc.RpcError as e:
                    if not (self.failover and e.code() == grpc.StatusCode.UNAVAILABLE and not state.aborted
                            and context.is_active()):
                        raise
                    # decode failover: the worker died mid-stream. Prefill prompt + what was generated elsewhere
                    # and continue there; the next greedy token is the one the dead worker would have produced.
                    # A constrained request's new matcher starts after the generated tokens.
                    log.warning("decode worker %s failed for %s after %d tokens; failing over", state.decode.address,
                                rid, n)
                    state.decode.healthy = False
                    self._release_decode(state, abort=False)
                    so = params.structured_outputs
                    if so is not None:
                        so = dataclasses.replace(so, resumed_tokens=len(generated))
                    rest = dataclasses.replace(params, max_tokens=params.max_tokens - n,
                                               min_tokens=max(0, params.min_tokens - n), prompt_logprobs=None,
                                               structured_outputs=so)
                    lease, first = self._start(state, prompt + generated, rest, context)
                    if state.closed:
                        self._abort_on([state.decode], rid)
                        return
                    if state.aborted or first.finish_reason == common_pb2.FINISH_REASON_ABORT:
                        yield aborted()
                        return
                    n += 1
                    generated.append(first.first_token_id)
                    lps = [first.first_logprobs] if params.logprobs is not None else []
                    msg = message([first.first_token_id], lps, first.finish_reason, n)
                    if state.finished:
                        self._abort_on([state.decode], rid)
                        yield msg
                        return
                    yield msg
        except grpc.RpcError as e:
            if state.aborted:
                yield aborted()
            elif context.is_active():
                timing.finished("error")
                if e.code() == grpc.StatusCode.ABORTED:  # the worker let the lease go (not the client's fault)
                    self._exhausted(context, e.details() or "the decode lease expired; retry later",
                                    grpc.StatusCode.UNAVAILABLE)
                context.abort(e.code(), e.details() or str(e.code()))
        finally:
            if state.decode is not None:
                state.decode.inflight_requests -= 1

    @staticmethod
    def _decoded(state: _Active, lease, context):
        """The request's messages from its decode worker's shared stream (`DecodeStream`), to its last; a
        StreamError (a grpc.RpcError) when the worker ended it with an error or the stream broke."""
        stream = state.decode.stream
        mine = stream.attach(state.request_id, lease.lease_id)
        try:
            while True:
                left = time_left(context)
                if left is not None and left <= 0:
                    raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded while decoding")
                try:
                    m = mine.get(timeout=min(0.5, left) if left is not None else 0.5)
                except queue.Empty:
                    if not context.is_active():
                        return
                    continue
                if isinstance(m, StreamError):
                    raise m
                yield m
                if m.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    return
        finally:
            stream.detach(state.request_id)

    def _release_decode(self, state: _Active, abort: bool = True) -> None:
        """Gives up the request's lease (a failed prefill or a dead decode worker): the next attempt reserves anew."""
        w, state.decode = state.decode, None
        if w is not None:
            w.inflight_requests -= 1
            if abort:
                self._abort_on([w], state.request_id)

    def _start(self, state: _Active, prompt, params, context):
        """Admit (disaggregated), Reserve, then Prefill. When the prefill worker is unreachable or dies mid-prefill
        (UNAVAILABLE), or the lease expired before the hand-off (ABORTED), the lease is given back (its one-time
        token may already be spent on a half-sent hand-off) and the request starts over with a fresh lease, on
        another prefill worker (colocated: on another decode worker) after an UNAVAILABLE."""
        tried: set[str] = set()
        failures = {grpc.StatusCode.UNAVAILABLE: 0, grpc.StatusCode.ABORTED: 0}
        limits = {grpc.StatusCode.UNAVAILABLE: max(2, len((self.prefill or self.decode).all())),
                  grpc.StatusCode.ABORTED: LEASE_ATTEMPTS}
        state.route = Route(prompt)
        while True:
            admitted = self._admit(prompt, context, tried, state.route) if self.prefill is not None else None
            lease = self._reserve(state, prompt, params, context)
            if state.aborted or state.closed:
                return lease, None
            try:
                return lease, self._prefill(state, prompt, params, lease, context, admitted, tried)
            except grpc.RpcError as e:
                if e.code() not in failures or not context.is_active() or state.aborted:
                    raise
                failures[e.code()] += 1
                if failures[e.code()] == limits[e.code()]:
                    if e.code() == grpc.StatusCode.ABORTED:  # the decode side was too slow to renew: overload
                        self._exhausted(context, f"the request's decode lease expired {LEASE_ATTEMPTS} times before "
                                        "its prefill was handed over; retry later", grpc.StatusCode.UNAVAILABLE)
                    raise
                log.warning("prefill of %s failed (%s); retrying with a new lease", state.request_id, e.details())
                self._release_decode(state)

    def _admit(self, prompt, context, tried: set[str], route: Route) -> Worker:
        """The best prefill worker (not tried yet for this request, while any is left) whose queue has room for the
        prompt; RESOURCE_EXHAUSTED with a retry hint, before any decode capacity is leased, when none has."""
        candidates = self.prefill.candidates(route=route)
        candidates = [w for w in candidates if w.address not in tried] or candidates
        req, full = worker_pb2.AdmitRequest(prompt_tokens=len(prompt)), 0
        for w in candidates:
            try:
                w.stub.Admit(req, timeout=time_left(context, 10.0))
                return w
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    full += 1
                elif e.code() == grpc.StatusCode.UNAVAILABLE:
                    w.healthy = False  # gone: skip it until its next good poll
                else:
                    raise
        if not full:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker")
        self._exhausted(context, f"every prefill worker's queue is full (this prompt has {len(prompt)} tokens); "
                        "retry later")

    def _reserve(self, state: _Active, prompt, params, context):
        """Leases capacity on the best decode worker; while all are full the request waits here (bounded by its
        deadline and the queue timeout), as it would wait in a colocated engine's queue."""
        req = worker_pb2.ReserveRequest(request_id=state.request_id, prompt_token_ids=prompt,
                                        sampling=sampling_to_proto(params))
        give_up, waiting = time.monotonic() + self.queue_timeout, False
        try:
            while True:
                candidates = self.decode.candidates(len(prompt) + 1 + self.k, state.route)  # what the lease holds
                if not candidates:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker")
                for w in candidates:
                    w.inflight_requests += 1  # counted before the call, so concurrent requests see each other
                    try:
                        lease = w.stub.Reserve(req, timeout=time_left(context, 10.0))
                    except grpc.RpcError as e:
                        w.inflight_requests -= 1
                        if e.code() == grpc.StatusCode.UNAVAILABLE:
                            w.healthy = False  # dead or draining: skip it until its next good poll
                            continue
                        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                            continue
                        raise
                    state.decode = w
                    self.decode.placed(w, state.route)
                    return lease
                if time.monotonic() > give_up or state.aborted or not context.is_active():
                    self._exhausted(context, f"every decode worker stayed full for {self.queue_timeout:.0f} s; "
                                    "retry later")
                if not waiting:
                    with self._lock:  # the bounded queue: beyond it a request is refused at once, not parked
                        full = self.max_queued is not None and self._queued >= self.max_queued
                        if not full:
                            self._queued += 1
                    if full:
                        self._exhausted(context, f"the router's queue is full ({self.max_queued} requests wait for "
                                        "decode capacity); retry later")
                    waiting = True
                    if self.metrics is not None:
                        self.metrics.num_requests_waiting.inc()
                time.sleep(0.01 + 0.02 * random.random())
        finally:
            if waiting:
                with self._lock:
                    self._queued -= 1
                if self.metrics is not None:
                    self.metrics.num_requests_waiting.dec()

    def _prefill(self, state: _Active, prompt, params, lease, context, admitted: Worker | None, tried: set[str]):
        """On the prefill worker that admitted the request, or, when its queue filled meanwhile (requests admitted
        together), on the next one with room; colocated, on the decode worker that issued the lease."""
        req = worker_pb2.PrefillRequest(request_id=state.request_id, prompt_token_ids=prompt,
                                        sampling=sampling_to_proto(params), lease=lease)
        if admitted is None:
            w = state.decode  # state.prefill stays None: aborting on the decode worker covers its prefill too
            try:
                first = self._renewing(w.prefill_stub.Prefill, req, state, lease, context)
                self.decode.count(w, state.route)
                return first
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    w.healthy = False  # the decode worker is gone: skip it until its next good poll
                raise
        for w in [admitted, *(c for c in self.prefill.candidates() if c is not admitted and c.address not in tried)]:
            tried.add(w.address)
            state.prefill = w
            w.inflight_requests += 1
            w.inflight_prompt_tokens += len(prompt)
            self.prefill.placed(w, state.route)
            try:
                first = self._renewing(w.stub.Prefill, req, state, lease, context)
                self.prefill.count(w, state.route)
                return first
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the lease is unused still: try the next one
                    continue
                if e.code() == grpc.StatusCode.UNAVAILABLE and "hand-off" not in (e.details() or ""):
                    w.healthy = False  # the prefill worker itself is gone (not its hand-off): skip it until polled
                raise
            finally:
                w.inflight_requests -= 1
                w.inflight_prompt_tokens -= len(prompt)
                state.prefill = None
        self._exhausted(context, f"every prefill worker's queue is full (this prompt has {len(prompt)} tokens); "
                        "retry later")

    @staticmethod
    def _renewing(call, req, state: _Active, lease, context):
        """`call(req)` (a Prefill), renewing the request's decode lease while the call is in flight: the time the
        request waits in a prefill queue cannot outlive the lease, which still expires if this router dies."""
        fut = call.future(req, timeout=time_left(context))
        every = lease.ttl_ms / 3000 if lease.ttl_ms else None  # a third of the lease: two renewals may come late
        renew = worker_pb2.RenewLeaseRequest(request_id=state.request_id, lease_id=lease.lease_id)
        decode = state.decode
        while True:
            try:
                return fut.result(timeout=every)
            except grpc.FutureTimeoutError:
                try:
                    decode.stub.RenewLease(renew, timeout=max(every, 1.0))
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.ABORTED:  # gone already: the hand-off is refused, and retried
                        every = None
                    else:
                        log.warning("renewing the lease of %s on %s failed: %s", state.request_id, decode.address,
                                    e.code())

    # ---- ends -------------------------------------------------------------------------------------------------
    def _end(self, state: _Active) -> None:
        """Runs when the client's RPC ends, however it ends."""
        state.closed = True
        if not state.finished:
            self._abort_on([state.prefill, state.decode], state.request_id)
        state.metrics.finished("abort")  # a client that went away; a no-op when already counted
        with self._lock:
            self._active.pop(state.request_id, None)

    @staticmethod
    def _abort_on(workers: list[Worker | None], request_id: str) -> None:
        req = worker_pb2.WorkerAbortRequest(request_id=request_id)
        for w in workers:
            if w is not None:
                try:
                    w.stub.Abort(req, timeout=5.0)
                except grpc.RpcError as e:
                    log.warning("abort of %s on %s failed: %s", request_id, w.address, e.code())
