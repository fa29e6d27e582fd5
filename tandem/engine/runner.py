"""Turns a scheduled step into a ForwardBatch, runs the model and returns the logits of each request's last row."""

from __future__ import annotations

import torch

from tandem.cache.pools import CachePools
from tandem.config import EngineConfig
from tandem.engine.scheduler import ScheduledChunk
from tandem.model.batch import ForwardBatch
from tandem.model.qwen3_5 import Qwen3_5ForCausalLM


class ModelRunner:
    def __init__(self, model: Qwen3_5ForCausalLM, pools: CachePools, ecfg: EngineConfig):
        self.model, self.pools, self.ecfg = model, pools, ecfg

    def build_batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        dev, bs = self.ecfg.device, self.ecfg.block_size
        lens = [c.num_tokens for c in chunks]
        starts = [c.seq.num_computed for c in chunks]
        ids = [t for c, s, n in zip(chunks, starts, lens) for t in (c.seq.token_ids + c.seq.drafts)[s : s + n]]
        qsl = torch.tensor([0] + lens).cumsum(0)
        seq_lens = torch.tensor(starts) + torch.tensor(lens)
        # positions: start of each request plus the offset of each row inside its chunk
        row_req = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(lens))
        positions = torch.tensor(starts)[row_req] + torch.arange(qsl[-1].item()) - qsl[:-1][row_req]
        width = max(len(c.seq.block_ids) for c in chunks)
        tables = torch.zeros(len(chunks), width, dtype=torch.int32)
        for i, c in enumerate(chunks):
            tables[i, : len(c.seq.block_ids)] = torch.tensor(c.seq.block_ids, dtype=torch.int32)
        slot_mapping = tables[row_req, positions // bs].long() * bs + positions % bs
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=positions.to(dev),
            query_start_loc=qsl.to(torch.int32).to(dev),
            seq_lens=seq_lens.to(torch.int32).to(dev),
            block_tables=tables.to(dev),
            slot_mapping=slot_mapping.to(dev),
            state_slots=torch.tensor([c.seq.state_slots[c.seq.read_slot_index] for c in chunks], device=dev),
            state_write_slots=torch.tensor([c.seq.state_slots for c in chunks], device=dev),
            logits_indices=(qsl[1:] - 1).to(dev),
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], all_rows: bool = False) -> torch.Tensor:
        """Returns fp32 logits at each chunk's last token ([len(chunks), V]), or at every row ([T, V]) when
        `all_rows`, and advances num_computed."""
        batch = self.build_batch(chunks)
        hidden = self.model(batch, self.pools.layer_caches)
        for c in chunks:
            c.seq.num_computed += c.num_tokens
        return self.model.compute_logits(hidden if all_rows else hidden[batch.logits_indices])
