"""Decode and verify steps as CUDA graphs over persistent buffers.

A pure decode step has a fixed shape: B requests of q = k+1 rows each (the last token plus k drafts). Its
metadata lives in persistent device buffers, one int64 region written by a single host-to-device copy per step,
and the step is captured once per batch-size bucket (B is padded up to the bucket). Padding requests point every
table at the null block and the null state slot, so they compute finite garbage nobody reads.

The block tables are [B, blocks of max_model_len] (16k columns at 262,144 tokens): a step sends only the columns
its requests use, plus a margin of null blocks for the draft rows past them, and a device copy places them in the
full table. Columns past that are stale and never read.

Two graphs per bucket:
- `verify`: the target over the B*q rows -> hidden [B*q, H] and fp32 logits of every row [B*q, V].
- `draft` (k > 0), after the rows are sampled (into `tokens`): each request's accepted drafts (the leading ones
  its sampled tokens, or the emulated-acceptance decisions `forced`, agree with), then the MTP head over the same
  B*q rows with each row's next token (rows past a request's last accepted one get a placeholder and write MTP KV
  at positions that a later step overwrites before anything reads them), then k-1 recursive MTP steps from each
  request's last accepted row, all on the device -> [B, q + 1 + k]: sampled tokens, accepted count, argmax drafts.
  The host reads that one tensor, so a verify step waits for the device once.

Graphs of all buckets share one memory pool; they are captured lazily on first use (`capture_all` does every bucket
up front, as a serving worker does at start). On a CPU (tests) the same buffers and padded batches are used and
"replay" simply runs the function, so the padded path is checked against the eager one without a GPU.
"""

from __future__ import annotations

import torch

from tandem.cache.pools import CachePools
from tandem.config import EngineConfig
from tandem.engine.scheduler import ScheduledChunk
from tandem.batch import ForwardBatch
from tandem.profiling import traced


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes graphs are captured for: 1, 2, 4, 8, then every 8 up to 32, then every 16."""
    sizes = [b for b in (1, 2, 4, 8, 16, 24, 32) if b < max_batch]
    sizes += list(range(48, max_batch, 16))
    return sizes + [max_batch]


class _Replayable:
    """A captured CUDA graph with its output, or (capture=False) the function itself."""

    def __init__(self, fn, capture: bool, pool):
        self.fn, self.graph = fn, None
        if capture:
            torch.cuda.synchronize()
            fn()  # warm-up: Triton compiles and cuBLAS picks its kernels outside the capture
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.out = fn()

    def replay(self):
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out


class DecodeGraphs:
    def __init__(self, model, pools: CachePools, ecfg: EngineConfig):
        self.model, self.pools, self.ecfg = model, pools, ecfg
        self.k = ecfg.num_speculative_tokens
        self.q = self.k + 1
        self.capture = ecfg.device.startswith("cuda")
        self.buckets = batch_buckets(ecfg.max_num_seqs)
        B, n = self.buckets[-1], self.buckets[-1] * self.q
        self.max_blocks = -(-(ecfg.max_model_len + self.k) // ecfg.block_size)
        # the columns past a request's blocks that its recursive drafts may write (null blocks, sent every step)
        self.margin = -(-self.k // ecfg.block_size) + 1
        # one int64 region (a single copy per step): name -> (offset, shape); the block tables' columns in use
        # follow it, as [B, width] (`_upload`)
        fields = {"input_ids": (n,), "positions": (n,), "seq_lens": (B,), "slot_mapping": (n,),
                  "state_slots": (B,), "state_replay": (B,), "state_pending": (B, 2), "forced": (B, self.k)}
        self.layout, size = {}, 0
        for name, shape in fields.items():
            self.layout[name] = (size, shape)
            size += torch.Size(shape).numel()
        self.fields_size = size
        self.device_buf = torch.zeros(size + B * self.max_blocks, dtype=torch.long, device=ecfg.device)
        self.host_buf = torch.zeros(size + B * self.max_blocks, dtype=torch.long, pin_memory=self.capture)
        self.host = {k: self._view(self.host_buf, k).numpy() for k in self.layout}
        self.dev = {k: self._view(self.device_buf, k) for k in self.layout}
        self.block_tables = torch.zeros(B, self.max_blocks, dtype=torch.long, device=ecfg.device)
        self.width = 1  # the block-table columns the step in preparation sends
        self.query_start_loc = torch.arange(0, n + 1, self.q, device=ecfg.device)
        self.rows = torch.arange(B + 1, device=ecfg.device)
        self.tokens = torch.zeros(n, dtype=torch.long, device=ecfg.device)  # the sampled rows, the draft graph's input
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.verify_graphs: dict[int, _Replayable] = {}
        self.draft_graphs: dict[int, _Replayable] = {}
        self.bucket = 0  # the bucket of the step in flight

    def _view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        off, shape = self.layout[name]
        return buf[off : off + torch.Size(shape).numel()].view(shape)

    def fits(self, chunks: list[ScheduledChunk]) -> bool:
        return len(chunks) <= self.buckets[-1] and all(c.num_tokens == self.q and not c.seq.in_prefill
                                                       for c in chunks)

    def bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    # ------------------------------------------------------------------------------------------ batches

    def _batch(self, B: int, input_ids: torch.Tensor) -> ForwardBatch:
        d, n = self.dev, B * self.q
        qsl = self.query_start_loc[: B + 1]
        return ForwardBatch(
            input_ids=input_ids, positions=d["positions"][:n], query_start_loc=qsl, seq_lens=d["seq_lens"][:B],
            block_tables=self.block_tables[:B], slot_mapping=d["slot_mapping"][:n], state_slots=d["state_slots"][:B],
            state_replay=d["state_replay"][:B], state_pending=d["state_pending"][:B], logits_indices=qsl[1:] - 1,
            query_start_loc_cpu=list(range(0, n + 1, self.q)),
            # the torch reference ops (CPU) read the lengths on the host; the kernels never do
            seq_lens_cpu=None if self.capture else d["seq_lens"][:B].tolist(),
        )

    def _pad(self, B: int, first: int) -> None:
        """Requests first..B-1 of the host buffers become padding: null block, null slot, positions 0..q-1."""
        h, q = self.host, self.q
        h["input_ids"][first * q : B * q] = 0
        h["positions"][first * q : B * q] = list(range(q)) * (B - first)
        h["slot_mapping"][first * q : B * q] = list(range(q)) * (B - first)
        h["seq_lens"][first:B] = q
        h["state_slots"][first:B] = 0
        h["state_replay"][first:B] = 0
        h["state_pending"][first:B] = (0, -1)
        h["forced"][first:B] = 0
        self._tables(B)[first:B] = 0

    def _tables(self, B: int):
        """The host rows of the step's block tables, [B, self.width], after the other fields."""
        return self.host_buf[self.fields_size : self.fields_size + B * self.width].numpy().reshape(B, self.width)

    def _upload(self, B: int) -> None:
        n = self.fields_size + B * self.width
        self.device_buf[:n].copy_(self.host_buf[:n], non_blocking=self.capture)
        self.block_tables[:B, : self.width].copy_(self.device_buf[self.fields_size : n].view(B, self.width))

    # ------------------------------------------------------------------------------------------ steps

    @traced
    def verify(self, chunks: list[ScheduledChunk], forced: list[list[bool]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs the target over the chunks' rows (each [last, drafts...]); returns (hidden, logits) of the real
        rows, [len(chunks)*q, H] and [len(chunks)*q, V]. Advances num_computed by q. `forced[i][j]`: request i's
        draft j is accepted whatever is sampled (emulated acceptance), for `accept_and_draft`."""
        h, q, bs = self.host, self.q, self.ecfg.block_size
        n_req = len(chunks)
        B = self.bucket = self.bucket_for(n_req)
        if B not in self.verify_graphs:  # before filling: capturing runs on padding only
            self._capture(B)
        self.width = min(self.max_blocks, max(len(c.seq.block_ids) for c in chunks) + self.margin)
        tables = self._tables(B)
        for i, c in enumerate(chunks):
            seq, p = c.seq, c.seq.num_computed
            rows = slice(i * q, (i + 1) * q)
            h["input_ids"][rows] = seq.output_token_ids[-1:] + seq.drafts  # the token at p, then the drafts
            positions = range(p, p + q)
            h["positions"][rows] = positions
            h["slot_mapping"][rows] = [seq.block_ids[t // bs] * bs + t % bs for t in positions]
            h["seq_lens"][i] = p + q
            h["state_slots"][i] = seq.state_slots[0]
            h["state_replay"][i] = seq.pending_rows
            h["state_pending"][i] = seq.pending(self.k > 0)  # a verify step's rows wait for their acceptance
            h["forced"][i] = forced[i]
            tables[i, : len(seq.block_ids)] = seq.block_ids
            tables[i, len(seq.block_ids) :] = 0
            seq.num_computed += q
        self._pad(B, n_req)
        self._upload(B)
        hidden, logits = self.verify_graphs[B].replay()
        return hidden[: n_req * q], logits[: n_req * q]

    @traced
    def accept_and_draft(self, tokens: torch.Tensor) -> tuple[list[int], list[int], list[list[int]]]:
        """After `verify` of the same requests, `tokens` [n*q] the token sampled at each of their rows (on the
        device): acceptance and the next drafts run on the device, then one copy brings everything to the host.
        Returns (tokens, drafts accepted per request, k new drafts per request)."""
        q = self.q
        n = tokens.numel() // q
        self.tokens[: n * q].copy_(tokens)  # padding rows keep earlier tokens: valid ids, never read back
        packed = self.draft_graphs[self.bucket].replay()[:n].tolist()  # the step's one wait for the device
        return [t for row in packed for t in row[:q]], [row[q] for row in packed], [row[q + 1 :] for row in packed]

    def capture_all(self, largest_only: bool = False) -> None:
        """largest_only: the largest bucket alone, which holds the pool every bucket needs (a memory profile)."""
        for B in reversed(self.buckets[-1:] if largest_only else self.buckets):
            if B not in self.verify_graphs:  # largest first: the smaller graphs reuse its pool memory
                self._capture(B)

    def _capture(self, B: int) -> None:
        self.width = self.max_blocks  # the whole table null: a capture reads no stale column
        self._pad(B, 0)
        self._upload(B)
        self.verify_graphs[B] = _Replayable(lambda: self._verify_fn(B), self.capture, self.pool)
        if self.k:  # reads the verify graph's hidden output (captured just now, so self._last_hidden)
            self.draft_graphs[B] = _Replayable(lambda: self._draft_fn(B), self.capture, self.pool)

    @torch.inference_mode()
    def _verify_fn(self, B: int):
        batch = self._batch(B, self.dev["input_ids"][: B * self.q])
        hidden = self.model(batch, self.pools.layer_caches)
        self._last_hidden = hidden
        return hidden, self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _draft_fn(self, B: int):
        """Acceptance (the host loop's rule: draft j is kept while row j emits it), then the MTP head over the
        verify rows and k-1 recursive steps from each request's last accepted row."""
        model, d, bs, hidden, q = self.model, self.dev, self.ecfg.block_size, self._last_hidden, self.q
        sampled = self.tokens[: B * q].view(B, q)
        drafts_in = d["input_ids"][: B * q].view(B, q)[:, 1:]
        # the token each row emits (an emulated acceptance emits the draft): the next token of each row up to the
        # last accepted one, a placeholder after it
        emitted = torch.cat([torch.where(d["forced"][:B] != 0, drafts_in, sampled[:, :-1]), sampled[:, -1:]], 1)
        accepted = (emitted[:, :-1] == drafts_in).long().cumprod(1).sum(1)  # the leading run of kept drafts
        ids = emitted.reshape(-1)
        batch = self._batch(B, ids)
        out = model.mtp(model.model.embed_tokens(ids), hidden, batch, model.inv_freq, self.pools.mtp_cache)
        pick = self.query_start_loc[:B] + accepted  # each request's last accepted row
        last = out[pick]
        tok = model.draft_tokens(last)
        drafts = [tok]
        pos0, tables, reqs = batch.positions[pick], batch.block_tables, self.rows[:B]
        one_row = self.rows[: B + 1]  # one row per request
        for s in range(1, self.k):
            pos = pos0 + s
            rec = ForwardBatch(
                input_ids=tok, positions=pos, query_start_loc=one_row, seq_lens=pos + 1, block_tables=tables,
                slot_mapping=tables[reqs, pos // bs] * bs + pos % bs, state_slots=batch.state_slots,
                state_replay=batch.state_replay, state_pending=batch.state_pending, logits_indices=one_row[1:] - 1,
                query_start_loc_cpu=list(range(B + 1)),
                seq_lens_cpu=None if self.capture else (pos + 1).tolist())
            last = model.mtp(model.model.embed_tokens(tok), last, rec, model.inv_freq, self.pools.mtp_cache)
            tok = model.draft_tokens(last)
            drafts.append(tok)
        return torch.cat([sampled, accepted[:, None], torch.stack(drafts, 1)], 1)
