"""Continuous batching with chunked prefill, blocks allocated as requests grow, and preemption.

Each step: every running request past its prompt decodes (one token, or its last token plus its k MTP drafts to
verify; decode rows first), then prompt chunks fill the rest of the token budget, oldest first, then waiting
requests are admitted. A request is admitted when `max_num_seqs` allows, a GDN state slot is free and the blocks
of its first chunk are, with a watermark of free blocks left over (so the running requests have room to grow
before anyone is preempted). Nothing is reserved for `max_tokens`: each step allocates the blocks its rows write
(the verify rows, and the MTP head's k rows past them). When a request cannot get them, the newest running request
not yet scheduled in this step is preempted: its blocks and slot are freed and it goes back to the front of the
waiting queue, to recompute its prompt and the tokens it generated as one prompt (`Sequence.preempted`); it then
continues exactly where it stopped. No request is admitted in a step that preempted one.

Prefix caching (`tandem/cache/prefix.py`): an admitted request first takes the cached blocks of the longest chain
of its prompt that ends in a GDN state snapshot, and the snapshot's state into its slot, then computes the rest;
its prompt chunks end at its snapshot points, and after each step its completed blocks join the cache.

Disaggregated roles: a prefill-only scheduler's requests leave once their first token is sampled; a decode worker
`reserve`s a request's prompt blocks (+ the first token and k drafts) and a slot up front (a lease), and
`admit_prefilled` puts it straight into the running batch once its state has been copied in; it grows from there.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from tandem.cache.pools import CachePools
from tandem.cache.prefix import PrefixCache
from tandem.config import EngineConfig
from tandem.engine.sequence import Sequence, Status
from tandem.profiling import traced

WATERMARK = 0.01  # share of the KV blocks admission leaves free (at least one block), as vLLM's block manager


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens of this sequence processed in this step, starting at seq.num_computed


class Scheduler:
    def __init__(self, ecfg: EngineConfig, pools: CachePools, prefill_only: bool = False,
                 prefix: PrefixCache | None = None):
        self.ecfg = ecfg
        self.pools = pools
        self.prefill_only = prefill_only
        self.prefix = prefix
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved: list[Sequence] = []
        self.num_preemptions = 0
        self.watermark = max(1, int(WATERMARK * pools.blocks.capacity))

    def add(self, seq: Sequence) -> None:
        self._validate(seq)
        self.waiting.append(seq)

    def _validate(self, seq: Sequence) -> None:
        prompt, spec = len(seq.prompt_token_ids), self.ecfg.num_speculative_tokens
        if prompt == 0:
            raise ValueError("prompt must contain at least one token")
        if prompt + seq.params.max_tokens + spec > self.ecfg.max_model_len:
            raise ValueError(
                f"prompt ({prompt} tokens) + max_tokens ({seq.params.max_tokens}) exceeds "
                f"max_model_len ({self.ecfg.max_model_len})")
        # every request that passes holds the pool alone (`EngineConfig.check_blocks`), so it can always finish

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _max_tokens(self, seq: Sequence) -> int:
        """The most positions a request ever writes: a verify step writes KV up to k positions past its last
        accepted token; a prefill-only worker's request writes its prompt, the first token's MTP row and k-1
        recursive MTP rows."""
        k = self.ecfg.num_speculative_tokens
        return len(seq.prompt_token_ids) + (1 + k if self.prefill_only else seq.params.max_tokens + k)

    def _blocks(self, seq: Sequence, tokens: int) -> int:
        return -(-min(tokens, self._max_tokens(seq)) // self.ecfg.block_size)

    def _missing_blocks(self, seq: Sequence, rows: int) -> int:
        """Blocks `seq` lacks for a step of `rows` rows from num_computed: the rows, and the k rows the MTP head
        may write past them (the recursive drafts)."""
        return self._blocks(seq, seq.num_computed + rows + self.ecfg.num_speculative_tokens) - len(seq.block_ids)

    def _grow(self, seq: Sequence, rows: int) -> bool:
        need = self._missing_blocks(seq, rows)
        if need > 0:
            if not self.pools.blocks.can_allocate(need):
                return False
            seq.block_ids += self.pools.blocks.allocate(need)
        return True

    def _allocate(self, seq: Sequence, rows: int, shared: list[int] = ()) -> bool:
        """Blocks for `rows` rows and a state slot for a request that holds none, leaving the watermark free
        (unless the pool is idle: a request that needs every block must still start); `shared`: cached blocks it
        starts from (num_computed already past them)."""
        watermark = self.watermark if self.running or self.reserved else 0
        need = self._missing_blocks(seq, rows) - len(shared) + self.pools.blocks.num_unused(shared)
        if not self._seat_free() or not self.pools.blocks.can_allocate(need + watermark):
            return False
        self.pools.blocks.share(shared)
        seq.block_ids = list(shared)
        self._grow(seq, rows)
        seq.state_slots = self.pools.allocate_slots(1)
        if seq.scheduled_time is None:
            seq.scheduled_time = time.monotonic()
        return True

    def _seat_free(self) -> bool:
        """Room for one more request: below max_num_seqs, and a state slot free."""
        return len(self.running) + len(self.reserved) < self.ecfg.max_num_seqs and self.pools.slots.can_allocate(1)

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Allocates a waiting request's first chunk (from its prefix-cache hit); its rows, 0 when it must wait."""
        if not self._seat_free():  # before matching its prompt, which a full batch would redo every step
            return 0
        if self.prefix is None:
            rows = min(budget, seq.prefill_len)
            return rows if self._allocate(seq, rows) else 0
        hit = self.prefix.match(seq)
        points = self.prefix.plan(seq, hit)
        start = len(hit.blocks) * self.ecfg.block_size
        rows = min(budget, (points[0] if points else seq.prefill_len) - start)
        seq.num_computed = start
        if not self._allocate(seq, rows, hit.blocks):
            seq.num_computed = 0
            return 0
        self.prefix.start(seq, hit, points)
        return rows

    def _chunk_end(self, seq: Sequence) -> int:
        return self.prefix.next_point(seq) if self.prefix is not None else seq.prefill_len

    def reserve(self, seq: Sequence) -> bool:
        """Holds the prompt's blocks (with room for the first token and its drafts) and a slot for a request
        prefilled elsewhere; False when they are not free now."""
        self._validate(seq)
        if not self._allocate(seq, len(seq.prompt_token_ids) + 1):
            return False
        seq.status = Status.RESERVED
        self.reserved.append(seq)
        return True

    def prefill_reserved(self, seq: Sequence) -> None:
        """A reserved request is prefilled here (colocated serving): it swaps the leading blocks of its lease for
        its prefix-cache hit's, then runs as an admitted request."""
        if self.prefix is not None:
            hit = self.prefix.match(seq)
            m = len(hit.blocks)
            self.pools.blocks.free(seq.block_ids[:m])
            self.pools.blocks.share(hit.blocks)
            seq.block_ids[:m] = hit.blocks
            self.prefix.start(seq, hit, self.prefix.plan(seq, hit))
        self.admit_prefilled(seq)

    def admit_prefilled(self, seq: Sequence) -> None:
        """A reserved request whose prompt state is now in its blocks and slots joins the running batch."""
        self.reserved.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pools.blocks.free(seq.block_ids)
        self.pools.slots.free(seq.state_slots)
        seq.preempted()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _fit(self, seq: Sequence, rows: int, scheduled: set[int]) -> bool:
        """Grows `seq` for a step of `rows` rows, preempting the newest running requests not scheduled yet (`seq`
        itself last) until it fits; False when `seq` was preempted."""
        while not self._grow(seq, rows):
            victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    @traced
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.ecfg.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        preempted = self.num_preemptions

        def take(seq: Sequence, rows: int) -> None:
            nonlocal budget
            chunks.append(ScheduledChunk(seq, rows))
            scheduled.add(id(seq))
            budget -= rows

        for s in list(self.running):
            n = 1 + len(s.drafts)
            if s.status == Status.RUNNING and not s.in_prefill and n <= budget and self._fit(s, n, scheduled):
                take(s, n)
        for s in list(self.running):
            if budget == 0:
                break
            if s.status == Status.RUNNING and s.in_prefill:
                n = min(budget, self._chunk_end(s) - s.num_computed)
                if self._fit(s, n, scheduled):
                    take(s, n)
        while budget > 0 and self.waiting and self.num_preemptions == preempted:
            s = self.waiting[0]
            n = self._admit(s, budget)
            if not n:
                break
            self.waiting.popleft()
            s.status = Status.RUNNING
            self.running.append(s)
            take(s, n)
        return chunks

    def cache(self, chunks: list[ScheduledChunk]) -> None:
        """After a step: the blocks and snapshots its running requests completed join the prefix cache."""
        if self.prefix is not None:
            for c in chunks:
                if c.seq.status == Status.RUNNING:
                    self.prefix.after_step(c.seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Frees everything the sequence holds; safe on every path (finished, aborted, waiting)."""
        if seq.status == Status.FINISHED:
            return
        if seq.status in (Status.RUNNING, Status.RESERVED):
            (self.running if seq.status == Status.RUNNING else self.reserved).remove(seq)
            self.pools.blocks.free(seq.block_ids)
            self.pools.slots.free(seq.state_slots)
            seq.block_ids, seq.state_slots = [], []
        else:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
