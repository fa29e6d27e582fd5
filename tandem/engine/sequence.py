"""One request's tokens and the cache resources it holds."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tandem.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RESERVED = "reserved"  # decode worker: capacity held for a hand-off that has not arrived yet
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # params.prompt_logprobs set: one entry per prompt position computed so far, None for position 0 (vLLM's
    # layout); each dict holds the top-n tokens' logprobs and the prompt token's own
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV/state is in the cache
    # after a preemption: the tokens it had then, all recomputed as a prompt (its outputs stay outputs)
    recompute_len: int = 0
    block_ids: list[int] = field(default_factory=list)
    # prefix caching (`tandem/cache/prefix.py`): the keys of its full blocks so far, how many of block_ids are in
    # the cache's index, where its prompt chunks end for a state snapshot, and the prompt tokens its first
    # admission found cached (vLLM's RequestOutput.num_cached_tokens)
    block_keys: list[int] = field(default_factory=list)
    num_registered: int = 0
    snapshot_points: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None
    # the GDN state slot (one, in a list as leases carry it). A verify step's rows stay pending in one of the
    # slot's two buffers (`pending_buffer`) until the next step replays the accepted ones (`pending_rows`).
    state_slots: list[int] = field(default_factory=list)
    pending_rows: int = 0
    pending_buffer: int = 0
    drafts: list[int] = field(default_factory=list)  # MTP drafts to verify in the next step
    # structured outputs: the llguidance matcher at the emitted tokens (tandem/engine/grammar.py), else None
    matcher: object | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    # time.monotonic() stamps for the latency metrics
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # blocks and slots allocated (admitted, or reserved)
    num_preemptions: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end], without building token_ids (as long as the context) on the decode path."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[start:end] + self.output_token_ids[max(0, start - n) : max(0, end - n)]

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def pending(self, keep: bool) -> tuple[int, int]:
        """(The buffer its pending rows are in, the buffer a step keeps its rows in, or -1 when `keep` is False:
        the step commits them); see `tandem/ops/gdn.py`."""
        base = 2 * self.state_slots[0]
        return base + self.pending_buffer, base + 1 - self.pending_buffer if keep else -1

    def kept(self, accepted_rows: int) -> None:
        """After a step that kept its rows: the next step replays the first `accepted_rows` of them."""
        self.pending_rows, self.pending_buffer = accepted_rows, 1 - self.pending_buffer

    def preempted(self) -> None:
        """Its blocks and slot were taken back: everything so far is recomputed as a prompt, drafts included."""
        self.recompute_len = self.num_tokens
        self.num_computed = self.pending_rows = self.pending_buffer = 0
        self.drafts = []
        self.block_ids, self.state_slots, self.snapshot_points = [], [], []
        self.num_registered = 0
        self.status = Status.WAITING
        self.num_preemptions += 1

    @property
    def prefill_len(self) -> int:
        """Tokens computed as a prompt before decoding: the prompt, or after a preemption every token then."""
        return max(len(self.prompt_token_ids), self.recompute_len)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_len
