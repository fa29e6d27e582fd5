"""The decode worker: leases capacity, receives hand-offs, decodes with MTP speculation and streams tokens.

A request's life here: `Reserve` allocates its prompt's blocks (with its first token and drafts) and a state slot
and returns a lease with a one-time transfer token; once running, the request takes blocks as it grows, and one
the engine must preempt is recomputed here (never failed). The prefill worker then pushes the state to the
transfer listener; the header is checked against the lease (token, request, model fingerprint, tensor shapes)
before any byte is accepted, and the state is installed between two engine steps, so running requests never
stall for a copy. `Decode` attaches to the request's output (tokens made before it attaches wait for it). A
lease that is not used in time, or an installed request nobody attaches to, expires and frees everything, as does
`Abort` or a dropped stream.
While the request waits for its prefill (in a prefill worker's queue, or in this engine's when colocated) the router
keeps its lease alive with `RenewLease`; a lease nobody renews (the router died) still expires. An expired lease
ends its request with ABORTED (LEASE_GONE): not the client's fault, the router retries it with a new lease.

Colocated serving (a router without prefill workers): the decode worker also serves the `PrefillWorker` service's
`Prefill` for the leases it issued. The reserved request then joins this engine's batch and is prefilled here like
any other prompt (no hand-off); `Prefill` answers with its first token, and the tokens after it follow through
`Decode` or `Attach`, exactly as after a hand-off. The lease's expiry bounds the prefill as it bounds a hand-off.

Outputs: after each step the engine thread hands every stream one list of what the step gave its requests (a
`_Sink` per stream: one request for `Decode`, all that the router attached for `Attach`). An `Attach` stream
sends that list as one message: one message a step for the router's requests, instead of one per request from as
many threads, each taking the GIL from the engine thread while it launches the next step.
"""

from __future__ import annotations

import hmac
import logging
import queue
import secrets
import threading
import time
import uuid
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import grpc
import torch

from tandem.cache.handoff import expected_shapes
from tandem.engine.loop import EngineLoop
from tandem.engine.sequence import Sequence, Status
from tandem.rpc import common_pb2, worker_pb2, worker_pb2_grpc
from tandem.rpc.server import on_end, wait_result
from tandem.rpc.convert import (finish_reason_to_proto, load_of, logprobs_to_proto, prompt_logprobs_to_proto,
                                sampling_from_proto)
from tandem.transfer.server import TransferServer
from tandem.transfer.errors import TransferRejected
from tandem.transfer.contract import HandOff
from tandem.transfer.manifest import dtype_name

log = logging.getLogger(__name__)
LEASE_GONE = "the lease expired or was released"  # in a refusal: the request may be retried with a new lease


@dataclass
class Output:
    token_ids: list[int]
    logprobs: list[dict]
    finish_reason: str | None = None
    error: tuple[grpc.StatusCode, str] | None = None
    prompt_logprobs: list = field(default_factory=list)  # colocated first token: the sequence's prompt_logprobs
    num_cached_tokens: int = 0  # colocated first token: its prompt tokens found in the prefix cache


class _Sink:
    """One stream's outputs: lists of (request id, Output), one list a step."""

    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.open: set[str] = set()  # its attached requests not yet finished (guarded by the worker's lock)

    def take(self, context):
        """The next lists, all that are queued, as one; None once the RPC has ended."""
        while True:
            try:
                items = self.queue.get(timeout=0.5)
                break
            except queue.Empty:
                if not context.is_active():
                    return None
        while not self.queue.empty():
            items = items + self.queue.get_nowait()
        return items


@dataclass
class LeaseRecord:
    lease_id: str
    token: bytes
    seq: Sequence
    expires: float  # time.monotonic() deadline for the current stage (hand-off, then attaching)
    # reserved -> transferring (a hand-off) or prefilling (colocated: prefilled here) -> installed
    # (-> finished, when no stream is attached yet)
    stage: str = "reserved"
    attached: bool = False
    emitted: int = 0  # output tokens already handed on (the first went back with the Prefill answer)
    installed_at: float = 0.0
    sink: _Sink | None = None  # the stream it is attached to
    pending: list[Output] = field(default_factory=list)  # outputs made before it was attached
    first: Future | None = None  # colocated: the first token's Output (or the abort/error) for the Prefill RPC
    prefill_started: float = 0.0


class DecodeWorker(worker_pb2_grpc.DecodeWorkerServicer, worker_pb2_grpc.PrefillWorkerServicer):
    """Serves the DecodeWorker service, and the PrefillWorker service's Prefill for its own leases (colocated)."""

    def __init__(self, engine, fingerprint: str, transfer_host: str, transfer_port: int, advertise_host: str,
                 lease_seconds: float = 30.0, metrics=None, ssl_context=None, stream_interval: int = 1):
        self.engine, self.fingerprint, self.lease_seconds, self.metrics = engine, fingerprint, lease_seconds, metrics
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
        self.stream_interval = stream_interval
        self._lock = threading.Lock()
        self._by_request: dict[str, LeaseRecord] = {}
        self._by_lease: dict[str, LeaseRecord] = {}
        self.loop = EngineLoop(engine, self._after_step, self._on_error, periodic=self._expire, metrics=metrics)
        self.transfer = TransferServer(transfer_host, transfer_port, engine.ecfg.device, self._on_header,
                                       self._on_payload, ssl_context=ssl_context)
        self._advertise_host = advertise_host
        self.draining = False
        self._spec_seen = (0, 0, [0] * engine.ecfg.num_speculative_tokens)

    def start(self) -> "DecodeWorker":
        self.transfer.start()
        self.loop.start()
        return self

    def stop(self) -> None:
        self.loop.stop()
        self.transfer.stop()

    def busy(self) -> bool:
        with self._lock:
            return bool(self._by_request)

    @property
    def transfer_address(self) -> str:
        return f"{self._advertise_host}:{self.transfer.address.rsplit(':', 1)[1]}"

    # ---- RPCs -------------------------------------------------------------------------------------------------
    def Reserve(self, request, context):
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this decode worker is draining")
        try:
            params, prompt = sampling_from_proto(request.sampling), list(request.prompt_token_ids)
            matcher = self.engine.grammar_matcher(params, prompt)  # compiled here, off the engine thread
            seq = self.loop.call(lambda e: e.reserve(request.request_id, prompt, params, matcher))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if seq is None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks or state slots for this request now")
        rec = LeaseRecord(uuid.uuid4().hex, secrets.token_bytes(16), seq, time.monotonic() + self.lease_seconds)
        with self._lock:
            self._by_request[seq.request_id] = rec
            self._by_lease[rec.lease_id] = rec
        self._gauge_leases()
        return worker_pb2.Lease(request_id=seq.request_id, lease_id=rec.lease_id, block_ids=seq.block_ids,
                                state_slots=seq.state_slots, transfer_token=rec.token,
                                transfer_address=self.transfer_address,
                                expires_unix_ms=int((time.time() + self.lease_seconds) * 1000),
                                ttl_ms=int(self.lease_seconds * 1000))

    def RenewLease(self, request, context):
        with self._lock:
            rec = self._by_lease.get(request.lease_id)
            if rec is not None and rec.seq.request_id == request.request_id:
                rec.expires = max(rec.expires, time.monotonic() + self.lease_seconds)
                left = rec.expires - time.monotonic()
            else:
                rec = None
        if rec is None:
            context.abort(grpc.StatusCode.ABORTED, f"{LEASE_GONE}: no open lease {request.lease_id!r} for "
                          f"{request.request_id!r}")
        return worker_pb2.RenewLeaseResponse(expires_unix_ms=int((time.time() + left) * 1000))

    def Decode(self, request, context):
        sink = _Sink()
        if self._attach(request, sink) is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no open lease {request.lease_id!r} for {request.request_id!r}")
        on_end(context, lambda: self._abort(request.request_id))  # a no-op once finished
        while (items := sink.take(context)) is not None:
            for _, out in items:
                if out.error is not None:
                    context.abort(*out.error)
                yield self._response(out)
                if out.finish_reason is not None:
                    return

    def Attach(self, request_iterator, context):
        """Many requests' outputs over one stream (the router's, one per decode worker): see the module docstring."""
        sink = _Sink()

        def attach_each():
            try:
                for request in request_iterator:
                    if self._attach(request, sink) is None:
                        sink.queue.put([(request.request_id, Output([], [], None, (
                            grpc.StatusCode.NOT_FOUND,
                            f"no open lease {request.lease_id!r} for {request.request_id!r}")))])
            except grpc.RpcError:  # the stream ended: on_end aborts what it had
                pass

        threading.Thread(target=attach_each, name="attach-requests", daemon=True).start()
        on_end(context, lambda: self._close(sink))
        while (items := sink.take(context)) is not None:
            yield worker_pb2.DecodeBatch(outputs=[self._response(out, request_id) for request_id, out in items])

    @staticmethod
    def _response(out: Output, request_id: str = "") -> worker_pb2.DecodeResponse:
        code, message = out.error if out.error is not None else (None, "")
        return worker_pb2.DecodeResponse(token_ids=out.token_ids, logprobs=[logprobs_to_proto(d) for d in out.logprobs],
                                         finish_reason=finish_reason_to_proto(out.finish_reason),
                                         request_id=request_id, error_code=code.value[0] if code else 0,
                                         error_message=message)

    def Prefill(self, request, context):
        """Colocated: prefills a request this worker leased, here; answers with its first token (no hand-off)."""
        lease = request.lease
        with self._lock:
            rec = self._by_lease.get(lease.lease_id)
            if rec is not None and rec.seq.request_id != (request.request_id or lease.request_id):
                rec = None
            stage = rec.stage if rec is not None else None
            token_ok = rec is not None and hmac.compare_digest(lease.transfer_token, rec.token)
            prompt_ok = rec is not None and (not request.prompt_token_ids
                                             or list(request.prompt_token_ids) == rec.seq.prompt_token_ids)
            if stage == "reserved" and token_ok and prompt_ok:
                rec.stage, rec.first, rec.prefill_started = "prefilling", Future(), time.monotonic()
        if rec is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"no open lease {lease.lease_id!r} for {request.request_id or lease.request_id!r}")
        if not token_ok:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "transfer token does not match the lease")
        if stage != "reserved":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"lease {lease.lease_id!r} was already used (stage {stage})")
        if not prompt_ok:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the prompt differs from the one the lease reserved")
        self._gauge_leases()
        on_end(context, lambda: self._cancel_prefill(rec))  # a cancelled or timed-out RPC frees the request

        def admit(engine):
            if rec.seq.status == Status.RESERVED:  # not aborted or expired meanwhile (its waiter is answered then)
                engine.prefill_reserved(rec.seq)

        # queued behind other calls and steps as long as the lease lives (the router renews it) and the caller waits
        self.loop.submit(admit).add_done_callback(lambda f: self._not_admitted(rec, f))
        out = wait_result(rec.first, context, "the prefill")
        if out.error is not None:
            context.abort(*out.error)
        resp = worker_pb2.PrefillResponse(first_token_id=out.token_ids[0] if out.token_ids else 0,
                                          finish_reason=finish_reason_to_proto(out.finish_reason),
                                          prompt_logprobs=prompt_logprobs_to_proto(out.prompt_logprobs),
                                          num_cached_tokens=out.num_cached_tokens)
        if out.logprobs:
            resp.first_logprobs.CopyFrom(logprobs_to_proto(out.logprobs[0]))
        return resp

    def Abort(self, request, context):
        return worker_pb2.WorkerAbortResponse(found=self._abort(request.request_id))

    def GetLoad(self, request, context):
        return self.load()

    def load(self) -> common_pb2.Load:
        return load_of(self.engine, active_leases=len(self.engine.scheduler.reserved))

    # ---- request ends -----------------------------------------------------------------------------------------
    def _abort(self, request_id: str, error: tuple[grpc.StatusCode, str] | None = None) -> bool:
        with self._lock:
            rec = self._by_request.pop(request_id, None)
            if rec is not None:
                self._by_lease.pop(rec.lease_id, None)
        if rec is None:
            return False
        self.loop.submit(lambda e: e.abort(request_id))
        out = Output([], [], "abort", error)
        self._resolve_first(rec, out)  # a colocated prefill under way answers with the abort (or the error)
        self._deliver([(rec, out)])
        self._gauge_leases()
        return True

    def _attach(self, request, sink: _Sink) -> LeaseRecord | None:
        """Binds the request's outputs to the stream `sink` (those made before come first); None when there is no
        such open lease or it is attached already."""
        with self._lock:
            rec = self._by_request.get(request.request_id)
            if rec is None or rec.lease_id != request.lease_id or rec.attached:
                return None
            rec.attached, rec.sink = True, sink
            pending, rec.pending = rec.pending, []
            if any(out.finish_reason is not None or out.error is not None for out in pending):
                self._unlist(rec)  # it ended before its stream came
            else:
                sink.open.add(rec.seq.request_id)
            if pending:
                sink.queue.put([(rec.seq.request_id, out) for out in pending])
        return rec

    def _deliver(self, outputs: list[tuple[LeaseRecord, Output]]) -> None:
        """Hands outputs to their requests' streams, one list per stream, or keeps them until the request is
        attached. A request's last output forgets it."""
        by_sink: dict[int, tuple[_Sink, list]] = {}
        with self._lock:  # as _attach: a request's outputs stay in order across its attaching
            for rec, out in outputs:
                if rec.sink is None:
                    rec.pending.append(out)
                    continue
                by_sink.setdefault(id(rec.sink), (rec.sink, []))[1].append((rec.seq.request_id, out))
                if out.finish_reason is not None or out.error is not None:
                    rec.sink.open.discard(rec.seq.request_id)
                    self._unlist(rec)
            for sink, items in by_sink.values():
                sink.queue.put(items)

    def _close(self, sink: _Sink) -> None:
        """An Attach stream ended: its unfinished requests have nobody to go to."""
        with self._lock:
            orphans, sink.open = list(sink.open), set()
        for request_id in orphans:
            self._abort(request_id)

    @staticmethod
    def _resolve_first(rec: LeaseRecord, out: Output) -> None:
        if rec.first is not None:
            try:
                rec.first.set_result(out)
            except InvalidStateError:  # answered already (the first token, or an abort that came first)
                pass

    def _not_admitted(self, rec: LeaseRecord, admitted: Future) -> None:
        """Colocated: the engine could not take the request (only a stopped loop fails the call)."""
        if admitted.exception() is not None:
            self._abort(rec.seq.request_id, (grpc.StatusCode.UNAVAILABLE,
                                             f"this decode worker is stopping: {admitted.exception()}"))

    def _cancel_prefill(self, rec: LeaseRecord) -> None:
        """The Prefill RPC ended: if the request is still prefilling, nobody will get its first token."""
        with self._lock:
            pending = rec.stage == "prefilling" and self._by_lease.get(rec.lease_id) is rec
        if pending:
            self._abort(rec.seq.request_id)

    def _forget(self, rec: LeaseRecord) -> None:
        with self._lock:
            self._unlist(rec)

    def _unlist(self, rec: LeaseRecord) -> None:
        """With the lock held: the request is done here. Only this record goes: a later one of the same request id
        (a retry after an abort) stays."""
        if self._by_request.get(rec.seq.request_id) is rec:
            del self._by_request[rec.seq.request_id]
        self._by_lease.pop(rec.lease_id, None)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            # an attached stream ends an installed request itself (client gone: the RPC is cancelled)
            late = [r for r in self._by_request.values()
                    if r.expires < now and not (r.attached and r.stage in ("installed", "finished"))]
        for rec in late:
            log.warning("lease %s of %s expired at stage %s", rec.lease_id, rec.seq.request_id, rec.stage)
            if self.metrics is not None:
                self.metrics.lease_expiries_total.inc()
            self._abort(rec.seq.request_id, (grpc.StatusCode.ABORTED, f"{LEASE_GONE}: the decode lease was not "
                                             f"renewed within {self.lease_seconds:g} s"))

    def _gauge_leases(self) -> None:
        if self.metrics is not None:
            with self._lock:
                self.metrics.leases_active.set(sum(r.stage != "installed" for r in self._by_request.values()))

    # ---- engine thread ----------------------------------------------------------------------------------------
    def _after_step(self, active: list[Sequence], finished: list[Sequence]) -> None:
        outputs = []
        for seq in active:
            with self._lock:
                rec = self._by_request.get(seq.request_id)
            if rec is None:
                continue
            if rec.stage == "prefilling":
                if not seq.output_token_ids:  # a chunk of a long prompt: no token yet
                    continue
                self._prefilled(rec, seq)
                if seq.status == Status.FINISHED:
                    continue
            new = seq.output_token_ids[rec.emitted:]
            done = seq.finish_reason if seq.status == Status.FINISHED else None
            if len(new) < self.stream_interval and not done:
                continue  # held back until the stream interval's worth has come (or the request ends)
            lps = seq.output_logprobs[rec.emitted:] if seq.params.logprobs is not None else []
            rec.emitted = len(seq.output_token_ids)
            if self.metrics is not None:
                self.metrics.generation_tokens_total.inc(len(new))
                if done:
                    self.metrics.request_decode_time_seconds.observe(time.monotonic() - rec.installed_at)
            if new or done:
                outputs.append((rec, Output(new, lps, done)))
            if done:
                with self._lock:
                    if not rec.attached:  # the output waits for its stream until the lease expires
                        rec.stage, rec.expires = "finished", time.monotonic() + self.lease_seconds
                        continue
                self._forget(rec)
        if outputs:
            self.loop.defer(self._deliver, outputs)
        if self.metrics is not None:
            self._record_speculation()

    def _prefilled(self, rec: LeaseRecord, seq: Sequence) -> None:
        """Colocated: the request prefilled here has its first token; it goes back with the Prefill answer."""
        now = time.monotonic()
        done = seq.finish_reason if seq.status == Status.FINISHED else None
        lps = seq.output_logprobs[:1] if seq.params.logprobs is not None else []
        with self._lock:
            rec.stage, rec.emitted, rec.installed_at = "installed", 1, now
            rec.expires = now + self.lease_seconds  # now the router has this long to attach
        if done:  # the first token ended it (its blocks are free): the router opens no stream
            self._forget(rec)
        self._gauge_leases()
        if self.metrics is not None:
            self.metrics.prompt_tokens_total.inc(len(seq.prompt_token_ids))
            self.metrics.request_prefill_time_seconds.observe(now - rec.prefill_started)
            self.metrics.generation_tokens_total.inc(1)
        self.loop.defer(self._resolve_first, rec,
                        Output(seq.output_token_ids[:1], lps, done, prompt_logprobs=seq.prompt_logprobs,
                               num_cached_tokens=seq.num_cached_tokens or 0))

    def _record_speculation(self) -> None:
        """Adds what the engine's cumulative speculation counters gained in this step."""
        st, last = self.engine.spec_stats, self._spec_seen
        now = (st.num_drafts, st.num_draft_tokens, list(st.accepted_per_position))
        if now[0] != last[0]:
            self.metrics.record_spec_decode(now[0] - last[0], now[1] - last[1],
                                            [a - b for a, b in zip(now[2], last[2])])
            self._spec_seen = now

    def _on_error(self, exc: Exception, active: list[Sequence]) -> None:
        for seq in active:
            self._abort(seq.request_id, (grpc.StatusCode.INTERNAL, f"decode step failed: {exc}"))

    # ---- transfer listener threads ----------------------------------------------------------------------------
    def _on_header(self, manifest) -> None:
        with self._lock:
            rec = self._by_lease.get(manifest.lease_id)
            if rec is None:
                raise TransferRejected(f"{LEASE_GONE}: unknown lease {manifest.lease_id!r}")
            if not hmac.compare_digest(bytes.fromhex(manifest.transfer_token), rec.token):
                raise TransferRejected("transfer token does not match the lease")
            if rec.stage != "reserved":
                raise TransferRejected("the lease's transfer token was already used")
            rec.stage = "transferring"
        if manifest.request_id != rec.seq.request_id:
            raise TransferRejected(f"lease belongs to {rec.seq.request_id!r}, not {manifest.request_id!r}")
        if manifest.fingerprint != self.fingerprint:
            raise TransferRejected("model fingerprint differs between the prefill and the decode worker")
        want = expected_shapes(self.engine.cfg, self.engine.pools, len(rec.seq.prompt_token_ids),
                               self.engine.ecfg.block_size)
        got = {s.name: (s.dtype, list(s.shape)) for s in manifest.specs}
        want = {name: (dtype_name(dt), shape) for name, (dt, shape) in want.items()}
        if got != want:
            raise TransferRejected(f"hand-off tensors do not match this worker's cache layout "
                                   f"(got {sorted(got)[:4]}..., want {sorted(want)[:4]}...)")

    def _on_payload(self, manifest, flat: torch.Tensor) -> None:
        with self._lock:
            rec = self._by_lease.get(manifest.lease_id)
        if rec is None:
            raise TransferRejected(f"{LEASE_GONE} during the hand-off")
        h = HandOff.from_wire(manifest, flat)

        def install(engine):
            if rec.seq.status != Status.RESERVED:  # aborted meanwhile
                raise TransferRejected(f"{LEASE_GONE} during the hand-off")
            if rec.seq.matcher is not None and not rec.seq.matcher.validate_tokens([h.first_token]):
                raise TransferRejected("the prefill worker's first token does not follow the request's grammar")
            engine.install_prefilled(rec.seq, h.first_token, h.first_logprobs, h.drafts, h.tensors, h.rng_state)
            rec.stage, rec.emitted, rec.installed_at = "installed", 1, time.monotonic()
            rec.expires = time.monotonic() + self.lease_seconds  # now the router has this long to attach

        self.loop.call(install)
        self._gauge_leases()
        if self.metrics is not None:
            self.metrics.handoff_bytes_total.inc(manifest.total_bytes)
