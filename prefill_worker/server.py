"""The prefill worker: batches concurrent prompts (chunked, under the token budget), samples the first token,
runs the MTP layer over the prompt for the first drafts, pushes the state to the decode worker named in the
lease and answers with the first token.

The engine thread only computes: a finished prefill's state is copied out and its blocks freed at once, and the
RPC thread that asked for it packs and sends it, so transfers overlap the next prefills.

The queue (prompts received and not yet prefilled, counted in tokens) is bounded by `max_queued_prompt_tokens`: a
prompt that does not fit is refused at once with RESOURCE_EXHAUSTED, before any work (a prompt alone in an empty
queue always fits, so none is unservable). A request's cancellation or deadline reaches it wherever it waits: its
abort hook is in place before it is handed to the engine, and one that ended before its turn is never added.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import grpc

from decode_worker.server import LEASE_GONE
from tandem.engine.engine import PrefilledRequest
from tandem.engine.loop import EngineLoop
from tandem.rpc import common_pb2, worker_pb2, worker_pb2_grpc
from tandem.rpc.server import on_end, time_left, wait_result
from tandem.rpc.convert import (finish_reason_to_proto, load_of, logprobs_to_proto, prompt_logprobs_to_proto,
                                sampling_from_proto)
from tandem.transfer.client import TransferClient
from tandem.transfer.errors import TransferError, TransferRejected
from tandem.transfer.contract import HandOff

log = logging.getLogger(__name__)

# test hooks, off unless asked for on the command line. stall-handoff: the header is accepted, then no payload
# comes until the hand-off's time is up (a hung link), so the lease on the decode worker expires
FAULTS = ("corrupt-handoff", "stall-handoff")
# Queued prompt tokens beyond which a prefill worker refuses new prompts: about 30 s of prefill, within the router's
# 60 s queue timeout. tandem-tiny prefills ~600 tokens/s on a 2-core CPU; the 35B-A3B ~65k tokens/s on an H200.
DEFAULT_MAX_QUEUED_PROMPT_TOKENS = {"cpu": 16384, "cuda": 2 << 20}


class PrefillWorker(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, engine, fingerprint: str, transfer_backend: str, inject_fault: str | None = None,
                 metrics=None, ssl_context=None,
                 max_queued_prompt_tokens: int = DEFAULT_MAX_QUEUED_PROMPT_TOKENS["cpu"]):
        if max_queued_prompt_tokens < 1:
            raise ValueError(f"max_queued_prompt_tokens must be at least 1, got {max_queued_prompt_tokens}")
        self.engine, self.fingerprint, self.metrics = engine, fingerprint, metrics
        self.max_queued_prompt_tokens = max_queued_prompt_tokens
        self.transfer_backend = transfer_backend
        self.client = TransferClient(transfer_backend, engine.ecfg.device, ssl_context)
        self.inject_fault = inject_fault
        self._lock = threading.Lock()
        self._pending: dict[str, Future] = {}
        self._room: dict[str, int] = {}  # the prompt tokens each pending request counts in the queue
        self._queued_tokens = 0
        self.loop = EngineLoop(engine, self._after_step, self._on_error, metrics=metrics)
        self.draining = False

    def start(self) -> "PrefillWorker":
        self.loop.start()
        return self

    def stop(self) -> None:
        self.loop.stop()
        self.client.close()

    def busy(self) -> bool:
        with self._lock:
            return bool(self._pending)

    # ---- RPCs -------------------------------------------------------------------------------------------------
    def Prefill(self, request, context):
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this prefill worker is draining")
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        try:
            params = sampling_from_proto(request.sampling)
            matcher = self.engine.grammar_matcher(params, prompt)  # compiled here, off the engine thread
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        done: Future = Future()
        with self._lock:
            if rid in self._pending:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already being prefilled")
            fits = self._fits(len(prompt))
            if fits:
                self._pending[rid], self._room[rid] = done, len(prompt)
                self._queued_tokens += len(prompt)
        if not fits:
            self._refuse(context, len(prompt))
        try:
            on_end(context, lambda: self._abort(rid))  # a cancelled or timed-out RPC frees the request

            def add(engine):
                if done.done():  # cancelled or past its deadline while it waited for this turn: never computed
                    return
                try:
                    engine.add_request(rid, prompt, params, matcher)
                except ValueError as e:
                    done.set_result(e)

            self.loop.submit(add).add_done_callback(lambda f: self._unqueued(rid, f))
            result = wait_result(done, context, "the prefill")
        finally:
            with self._lock:
                self._pending.pop(rid, None)
                self._release_room(rid)
        if isinstance(result, ValueError):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(result))
        if isinstance(result, Exception):
            context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {result}")
        if not isinstance(result, PrefilledRequest):  # the first token ended it, or it was aborted: no hand-off
            return self._response(result, result.finish_reason)
        return self._hand_off(result, request.lease, context)

    def Admit(self, request, context):
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this prefill worker is draining")
        with self._lock:
            fits, queued = self._fits(request.prompt_tokens), self._queued_tokens
        if not fits:
            self._refuse(context, request.prompt_tokens)
        return worker_pb2.AdmitResponse(queued_prompt_tokens=queued,
                                        max_queued_prompt_tokens=self.max_queued_prompt_tokens)

    def Abort(self, request, context):
        return worker_pb2.WorkerAbortResponse(found=self._abort(request.request_id))

    def GetLoad(self, request, context):
        return self.load()

    def load(self) -> common_pb2.Load:
        return load_of(self.engine, queued_prompt_tokens=self._queued_tokens)

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _fits(self, prompt_tokens: int) -> bool:
        """With the lock held: whether the queue takes a prompt this long now."""
        return not self._queued_tokens or self._queued_tokens + prompt_tokens <= self.max_queued_prompt_tokens

    def _release_room(self, rid: str) -> None:
        """With the lock held: the request no longer counts in the queue (a no-op the second time)."""
        self._queued_tokens -= self._room.pop(rid, 0)

    def _refuse(self, context, prompt_tokens: int) -> None:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"the prefill queue is full ({self._queued_tokens} of {self.max_queued_prompt_tokens} prompt "
                      f"tokens queued; this prompt has {prompt_tokens}); retry later")

    def _abort(self, rid: str) -> bool:
        with self._lock:
            found = rid in self._pending
            self._release_room(rid)  # at once: the next prompt need not wait for this waiter to wake up
        if found:
            self.loop.submit(lambda e: e.abort(rid))
            # an aborted request never reaches _after_step: answer its waiter here
            self.loop.submit(lambda e: self._resolve(rid, _Aborted(rid)))
        return found

    def _unqueued(self, rid: str, added: Future) -> None:
        """The engine could not take the request (only a stopped loop fails the call): its waiter gets the error."""
        if added.exception() is not None:
            self._resolve(rid, RuntimeError(str(added.exception())))

    def _resolve(self, rid: str, result) -> None:
        with self._lock:
            fut = self._pending.get(rid)
        if fut is not None and not fut.done():
            fut.set_result(result)

    def _response(self, seq, finish_reason, nbytes: int = 0, seconds: float = 0.0):
        resp = worker_pb2.PrefillResponse(first_token_id=seq.output_token_ids[0] if seq.output_token_ids else 0,
                                          handoff_bytes=nbytes, handoff_seconds=seconds,
                                          finish_reason=finish_reason_to_proto(finish_reason),
                                          prompt_logprobs=prompt_logprobs_to_proto(seq.prompt_logprobs),
                                          num_cached_tokens=seq.num_cached_tokens or 0)
        if seq.output_logprobs:
            resp.first_logprobs.CopyFrom(logprobs_to_proto(seq.output_logprobs[0]))
        return resp

    def _hand_off(self, h: PrefilledRequest, lease, context):
        seq = h.seq
        handoff = HandOff(seq.output_token_ids[0], seq.drafts, dict(h.state),
                          seq.output_logprobs[0] if seq.output_logprobs else None, h.rng_state)
        manifest, flat = handoff.to_wire(seq.request_id, lease.lease_id, lease.transfer_token, self.fingerprint)
        if self.inject_fault == "corrupt-handoff":
            flat[flat.numel() // 2] ^= 0xFF
        # the router renews the lease while this call lasts: a send still stalled after a lease's length gives up
        timeout = time_left(context, max(1.0, min(60.0, lease.ttl_ms / 1000 + 1.0)) if lease.ttl_ms else 60.0)
        stall = _stall(timeout, context) if self.inject_fault == "stall-handoff" else None
        try:
            nbytes, seconds = self.client.send(lease.transfer_address, manifest, flat, timeout=timeout,
                                               before_payload=stall)
        except TransferRejected as e:
            self._count_failure("rejected")
            if LEASE_GONE in str(e):  # not this request's fault: the router retries it with a new lease
                context.abort(grpc.StatusCode.ABORTED, f"hand-off refused by the decode worker: {e}")
            code = grpc.StatusCode.DATA_LOSS if "checksum" in str(e) else grpc.StatusCode.FAILED_PRECONDITION
            context.abort(code, f"hand-off refused by the decode worker: {e}")
        except TransferError as e:
            self._count_failure("transport")
            context.abort(grpc.StatusCode.UNAVAILABLE, f"hand-off to {lease.transfer_address} failed: {e}")
        if self.metrics is not None:
            self.metrics.handoff_done(nbytes, seconds)
        return self._response(seq, None, nbytes, seconds)

    def _count_failure(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.handoff_failed(reason)

    # ---- engine thread ----------------------------------------------------------------------------------------
    def _after_step(self, active, finished) -> None:
        done = list(finished)
        for seq in finished:
            self._resolve(seq.request_id, seq)
        for h in self.engine.take_prefilled():
            self._resolve(h.seq.request_id, h)
            done.append(h.seq)
        if self.metrics is not None:
            now = time.monotonic()
            for seq in done:
                self.metrics.prompt_tokens_total.inc(len(seq.prompt_token_ids))
                self.metrics.request_queue_time_seconds.observe(seq.scheduled_time - seq.arrival_time)
                self.metrics.request_prefill_time_seconds.observe(now - seq.scheduled_time)

    def _on_error(self, exc: Exception, active) -> None:
        with self._lock:
            rids = list(self._pending)
        for rid in rids:
            self.engine.abort(rid)
            self._resolve(rid, RuntimeError(str(exc)))


def _stall(timeout: float, context):
    """The stall-handoff fault: after the header, no payload until the send's time is up (or the caller left)."""
    def hang():
        end = time.monotonic() + timeout
        while time.monotonic() < end and context.is_active():
            time.sleep(0.05)
        raise TransferError("stalled hand-off timed out (injected fault)")
    return hang


class _Aborted:
    """Stands for an aborted request's sequence: no token, finish reason abort."""

    def __init__(self, rid: str):
        self.request_id, self.output_token_ids, self.output_logprobs, self.finish_reason = rid, [], [], "abort"
        self.prompt_logprobs = []
