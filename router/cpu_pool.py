"""A bounded thread pool for the HTTP endpoint's CPU-heavy work (JSON parsing, chat templating, tokenization,
detokenization of long token lists), so that the event loop keeps answering /health and streaming other clients'
tokens while a multi-megabyte body is processed.

The tokenizers release the GIL while they encode, so a thread is enough (no process pool, no copies). At most
`max_pending` jobs run or wait; a request beyond that is refused at once with 429 and `Retry-After`, as the router
refuses requests when its own queue is full: waiting requests hold their bodies in memory (up to
--max-request-bytes each), so the wait is bounded in count, and each job is bounded in size, so in time too.

    pool = CpuPool(threads=4, max_pending=64)
    ids = await pool.run(tok.encode, text)
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

from router.http_errors import ApiError

DEFAULT_THREADS = min(4, os.cpu_count() or 1)
DEFAULT_MAX_PENDING = 64


class CpuPool:
    """Used from one event loop (the pending count is that loop's alone)."""

    def __init__(self, threads: int = DEFAULT_THREADS, max_pending: int = DEFAULT_MAX_PENDING):
        self.max_pending = max_pending
        self.pending = 0
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="tandem-http-cpu")

    async def run(self, fn, *args):
        if self.pending >= self.max_pending:
            raise ApiError(429, f"the server is busy: {self.pending} requests are being parsed or tokenized; "
                           "retry later", "rate_limit_error", code="too_many_pending_requests", retry_after=1.0)
        loop = asyncio.get_running_loop()
        job = self._executor.submit(fn, *args)
        self.pending += 1
        # counted until the job ends, not until its awaiter stops waiting: a cancelled client's job may still run
        job.add_done_callback(lambda _: self._done(loop))
        return await asyncio.wrap_future(job)

    def _done(self, loop) -> None:
        try:
            loop.call_soon_threadsafe(self._release)
        except RuntimeError:  # the loop is closed: the server stopped
            pass

    def _release(self) -> None:
        self.pending -= 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
