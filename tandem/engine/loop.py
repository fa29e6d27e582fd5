"""Runs an Engine on one thread: the engine is not thread-safe, so RPC threads hand it work as functions.

Between steps the loop runs queued calls, then `periodic()` (lease expiry and such), then one `engine.step()`,
then `after_step(active, finished)` where `active` are the requests that were running during the step. A
failing step is reported through `on_error(exc, active)` so that the requests in it end with an error instead
of hanging, and the loop goes on. With `metrics`, each step's duration goes to `engine_step_seconds` by its kind
(`Engine.last_step`), and its prompt tokens to `engine_step_prompt_tokens_total`: summed over a run, how busy
the engine was, and what a prompt token cost in mixed and prefill steps. The engine's gauges (requests, cache use)
are read after every step and after every batch of calls, so an abort that empties the engine shows at once.

`defer(fn, *args)` (from `after_step`) holds back what wakes other threads -- handing a step's tokens to the
streams that send them -- until the next step has put its whole forward on the device (`Engine.on_launch`), or
until the loop runs a call, goes idle or stops. The woken RPC threads then take the GIL while the device computes,
not while the engine thread prepares or launches the next step, when the device waits for the host (served decode
steps at batch 32 on the H200 were ~2 ms slower than in `benchmarks/step.py` with 32 stream threads woken at each
one's start; served mixed steps, whose forward launch is host-bound, ~9 ms slower with them woken after its first
piecewise graph).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future

import torch

from tandem.metrics import observe_engine

log = logging.getLogger(__name__)
SLOW_STEP_SECONDS = 1.0  # a step this long is logged: the running requests all stalled for it


class EngineLoop:
    def __init__(self, engine, after_step, on_error, periodic=None, idle_wait: float = 0.02, metrics=None):
        self.engine, self.metrics = engine, metrics
        self._after_step, self._on_error, self._periodic = after_step, on_error, periodic
        self._idle_wait = idle_wait
        self._calls: deque[tuple[Future, callable]] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self.fatal_error: Exception | None = None  # set when a step failed in a way the engine cannot survive
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._deferred: list[tuple[callable, tuple]] = []  # engine thread only
        engine.on_launch = self._flush

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout)

    def submit(self, fn) -> Future:
        """Runs `fn(engine)` on the loop thread; the future holds its result or its exception."""
        fut: Future = Future()
        with self._cond:
            if self._stopped:
                fut.set_exception(RuntimeError("the engine is stopped"))
                return fut
            self._calls.append((fut, fn))
            self._cond.notify()
        return fut

    def call(self, fn, timeout: float | None = 30.0):
        return self.submit(fn).result(timeout)

    def defer(self, fn, *args) -> None:
        """On the loop thread: runs fn(*args) once the next step is on the device (see the module docstring)."""
        self._deferred.append((fn, args))

    def _flush(self) -> None:
        items, self._deferred = self._deferred, []
        for fn, args in items:
            fn(*args)

    def _observe(self) -> None:
        if self.metrics is not None:
            observe_engine(self.metrics, self.engine)

    def _run_calls(self) -> None:
        ran = False
        while True:
            with self._cond:
                if not self._calls:
                    break
                fut, fn = self._calls.popleft()
            ran = True
            self._flush()  # a call (an abort, say) acts after the outputs that came before it
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:  # handed back to the caller
                fut.set_exception(e)
        if ran:  # a call may have added, reserved or aborted requests
            self._observe()

    def _run(self) -> None:
        _name_os_thread(self._thread.name)
        device = torch.device(getattr(getattr(self.engine, "ecfg", None), "device", "cpu"))
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # per thread: kernels and collectives of a worker on cuda:i run there
        while True:
            with self._cond:
                if self._stopped:
                    break
            self._run_calls()
            if self._periodic is not None:
                self._periodic()
            if not self.engine.has_work():
                self._flush()
                with self._cond:
                    if not self._calls and not self._stopped:
                        self._cond.wait(self._idle_wait)
                continue
            # with the preempted requests, which may come back and finish within this step
            sched = self.engine.scheduler
            active = list(sched.running) + [s for s in sched.waiting if s.num_preemptions]
            try:
                t0 = time.perf_counter()
                try:
                    finished = self.engine.step()
                finally:
                    self._flush()  # the earlier step's outputs, if this one launched nothing (or failed first)
                seconds, shape = time.perf_counter() - t0, self.engine.last_step
                if self.metrics is not None and shape is not None:
                    self.metrics.engine_step_seconds(shape.kind).observe(seconds)
                    self.metrics.engine_step_prompt_tokens_total(shape.kind).inc(shape.prompt_tokens)
                # every running request waited this long; on a CPU every step is slow, so it says nothing there
                if seconds > SLOW_STEP_SECONDS and shape is not None and device.type == "cuda":
                    log.warning("slow engine step: %.2f s (%d decode requests, %d prompt tokens); a kernel "
                                "compiling while serving, or an oversized step budget", seconds, shape.decodes,
                                shape.prompt_tokens)
            except Exception as e:
                log.exception("engine step failed")
                self._on_error(e, active)
                if getattr(e, "fatal", False):  # e.g. a lost tensor-parallel rank: stop serving, let it restart
                    self.fatal_error = e
                    with self._cond:
                        self._stopped = True
                    log.critical("the engine cannot continue (%s); shutting this worker down", e)
                    os.kill(os.getpid(), signal.SIGTERM)  # the worker's main thread drains and exits non-zero
                    break
                continue
            self._after_step(active, finished)
            self._observe()
        self._flush()
        # fail what is still queued so no caller waits forever
        with self._cond:
            calls, self._calls = list(self._calls), deque()
        for fut, _ in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("the engine is stopped"))


def _name_os_thread(name: str) -> None:
    """Gives the calling thread its name in the OS too (Linux; `top -H`, /proc/PID/task/TID/comm), so per-thread
    CPU figures (`benchmarks/cpu_use.py`) show which thread is the engine's. Python names its threads only for
    itself."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME, 15 bytes at most
