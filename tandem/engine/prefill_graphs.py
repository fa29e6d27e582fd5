"""Prefill steps as piecewise CUDA graphs: the row-wise parts of the forward captured per token count, the cores
(`tandem.model.qwen3_5.Core`) run eagerly in between.

A prefill step has no fixed shape (its rows split into requests in any way), so it cannot be one graph. But most
of a layer is row-wise -- projections, norms, gates, RoPE, the KV write, the whole MoE block -- and depends only on
the number of rows. The forward (`model.steps`) yields each core: paged attention, GDN's conv and recurrence. The
parts before, between and after the cores are captured once per token bucket (the step's T padded up to it): 41
graphs on the 35B-A3B, with the 40 cores run eagerly on the step's own batch in between. Eagerly the step launches
~600 kernels from Python at tens of microseconds of host time each, so a prompt of 1024 tokens waits on the host.

Static inputs: input_ids, positions and slot_mapping, buffers of the largest bucket that each step copies its rows
into. The padding rows T..bucket-1 write their KV to the null slot 0 and keep the tokens and positions of earlier
steps (valid values). The cores never see padding rows: they run on rows [0, T) and write rows [0, T) of their
static outputs, whose padding rows keep earlier finite values (they start zeroed), so the row-wise parts compute
finite garbage there that nothing reads.

Graphs of all buckets share one memory pool and are captured largest first; a step replays one bucket's graphs in
the order they were captured, so memory that one capture gave back to the pool can serve a later one. What the
cores read (on the 35B-A3B about 0.8 MB per token of the bucket, mostly the fused GDN projections whose parts the
recurrence reads) is given back too once a bucket is captured, though its graphs still write it: a step replays
one bucket, which writes each core's inputs right before the core reads them, so another bucket's use of that
memory is never live at the same time. Held per bucket, it took 13 GiB of an 80 GB card for the buckets up to
4096 tokens. What the cores write is one buffer per core for all buckets (0.3 MB per token of the largest).
On a CPU (tests) nothing is captured: each step runs the forward over the same padded buffers and static core
outputs, so the padding logic is checked against the plain forward without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tandem.config import EngineConfig
from tandem.batch import ForwardBatch
from tandem.model.qwen3_5 import Core
from tandem.profiling import phase


# Steps of more rows run eagerly: they are bound by the device anyway, and the graphs' memory grows with T
MAX_GRAPH_TOKENS = 4096


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts graphs are captured for: 64, 128, 256, 512, every 256 up to 2048, then every 512 (at most
    1/8 of a step is padding past 512 rows), and max_tokens itself."""
    sizes = [64, 128, 256, 512] + list(range(768, 2049, 256)) + list(range(2560, max_tokens, 512))
    return [t for t in sizes if t < max_tokens] + [max_tokens]


def _unowned(t: torch.Tensor) -> torch.Tensor:
    """A tensor over t's memory that does not keep it allocated (as vLLM's piecewise graphs keep their outputs)."""
    storage = t.untyped_storage()
    unowned = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(unowned, t.storage_offset(), t.shape, t.stride())


@dataclass
class _Pieces:
    """One bucket: graphs[i] runs before cores[i] (graphs[-1] after the last core), which writes outs[i]."""

    graphs: list[torch.cuda.CUDAGraph]
    cores: list[Core]
    outs: list[torch.Tensor]
    hidden: torch.Tensor


class PrefillGraphs:
    def __init__(self, model, layer_caches, ecfg: EngineConfig):
        self.model, self.caches, self.ecfg = model, layer_caches, ecfg
        self.capture = ecfg.device.startswith("cuda")
        self.buckets = token_buckets(min(ecfg.max_num_batched_tokens, MAX_GRAPH_TOKENS))
        n, dev = self.buckets[-1], ecfg.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=dev)
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        # one capture stream for every bucket: the allocator reuses a freed block only on the stream it was used on
        self.stream = torch.cuda.Stream() if self.capture else None
        self.pieces: dict[int, _Pieces] = {}
        self.cpu_outs: dict[int, list[torch.Tensor]] = {}  # the static core outputs of the CPU path, per bucket
        self.core_outs: list[torch.Tensor] = []  # core i's output buffer, of the largest bucket's rows

    def _core_out(self, i: int, like: torch.Tensor) -> torch.Tensor:
        """Core i's static output for a bucket of like's rows: the first rows of one zeroed buffer per core, shared
        by every bucket (a step replays one bucket; rows past its own keep finite values of earlier steps)."""
        if i == len(self.core_outs):
            self.core_outs.append(torch.zeros(self.buckets[-1], *like.shape[1:], dtype=like.dtype, device=like.device))
        return self.core_outs[i][: like.shape[0]]

    def fits(self, n_tokens: int) -> bool:
        return n_tokens <= self.buckets[-1]

    def bucket_for(self, n_tokens: int) -> int:
        return next(b for b in self.buckets if b >= n_tokens)

    def _static_batch(self, n: int) -> ForwardBatch:
        """A batch of one request over the first n rows of the static buffers, at the null slot and block: what
        the row-wise parts read (tokens, positions, KV slots), and a batch the cores can run on at capture."""
        dev, bs = self.ecfg.device, self.ecfg.block_size
        i64 = dict(dtype=torch.long, device=dev)
        return ForwardBatch(
            input_ids=self.input_ids[:n], positions=self.positions[:n], slot_mapping=self.slot_mapping[:n],
            query_start_loc=torch.tensor([0, n], **i64), seq_lens=torch.tensor([n], **i64),
            block_tables=torch.zeros(1, -(-n // bs), **i64), state_slots=torch.zeros(1, **i64),
            state_replay=torch.zeros(1, **i64), state_pending=torch.tensor([[0, -1]], **i64),
            logits_indices=torch.tensor([n - 1], device=dev), query_start_loc_cpu=[0, n], seq_lens_cpu=[n])

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The model over `batch` (at most the largest bucket's rows) -> final hidden states [T, H], a tensor of
        its own (the static output is overwritten by the next step)."""
        T = batch.input_ids.shape[0]
        n = self.bucket_for(T)
        if self.capture and n not in self.pieces:  # before filling: capturing runs on the null slot only
            self._capture(n)
        self.input_ids[:T].copy_(batch.input_ids)
        self.positions[:T].copy_(batch.positions)
        self.slot_mapping[:T].copy_(batch.slot_mapping)
        self.slot_mapping[T:n].zero_()  # padding rows: KV to the null slot
        if not self.capture:
            return self._run_uncaptured(n, batch, T)[:T].clone()
        p = self.pieces[n]
        for graph, core, out in zip(p.graphs, p.cores, p.outs):
            with phase("graph"):
                graph.replay()
            core(batch, rows=T, out=out[:T])
        with phase("graph"):
            p.graphs[-1].replay()
        return p.hidden[:T].clone()

    def capture_all(self) -> None:
        for n in reversed(self.buckets):  # largest first: the smaller buckets reuse its pool memory
            if n not in self.pieces:
                self._capture(n)

    @torch.inference_mode()
    def _capture(self, n: int) -> None:
        batch = self._static_batch(n)
        self.slot_mapping[:n].zero_()
        self.model(batch, self.caches)  # warm-up: Triton compiles and cuBLAS picks its kernels outside capture
        torch.cuda.synchronize()
        # the eager passes' temporaries (this one's, the engine's warm-up's) stay cached in the general pool, which
        # the graphs' private pool cannot draw from: at a step budget of 8192 that left 27 GiB unusable and the
        # capture ran out of memory on an 80 GB card
        torch.cuda.empty_cache()
        batch = self._static_batch(n)  # fresh derived entries (RoPE tables): computed inside the graphs
        steps, graphs, cores, outs, sent = self.model.steps(batch, self.caches), [], [], [], None
        while True:
            graph, core = torch.cuda.CUDAGraph(), None
            with torch.cuda.stream(self.stream):
                graph.capture_begin(pool=self.pool)
                try:
                    core = steps.send(sent)  # runs (records) the row-wise part up to the next core
                except StopIteration as done:
                    hidden = done.value
                finally:
                    graph.capture_end()
            graphs.append(graph)
            if core is None:
                break
            # the core's output buffer, shaped by one run of the core (on inputs the graphs have not computed
            # yet: its result and its writes to the null slot are garbage nobody reads)
            sent = self._core_out(len(outs), core(batch))
            cores.append(core)
            outs.append(sent)
        torch.cuda.synchronize()
        # what the cores read and the final hidden states stay at their addresses but stop holding them, so the
        # next (smaller) bucket's capture reuses that pool memory: one step replays one bucket, whose graphs write
        # each core's inputs right before the core reads them
        cores = [replace(c, inputs=tuple(map(_unowned, c.inputs))) for c in cores]
        self.pieces[n] = _Pieces(graphs, cores, outs, _unowned(hidden))

    def _run_uncaptured(self, n: int, batch: ForwardBatch, T: int) -> torch.Tensor:
        """What replaying bucket n computes, without graphs: the forward over the static buffers, each core on
        the step's rows into its static output."""
        static = self._static_batch(n)
        outs = self.cpu_outs.setdefault(n, [])
        steps, i, sent = self.model.steps(static, self.caches), 0, None
        while True:
            try:
                core = steps.send(sent)
            except StopIteration as done:
                return done.value
            if i == len(outs):
                outs.append(self._core_out(i, core(static)))
            core(batch, rows=T, out=outs[i][:T])
            sent, i = outs[i], i + 1
