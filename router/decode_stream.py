"""The router's one `Attach` stream to a decode worker, shared by every request the router decodes there.

The worker sends one message per engine step with every attached request's new tokens; a reader thread hands each
request its part. One stream instead of one per request: the worker's threads then send one message a step, not
one per running request, and take the GIL from its engine thread that much less. The stream opens on first use and
again after it breaks; a break ends every request attached through it with the stream's error (UNAVAILABLE when
the worker went away), as a broken per-request stream would.
"""

from __future__ import annotations

import queue
import threading

import grpc

from tandem.rpc import worker_pb2

_STATUS = {code.value[0]: code for code in grpc.StatusCode}


class StreamError(grpc.RpcError):
    """A request's decode ended with a status (the worker's, or the shared stream's when it broke)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class DecodeStream:
    def __init__(self, stub):
        self._stub = stub
        self._lock = threading.Lock()
        self._sending: queue.SimpleQueue | None = None  # the open stream's DecodeRequests to send (None: closed)
        self._requests: dict[str, tuple[queue.SimpleQueue, queue.SimpleQueue]] = {}  # id -> (its stream, its queue)

    def attach(self, request_id: str, lease_id: str) -> queue.SimpleQueue:
        """The request's queue: its DecodeResponse messages, or a StreamError."""
        mine: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            if self._sending is None:
                self._open()
            self._requests[request_id] = (self._sending, mine)
            self._sending.put(worker_pb2.DecodeRequest(request_id=request_id, lease_id=lease_id))
        return mine

    def detach(self, request_id: str) -> None:
        with self._lock:
            self._requests.pop(request_id, None)

    def _open(self) -> None:
        sending: queue.SimpleQueue = queue.SimpleQueue()
        call = self._stub.Attach(iter(sending.get, None))
        self._sending = sending
        threading.Thread(target=self._read, args=(call, sending), name="decode-stream", daemon=True).start()

    def _read(self, call, sending: queue.SimpleQueue) -> None:
        error = StreamError(grpc.StatusCode.UNAVAILABLE, "the decode worker ended its stream")
        try:
            for batch in call:
                with self._lock:
                    for out in batch.outputs:
                        entry = self._requests.get(out.request_id)
                        if entry is not None and entry[0] is sending:
                            entry[1].put(out if not out.error_code else
                                         StreamError(_STATUS.get(out.error_code, grpc.StatusCode.UNKNOWN),
                                                     out.error_message))
        except grpc.RpcError as e:
            error = StreamError(e.code(), e.details() or str(e.code()))
        with self._lock:
            if self._sending is sending:
                self._sending = None
            orphans = [mine for stream, mine in self._requests.values() if stream is sending]
        sending.put(None)  # ends the request iterator, so gRPC's thread sending it stops
        for mine in orphans:
            mine.put(error)
