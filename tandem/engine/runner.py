"""Turns a scheduled step into a ForwardBatch, runs the model and returns the logits of each request's last row."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from tandem.cache.pools import CachePools
from tandem.config import EngineConfig
from tandem.engine.prefill_graphs import PrefillGraphs
from tandem.engine.scheduler import ScheduledChunk
from tandem.engine.sequence import Sequence
from tandem.batch import ForwardBatch, to_device
from tandem.model.qwen3_5 import Qwen3_5ForCausalLM
from tandem.profiling import traced


class ModelRunner:
    def __init__(self, model: Qwen3_5ForCausalLM, pools: CachePools, ecfg: EngineConfig, piecewise: bool = False):
        """piecewise: steps of up to max_num_batched_tokens rows run as piecewise CUDA graphs (`PrefillGraphs`)."""
        self.model, self.pools, self.ecfg = model, pools, ecfg
        self.prefill_graphs = PrefillGraphs(model, pools.layer_caches, ecfg) if piecewise else None

    def build_batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        """The rows each chunk processes: its unprocessed tokens (plus its drafts when verifying)."""
        rows = []
        for c in chunks:
            start = c.seq.num_computed
            rows.append((c.seq, start, (c.seq.tokens(start, start + c.num_tokens) + c.seq.drafts)[: c.num_tokens]))
        return self.rows_batch(rows)

    @traced
    def rows_batch(self, items: list[tuple[Sequence, int, list[int]]]) -> ForwardBatch:
        """A batch of (sequence, first position, token ids) triples; the rows of each sit at consecutive positions."""
        dev, bs, n = self.ecfg.device, self.ecfg.block_size, len(items)
        # built while the device waits for the step (a traced mixed step: docs/BENCHMARKS.md, thirteenth and
        # fourteenth sessions), so in numpy: from Python lists 3-4x faster than torch.tensor, and its ops cheaper
        def ints(values, count=n):
            return np.fromiter(values, np.int64, count)

        lens = ints(len(toks) for _, _, toks in items)
        starts = ints(p for _, p, _ in items)
        qsl = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=qsl[1:])
        rows = int(qsl[-1])
        seq_lens = starts + lens
        # positions: start of each request plus the offset of each row inside its chunk
        row_req = np.repeat(np.arange(n), lens)
        positions = starts[row_req] + np.arange(rows) - qsl[:-1][row_req]
        width = max(len(seq.block_ids) for seq, _, _ in items)
        tables = ints(itertools.chain.from_iterable(seq.block_ids + [0] * (width - len(seq.block_ids))
                                                    for seq, _, _ in items), n * width).reshape(n, width)
        slot_mapping = tables[row_req, positions // bs] * bs + positions % bs
        # with speculation, a decode request's rows (its last token and drafts) stay pending in the GDN layers
        # until its acceptance is known (`Sequence.kept`); prompt rows (recomputed ones too) are committed
        spec = self.ecfg.num_speculative_tokens > 0
        pending = ints(itertools.chain.from_iterable(seq.pending(spec and p >= seq.prefill_len)
                                                     for seq, p, _ in items), 2 * n).reshape(n, 2)
        # all int64, as in the decode graphs' buffers: the kernels then compile one variant for both
        (input_ids, positions_d, slot_mapping_d, state_slots, state_replay, state_pending, logits_indices, qsl_d,
         seq_lens_d, tables_d) = to_device(
            dev, ints(itertools.chain.from_iterable(toks for _, _, toks in items), rows), positions, slot_mapping,
            ints(seq.state_slots[0] for seq, _, _ in items), ints(seq.pending_rows for seq, _, _ in items), pending,
            qsl[1:] - 1, qsl, seq_lens, tables)
        return ForwardBatch(
            input_ids=input_ids, positions=positions_d, query_start_loc=qsl_d, seq_lens=seq_lens_d,
            block_tables=tables_d, slot_mapping=slot_mapping_d, state_slots=state_slots, state_replay=state_replay,
            state_pending=state_pending, logits_indices=logits_indices,
            query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist(),
        )

    @traced
    @torch.inference_mode()
    def forward(self, chunks: list[ScheduledChunk]) -> tuple[ForwardBatch, torch.Tensor]:
        """Runs the target over the chunks; returns the batch and the final hidden state of every row [T, H].
        Advances num_computed by each chunk's length (a verify step then rewinds the rejected rows)."""
        batch = self.build_batch(chunks)
        graphs = self.prefill_graphs
        if graphs is not None and graphs.fits(batch.query_start_loc_cpu[-1]):
            hidden = graphs.forward(batch)
        else:
            hidden = self.model(batch, self.pools.layer_caches)
        for c in chunks:
            c.seq.num_computed += c.num_tokens
        return batch, hidden

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], all_rows: bool = False) -> torch.Tensor:
        """Returns fp32 logits at each chunk's last token ([len(chunks), V]), or at every row ([T, V]) when
        `all_rows`, and advances num_computed."""
        batch, hidden = self.forward(chunks)
        return self.model.compute_logits(hidden if all_rows else hidden[batch.logits_indices])
