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
    block_ids: list[int] = field(default_factory=list)
    # GDN state slots: 1 without speculation, 1 + k with; the state after row j of a step lands in
    # state_slots[min(j, k)], and the next step reads state_slots[read_slot_index].
    state_slots: list[int] = field(default_factory=list)
    read_slot_index: int = 0
    drafts: list[int] = field(default_factory=list)  # MTP drafts to verify in the next step
    status: Status = Status.WAITING
    finish_reason: str | None = None
    # time.monotonic() stamps for the latency metrics
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # blocks and slots allocated (admitted, or reserved)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_token_ids)
