"""MTP speculative decoding: verification of `[last, d_1..d_k]` and drafting with the MTP head.

Verification samples the target's token at each verify row in order and accepts the draft while they agree.
With argmax (one-hot) drafts this is exactly rejection sampling: the draft is kept with probability p(d) =
min(1, p(d)/q(d)), and a rejected row's token is distributed as p restricted to tokens other than d, i.e. the
normalised max(p - q, 0). So it is lossless for greedy and stochastic requests alike (penalties, seeds and stop
rules included, as each row goes through the ordinary sampler with the tokens accepted so far).

Drafting: the MTP head runs once over every row whose next token is now known (prompt chunks, the accepted
verify rows), filling its KV cache for those positions, then k-1 more times on its own output hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.batch import take_rows


@dataclass
class SpecStats:
    """vLLM's spec-decode counters: drafts (verify steps), draft tokens, accepted tokens, accepted per position."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_position = [0] * self.k

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per verify step (1 + accepted)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class VerifyRow:
    """A request as verify row j sees it: its tokens plus its first j drafts (the row only counts when all of
    them were accepted, so that is exactly its context then). Sampled like a Sequence."""

    __slots__ = ("seq", "extra")

    def __init__(self, seq, extra: list[int]):
        self.seq, self.extra = seq, extra

    params = property(lambda self: self.seq.params)
    request_id = property(lambda self: self.seq.request_id)
    eos_ids = property(lambda self: self.seq.eos_ids)
    num_output_tokens = property(lambda self: self.seq.num_output_tokens + len(self.extra))
    token_ids = property(lambda self: self.seq.token_ids + self.extra)
    output_token_ids = property(lambda self: self.seq.output_token_ids + self.extra)


@torch.inference_mode()
def draft(model, runner, pools, items, hidden_rows: torch.Tensor, drafting: list[bool], k: int) -> list[list[int]]:
    """items: (seq, first position, next-token ids) per request, with `hidden_rows` the target hidden of those
    rows in order. Fills the MTP KV for those positions; returns k argmax drafts for each request marked
    `drafting` (the others, mid-prompt, get [])."""
    batch = runner.rows_batch(items)
    out = model.mtp(model.model.embed_tokens(batch.input_ids), hidden_rows, batch, model.inv_freq, pools.mtp_cache)
    which = [i for i, d in enumerate(drafting) if d]
    if not which:
        return [[] for _ in items]
    qsl = batch.query_start_loc_cpu
    last = take_rows(out, [qsl[i + 1] - 1 for i in which])  # each drafting request's last row
    tokens = [model.draft_tokens(last)]
    seqs = [items[i][0] for i in which]
    next_pos = [items[i][1] + len(items[i][2]) for i in which]
    for step in range(1, k):
        # each pass reads the previous pass's drafts on the device: every pass is queued before the host waits
        # once for all of them (the batch's own token ids, placeholders here, are not read)
        rec = runner.rows_batch([(seq, pos + step - 1, [0]) for seq, pos in zip(seqs, next_pos)])
        last = model.mtp(model.model.embed_tokens(tokens[-1]), last, rec, model.inv_freq, pools.mtp_cache)
        tokens.append(model.draft_tokens(last))
    drafts = torch.stack(tokens, 1).tolist()
    out_drafts = [[] for _ in items]
    for i, d in zip(which, drafts):
        out_drafts[i] = d
    return out_drafts
