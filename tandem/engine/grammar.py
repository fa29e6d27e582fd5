"""Grammar masks on the logits of constrained rows (structured outputs), before sampling.

A constrained request's row j of a verify step (`[last, d_1..d_k]`) samples in the context of its first j drafts,
so its mask is the matcher's state after d_1..d_j: llguidance advances a matcher over the drafts while it computes
their masks and rolls it back after, so the matcher stays at the request's emitted tokens, and the engine feeds it
the tokens a step emits (rejected drafts never reach it). A row after a draft the grammar refuses is left
unmasked: that draft is masked out at its own row, so it is never accepted and the rows after it are never used.

Masks are bit sets over the vocabulary (int32 words, bit b of word w = token 32w + b), filled on the host by
llguidance's thread pool, sent to the device with one copy, and applied to the constrained rows only. A step with
no constrained row does none of this.
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.batch import to_device
from tandem.ops.token_mask import mask_rows_


class GrammarMasks:
    def __init__(self, vocab_size: int, eos_ids: list[int]):
        self.vocab_size, self.words = vocab_size, (vocab_size + 31) // 32
        eos_only = np.zeros(self.words, dtype=np.uint32)  # what a matcher that failed still allows
        for t in eos_ids:
            if t < vocab_size:  # a config's eos past its vocabulary (the kernel checks' shrunk presets) is no token
                eos_only[t // 32] |= np.uint32(1 << (t % 32))
        self.eos_only = eos_only.view(np.int32)
        self._executor = None

    def fill(self, rows: list[tuple[int, object, list[int]]]) -> tuple[list[int], np.ndarray]:
        """rows: (first logits row, matcher, drafts) per constrained request. Returns the logits rows masked and
        their masks [n, words]: row first + j gets the matcher's state after drafts[:j]."""
        import llguidance as llg

        if self._executor is None:
            self._executor = llg.LLExecutor()
        n = sum(len(d) + 1 for _, _, d in rows)
        host = np.full((n, self.words), -1, dtype=np.int32)  # -1: every token (rows nobody uses)
        targets, plain, drafted, at = [], [], [], 0
        for first, matcher, drafts in rows:
            targets.extend(range(first, first + len(drafts) + 1))
            if matcher.is_error():  # it refused a token (none should reach it: each passed its mask): it may only end
                host[at : at + len(drafts) + 1] = self.eos_only
            elif drafts:
                drafted.append((matcher, at, list(drafts)))
            else:
                plain.append((matcher, at))
            at += len(drafts) + 1
        # llguidance writes each mask at host[index] (and a drafted request's next ones after it) on its threads
        ptr, row_bytes = host.ctypes.data, self.words * 4
        if plain:  # its draft form refuses an empty draft list
            self._executor.unsafe_compute_mask_ptr(plain, ptr, row_bytes, n)
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, ptr, row_bytes, n)
        return targets, host

    def warm_up(self, device) -> None:
        """Compiles the mask kernel (the one variant a model needs) before any request waits for it."""
        logits = torch.zeros(1, self.vocab_size, device=device)
        mask_rows_(logits, torch.zeros(1, dtype=torch.long, device=device),
                   torch.full((1, self.words), -1, dtype=torch.int32, device=device))

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, rows: list[tuple[int, object, list[int]]]) -> None:
        """Masks the constrained rows of `logits` [R, V] in place (see `fill`)."""
        targets, masks = self.fill(rows)
        bitmask, = to_device(logits.device, masks)
        idx, = to_device(logits.device, np.asarray(targets, dtype=np.int64))
        mask_rows_(logits, idx, bitmask)
