"""Continuous batching with chunked prefill.

Each step: every running request past its prompt decodes (one token, or its last token plus its k MTP drafts to
verify; decode rows first), then prompt chunks fill
the rest of the token budget, oldest first. A request is admitted only when `max_num_seqs` allows and its KV
blocks (for its whole possible length, so it never needs preemption) and a GDN state slot are free.

Disaggregated roles: a prefill-only scheduler holds blocks for the prompt plus the MTP drafts only (the request
leaves once its first token is sampled); a decode worker `reserve`s a request's full capacity up front (a lease)
and `admit_prefilled` puts it straight into the running batch once its state has been copied in.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from tandem.cache.pools import CachePools
from tandem.config import EngineConfig
from tandem.engine.sequence import Sequence, Status
from tandem.profiling import traced


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens of this sequence processed in this step, starting at seq.num_computed


class Scheduler:
    def __init__(self, ecfg: EngineConfig, pools: CachePools, prefill_only: bool = False):
        self.ecfg = ecfg
        self.pools = pools
        self.prefill_only = prefill_only
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self._validate(seq)
        self.waiting.append(seq)

    def _validate(self, seq: Sequence) -> None:
        max_len = len(seq.prompt_token_ids) + seq.params.max_tokens
        spec = self.ecfg.num_speculative_tokens
        if len(seq.prompt_token_ids) == 0:
            raise ValueError("prompt must contain at least one token")
        if max_len + spec > self.ecfg.max_model_len:
            raise ValueError(
                f"prompt ({len(seq.prompt_token_ids)} tokens) + max_tokens ({seq.params.max_tokens}) exceeds "
                f"max_model_len ({self.ecfg.max_model_len})")
        if self._blocks_needed(seq) > self.pools.blocks.capacity:
            raise ValueError(f"request needs {self._blocks_needed(seq)} KV blocks; the pool has {self.pools.blocks.capacity}")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, seq: Sequence) -> int:
        # a verify step writes KV for up to k positions beyond the last accepted token; a prefill-only worker
        # writes the prompt, the first token's MTP row and k-1 recursive MTP rows
        k = self.ecfg.num_speculative_tokens
        tokens = len(seq.prompt_token_ids) + (1 + k if self.prefill_only else seq.params.max_tokens + k)
        return -(-tokens // self.ecfg.block_size)

    def _allocate(self, seq: Sequence) -> bool:
        need = self._blocks_needed(seq)
        if len(self.running) + len(self.reserved) >= self.ecfg.max_num_seqs \
                or not self.pools.blocks.can_allocate(need) or not self.pools.slots.can_allocate(1):
            return False
        seq.block_ids = self.pools.blocks.allocate(need)
        seq.state_slots = self.pools.allocate_slots(1)
        seq.scheduled_time = time.monotonic()
        return True

    def _try_admit(self, seq: Sequence) -> bool:
        if not self._allocate(seq):
            return False
        seq.status = Status.RUNNING
        self.running.append(seq)
        return True

    def reserve(self, seq: Sequence) -> bool:
        """Holds the whole capacity of a request whose prompt is prefilled elsewhere; False when it does not fit now."""
        self._validate(seq)
        if not self._allocate(seq):
            return False
        seq.status = Status.RESERVED
        self.reserved.append(seq)
        return True

    def admit_prefilled(self, seq: Sequence) -> None:
        """A reserved request whose prompt state is now in its blocks and slots joins the running batch."""
        self.reserved.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)

    @traced
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.ecfg.max_num_batched_tokens
        chunks = []
        for s in self.running:
            n = 1 + len(s.drafts)
            if not s.in_prefill and n <= budget:
                chunks.append(ScheduledChunk(s, n))
                budget -= n
        for s in self.running:
            if budget == 0:
                break
            if s.in_prefill:
                n = min(budget, len(s.prompt_token_ids) - s.num_computed)
                chunks.append(ScheduledChunk(s, n))
                budget -= n
        while budget > 0 and self.waiting and self._try_admit(self.waiting[0]):
            s = self.waiting.popleft()
            n = min(budget, len(s.prompt_token_ids))
            chunks.append(ScheduledChunk(s, n))
            budget -= n
        return chunks

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
