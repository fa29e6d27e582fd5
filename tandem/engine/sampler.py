"""Token sampling for a batch of requests, each with its own SamplingParams.

Order (as vLLM): penalties on the raw logits -> min_tokens mask (unless only stop tokens are left: a grammar that
can only end) -> temperature -> top-k / top-p / min-p -> draw.
Draws use the exponential-race trick (argmax p / E, E ~ Exp(1)), so a seeded request takes its noise from its own
generator and gets the same tokens whatever else is in the batch. Logprobs are of the unmodified model distribution.
Nothing here waits for the device except the logprobs (read on the host): per-request values go up by non-blocking
copies, so a decode step's sampling queues behind its forward instead of draining it.
"""

from __future__ import annotations

import torch

from tandem.batch import to_device
from tandem.profiling import traced


def _upload(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list on the device without waiting for queued kernels (torch.tensor(..., device=cuda) would wait)."""
    return to_device(device, torch.tensor(values, dtype=dtype))[0]


def apply_penalties(logits: torch.Tensor, seqs) -> None:
    for i, s in enumerate(seqs):
        p = s.params
        if p.repetition_penalty != 1.0:
            seen = _upload(sorted(set(s.token_ids)), torch.long, logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and s.num_output_tokens:
            ids = _upload(s.output_token_ids, torch.long, logits.device)
            # index_add_, not bincount: bincount on CUDA reads the largest id on the host to size its output
            counts = torch.zeros(logits.shape[1], device=logits.device)
            counts.index_add_(0, ids, torch.ones(len(ids), device=logits.device))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def _penalised(logits: torch.Tensor, seqs) -> torch.Tensor:
    """The logits after penalties and the min_tokens mask (a copy only when one of them applies)."""
    masked = [i for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens]
    penalised = any(s.params.repetition_penalty != 1.0 or s.params.presence_penalty or s.params.frequency_penalty
                    for s in seqs)
    if not masked and not penalised:
        return logits
    logits = logits.clone()
    apply_penalties(logits, seqs)
    for i in masked:
        s = seqs[i]
        stops = _upload(s.params.stop_token_ids + ([] if s.params.ignore_eos else s.eos_ids), torch.long, logits.device)
        kept = logits[i].index_fill(0, stops, float("-inf"))
        # a row left with nothing but stop tokens (a grammar that can only end) keeps them: min_tokens never asks
        # for a token its grammar forbids (decided on the device: no wait)
        logits[i] = torch.where(kept.amax() > float("-inf"), kept, logits[i])
    return logits


def _mask_top_k_top_p_min_p(probs: torch.Tensor, seqs) -> torch.Tensor:
    if all(not s.params.top_k and s.params.top_p >= 1.0 and not s.params.min_p for s in seqs):
        return probs  # nothing to cut: skip the sort over the vocabulary
    dev = probs.device
    top_k = _upload([s.params.top_k or probs.shape[1] for s in seqs], torch.long, dev)
    top_p = _upload([s.params.top_p for s in seqs], probs.dtype, dev)
    min_p = _upload([s.params.min_p for s in seqs], probs.dtype, dev)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=dev)[None, :]
    # keep a token when the mass strictly before it is < top_p (so the top token always survives)
    before = sorted_p.cumsum(-1) - sorted_p
    keep = (rank < top_k[:, None]) & (before < top_p[:, None]) & (sorted_p >= min_p[:, None] * sorted_p[:, :1])
    sorted_p = sorted_p * keep
    masked = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    return masked / masked.sum(-1, keepdim=True)


def draw_noise(vocab: int, generator: torch.Generator, device) -> torch.Tensor:
    """One row of Exp(1) noise from a request's own generator (one draw per sampled token)."""
    return torch.empty(vocab, device=device).exponential_(generator=generator)


@traced
def sample(logits: torch.Tensor, seqs, generators: dict[str, torch.Generator]):
    """logits: fp32 [B, V]; seqs: one Sequence (or a view with the same fields) per row. Returns (token ids [B],
    per-row logprob dicts). Greedy rows take the argmax and draw no noise."""
    raw_logprobs = _logprobs(logits, seqs)
    logits = _penalised(logits, seqs)
    greedy = [s.params.greedy for s in seqs]
    if all(greedy):
        tokens = logits.argmax(-1)
        return tokens, logprob_dicts(raw_logprobs, tokens, seqs)
    temps = _upload([s.params.temperature if s.params.temperature > 0 else 1.0 for s in seqs], torch.float32,
                    logits.device)
    probs = _mask_top_k_top_p_min_p((logits / temps[:, None]).softmax(-1), seqs)
    noise = torch.empty_like(probs).exponential_()
    for i, s in enumerate(seqs):
        g = generators.get(s.request_id)
        if g is not None and not greedy[i]:
            noise[i] = draw_noise(probs.shape[1], g, probs.device)
    drawn = (probs / noise).argmax(-1)
    tokens = torch.where(_upload(greedy, torch.bool, logits.device), logits.argmax(-1), drawn)
    return tokens, logprob_dicts(raw_logprobs, tokens, seqs)


def _logprobs(logits: torch.Tensor, seqs):
    if all(s.params.logprobs is None for s in seqs):
        return None
    return logits.log_softmax(-1)


def logprob_dicts(logprobs: torch.Tensor | None, tokens: torch.Tensor, seqs) -> list[dict | None]:
    """Per row: the top-n tokens' logprobs plus the sampled token's (as vLLM returns them)."""
    if logprobs is None:
        return [None] * len(seqs)
    return top_logprobs(logprobs, tokens, [s.params.logprobs for s in seqs])


def top_logprobs(logprobs: torch.Tensor, tokens, ns: list[int | None]) -> list[dict | None]:
    """logprobs [R, V], tokens [R] -> per row {token id: logprob} of its top ns[r] tokens plus tokens[r] (None
    where ns[r] is None). One top-k and one gather over all rows, one copy each to the host."""
    rows = [r for r, n in enumerate(ns) if n is not None]
    out: list[dict | None] = [None] * len(ns)
    if not rows:
        return out
    idx = torch.tensor(rows, device=logprobs.device)
    lp = logprobs.index_select(0, idx)
    tok = torch.as_tensor(tokens, device=logprobs.device).index_select(0, idx)
    chosen = lp.gather(1, tok[:, None])[:, 0].tolist()
    n_max = max(ns[r] for r in rows)
    top_v, top_i = lp.topk(n_max, dim=-1) if n_max else (lp[:, :0], lp[:, :0].long())
    for r, t, v, tv, ti in zip(rows, tok.tolist(), chosen, top_v.tolist(), top_i.tolist()):
        d = dict(zip(ti[: ns[r]], tv[: ns[r]]))
        d[t] = v
        out[r] = d
    return out
