"""The engine: the model, the cache pools, the scheduler and the runner of one process; `Engine.step` runs one
batched forward (prefill chunks and decode or verify rows together) and samples it."""

from __future__ import annotations

import gc
import logging
import random
import time
from dataclasses import dataclass, replace

import torch

from tandem.cache.handoff import gather_state, scatter_state
from tandem.cache.pools import CachePools
from tandem.cache.prefix import PrefixCache, chain_seed
from tandem.cache.sizing import GIB, cache_bytes, log_capacity, size_caches, slots_that_fit
from tandem.config import ConfigError, EngineConfig, ModelConfig
from tandem.engine.runner import ModelRunner
from tandem.engine.graphs import DecodeGraphs
from tandem.engine.grammar import GrammarMasks
from tandem.engine.prefill_graphs import MAX_GRAPH_TOKENS, PrefillGraphs
from tandem.engine.sampler import draw_noise, sample, top_logprobs
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler
from tandem.engine.spec import SpecStats, VerifyRow, draft
from tandem.engine.sequence import Sequence
from tandem.batch import take_rows
from tandem.ops.attention import DECODE_MAX_Q
from tandem.ops.fp8 import DECODE_MAX_ROWS
from tandem.engine.tensor_parallel import LeaderModel
from tandem.parallel import SINGLE
from tandem.profiling import traced
from tandem.structured import GrammarCompiler

log = logging.getLogger(__name__)

PROMPT_LOGPROB_ROWS = 512  # prompt rows per full-vocab log_softmax (512 x a 248k vocab: 0.5 GB of fp32)


@dataclass
class PrefilledRequest:
    """A request that left a prefill-only engine: its first token and drafts, and copies of its state."""

    seq: Sequence
    state: list[tuple[str, torch.Tensor]]
    rng_state: torch.Tensor | None  # the seeded generator after the first token, so decoding continues its stream


@dataclass(frozen=True)
class StepShape:
    """What one engine step ran: decode/verify requests and prompt tokens (chunks)."""

    decodes: int
    prompt_tokens: int

    @property
    def kind(self) -> str:
        """decode (decode rows only), mixed (both), prefill (prompt chunks only)."""
        if self.decodes:
            return "mixed" if self.prompt_tokens else "decode"
        return "prefill"


def _free_memory(dev) -> int:
    """The device's free bytes once its work is done and torch's cache is given back (eager warm-ups before a
    capture leave cached blocks that are no graph's memory)."""
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(dev)[0]


class _Drafts:
    """What the MTP head runs after a step: (sequence, first position, tokens) items, their rows of the step's
    hidden states, and whether each drafts (a mid-prompt chunk only fills the head's KV)."""

    def __init__(self):
        self.items, self.rows, self.drafting = [], [], []

    def add(self, item, rows: range, drafting: bool) -> None:
        self.items.append(item)
        self.rows.extend(rows)
        self.drafting.append(drafting)


class Engine:
    """Owns the model, the cache pools, the scheduler and the runner; `step()` runs one batched forward.

    `prefill_only`: the engine of a prefill worker; requests leave through `take_prefilled` after their first token.
    A decode worker's engine takes requests through `reserve` + `install_prefilled` instead of `add_request`.

    Tensor parallelism: `model` is then rank 0's `LeaderModel`; this engine schedules and samples for all ranks,
    and its pools hold rank 0's heads (the other ranks keep theirs, at the same block and slot numbers). Hand-offs
    gather and scatter every rank's heads, so the state in and out is the full model's (`tandem/cache/handoff.py`)."""

    def __init__(self, cfg: ModelConfig, model, ecfg: EngineConfig, prefill_only: bool = False):
        self.cfg, self.ecfg = cfg, ecfg
        if ecfg.num_speculative_tokens and not hasattr(model, "mtp"):
            raise ValueError("speculative decoding with MTP needs a model with an MTP head (mtp.* weights)")
        if model.lm_head_weight.dtype != ecfg.dtype:  # the caches follow ecfg: kernels cannot mix the two
            raise ValueError(f"the model is {model.lm_head_weight.dtype} but the engine config says {ecfg.dtype}")
        self.tp = getattr(model, "tp", SINGLE)
        self.prefill_only = prefill_only
        self.spec_stats = SpecStats(ecfg.num_speculative_tokens)
        self._emulation_rng = random.Random(0)
        self.generators: dict[str, torch.Generator] = {}
        self.sequences: dict[str, Sequence] = {}
        self.last_step: StepShape | None = None  # of the latest step (None: it had nothing to run)
        self.on_launch = None  # called once a step's forward is on the device, before the step waits for it
        # structured outputs: the compiler of this model's grammars (set by whoever knows the tokenizer: the
        # workers, LLM) and the masks of constrained rows
        self.grammars: GrammarCompiler | None = None
        self.masks = GrammarMasks(cfg.vocab_size, cfg.eos_token_ids)
        with_mtp = hasattr(model, "mtp")
        if ecfg.num_kv_blocks is None:
            budget = ecfg.kv_cache_memory_bytes
            if budget is None:
                budget = self._profiled_budget(model)
            size_caches(cfg, ecfg, with_mtp, budget, self.tp.world_size)
        self._build_caches(model)
        log_capacity(ecfg, cache_bytes(cfg, ecfg, with_mtp, self.tp.world_size))

    def _build_caches(self, model) -> None:
        """The pools of `self.ecfg`'s sizes, and what holds them: the scheduler, the runner, the decode graphs."""
        ecfg = self.ecfg
        self.pools = CachePools(self.cfg, ecfg, with_mtp=hasattr(model, "mtp"), tp=self.tp)
        if isinstance(model, LeaderModel):
            model.attach(self.pools)
        prefix = None
        if ecfg.enable_prefix_caching and ecfg.num_state_snapshots:
            seed = chain_seed(repr((self.cfg, str(ecfg.dtype), ecfg.block_size)))
            prefix = PrefixCache(self.pools, ecfg.block_size, ecfg.num_speculative_tokens > 0, seed,
                                 ecfg.prefix_state_interval, ecfg.num_state_snapshots)
        self.scheduler = Scheduler(ecfg, self.pools, self.prefill_only, prefix)
        graphs = ecfg.cuda_graphs and self.tp.world_size == 1
        self.runner = ModelRunner(model, self.pools, ecfg, piecewise=graphs)
        self.graphs = DecodeGraphs(model, self.pools, ecfg) if graphs and not self.prefill_only else None

    def _profiled_budget(self, model) -> int:
        """On a GPU: the bytes the caches may take, gpu_memory_utilization x the device's memory less what this
        process holds beside them: the weights and the CUDA context now, the peak of the largest steps (a step of
        the whole token budget, and a decode step of max_num_seqs requests with sampling and drafting), run on the
        smallest pools that serve them, and the CUDA graphs' pools, captured on a probe and freed again (the prefill
        graphs of every bucket; the largest decode batch, whose pool the smaller ones reuse). Lowers max_num_seqs
        when fewer state slots fit beside its decode graphs (`_decode_graphs_batch`)."""
        ecfg = self.ecfg
        if not ecfg.device.startswith("cuda") or self.tp.world_size > 1:
            raise ConfigError("size the caches with kv_cache_memory_bytes or num_kv_blocks (memory is profiled on "
                              "one GPU only)")
        dev = torch.device(ecfg.device)
        self.ecfg = replace(ecfg, num_kv_blocks=ecfg.blocks_per_seq + 1, num_state_slots=ecfg.max_num_seqs,
                            cuda_graphs=False, enable_prefix_caching=False)
        self._build_caches(model)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        room = ecfg.max_model_len - 2 - ecfg.num_speculative_tokens
        params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=1.0, logprobs=1)
        for lengths in (_prompts(ecfg.max_num_batched_tokens, room), [1] * ecfg.max_num_seqs):
            ids = [f"__profile-{i}" for i in range(len(lengths))]
            for rid, n in zip(ids, lengths):
                self.add_request(rid, [i % self.cfg.vocab_size for i in range(n)], params)
            for _ in range(len(lengths) * (ecfg.max_model_len + 4)):  # a profile that cannot finish fails the start
                if not self.has_work():
                    break
                self.step()
            else:
                raise RuntimeError("the memory profile's requests did not finish")
        torch.cuda.synchronize(dev)
        activations = max(0, torch.cuda.max_memory_allocated(dev) - before)  # `before` counted the probe's pools
        self.spec_stats = SpecStats(ecfg.num_speculative_tokens)  # the profile's drafts are no one's
        self.pools = self.scheduler = self.runner = self.graphs = None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        spare = int(ecfg.gpu_memory_utilization * total) - (total - free) - activations
        prefill_graphs = decode_graphs = 0
        if ecfg.cuda_graphs:  # captured on a probe of one slot: the graphs' memory does not depend on the pools
            self.ecfg = replace(self.ecfg, num_state_slots=1)
            self._build_caches(model)
            prefill_graphs = self._graph_bytes(dev, lambda: PrefillGraphs(model, self.pools.layer_caches, self.ecfg))
        if ecfg.cuda_graphs and not self.prefill_only:
            ecfg.max_num_seqs, decode_graphs = self._decode_graphs_batch(model, dev, spare - prefill_graphs)
        self.pools = self.scheduler = self.runner = self.graphs = None
        self.ecfg = ecfg
        torch.cuda.empty_cache()
        budget = spare - prefill_graphs - decode_graphs
        log.info("memory profile: %.2f GiB of %.2f GiB in use after loading (weights, CUDA context), %.2f GiB peak "
                 "of the largest steps, %.2f GiB of prefill CUDA graphs, %.2f GiB of decode CUDA graphs (batch %d): "
                 "%.2f GiB left for the caches at gpu_memory_utilization %.2f",
                 (total - free) / GIB, total / GIB, activations / GIB, prefill_graphs / GIB, decode_graphs / GIB,
                 ecfg.max_num_seqs, max(budget, 0) / GIB, ecfg.gpu_memory_utilization)
        if budget <= 0:
            raise ConfigError(f"no memory left for the KV cache at gpu_memory_utilization "
                              f"{ecfg.gpu_memory_utilization}: raise it or load a smaller model")
        return budget

    def _decode_graphs_batch(self, model, dev, room: int) -> tuple[int, int]:
        """(The batch the decode graphs are captured up to, their bytes). The graphs grow with the batch: when
        fewer than max_num_seqs state slots fit in `room` bytes beside the graphs of max_num_seqs, the batch is
        the largest whose graphs (interpolated between batch 1's and max_num_seqs', then measured) leave it its
        slots, or fewer if the measure says so; max_num_seqs is lowered to it."""
        most, with_mtp = self.ecfg.max_num_seqs, hasattr(model, "mtp")

        def measure(batch: int) -> int:  # the largest batch's graphs hold the pool the smaller ones reuse
            self.ecfg = replace(self.ecfg, max_num_seqs=batch)
            return self._graph_bytes(dev, lambda: DecodeGraphs(model, self.pools, self.ecfg), largest_only=True)

        def slots(graph_bytes: int) -> int:
            return slots_that_fit(self.cfg, self.ecfg, with_mtp, room - graph_bytes, self.tp.world_size)

        top = measure(most)
        if slots(top) >= most:
            return most, top
        one = measure(1)
        batch = max((b for b in range(1, most) if slots(one + (top - one) * (b - 1) // (most - 1)) >= b), default=1)
        graph_bytes = measure(batch)
        if 0 < slots(graph_bytes) < batch:
            batch = slots(graph_bytes)
            graph_bytes = measure(batch)
        log.warning("max_num_seqs lowered from %d to %d: the state slots that fit beside the decode CUDA graphs of "
                    "that batch", most, batch)
        return batch, graph_bytes

    def _graph_bytes(self, dev, make, **capture) -> int:
        """The device memory of the graphs `make()` builds (on the probe's pools) once captured; freed again."""
        start, reserved = _free_memory(dev), torch.cuda.memory_reserved(dev)
        graphs = make()
        graphs.capture_all(**capture)
        used = start - _free_memory(dev)
        log.info("memory profile: %s hold %.2f GiB (%.2f GiB reserved by torch)", type(graphs).__name__, used / GIB,
                 (torch.cuda.memory_reserved(dev) - reserved) / GIB)
        del graphs
        gc.collect()  # now: graphs the collector destroyed during a later capture would invalidate it
        torch.cuda.empty_cache()
        return max(0, used)

    def capture_graphs(self) -> None:
        """Captures the decode graph of every batch bucket and the prefill graphs of every token bucket now (a
        serving worker, before it takes requests), instead of on each bucket's first use. Nothing to do without
        CUDA graphs."""
        for graphs, what in ((self.runner.prefill_graphs, "prefill CUDA graphs for token counts"),
                             (self.graphs, "decode CUDA graphs for batch sizes")):
            if graphs is not None and graphs.capture:
                t0, free0 = time.monotonic(), _free_memory(self.ecfg.device)
                graphs.capture_all()
                free, total = _free_memory(self.ecfg.device), torch.cuda.mem_get_info(self.ecfg.device)[1]
                # what they hold was set aside when the caches were sized (`_profiled_budget`)
                log.info("captured %s %s in %.1f s: they hold %.2f GiB; %.2f GiB of %.2f GiB left free", what,
                         graphs.buckets, time.monotonic() - t0, (free0 - free) / GIB, free / GIB, total / GIB)

    def warm_up(self) -> None:
        """Compiles the prefill kernels before serving (on a GPU the first step of a new kind otherwise waits
        seconds for Triton to compile and autotune). The prompts reach every tiling the prefill cores pick:
        full-budget steps (and steps of every multiple of 2048 rows below the budget); 1, 2, 3 and 5 rows (the
        decode tilings of attention and the conv's row tiles); 48 rows (the widest row tile of the skinny
        projections, `tandem/ops/linear.py`); 257 rows, and budget - 1 past the prefill graphs (FP8 GEMMs that
        cuBLAS does not take: more than 256 rows, not a multiple of 4); the fewest rows of attention's prefill
        tiling, one tile when its tiles are that tall; a short and a long request together (GDN's recurrent and
        chunked kernels in one step); last chunks of 1, 2, 3, 5, 9 and 20 rows on a long context (split-K in every
        tiling); and 2, 4, 8 and 16 one-token prompts (what depends on the number of requests, which a prefill
        worker's engine has no decode graphs to warm). Each request drafts.
        `tests/kernels_sm90.py --workload` checks on the CPU that serving compiles nothing after this. Everything
        is freed afterwards."""
        t0 = time.monotonic()
        budget = self.ecfg.max_num_batched_tokens
        room = self.ecfg.max_model_len - 2 - self.ecfg.num_speculative_tokens  # longest prompt with 2 tokens to go
        short = DECODE_MAX_Q + 1  # rows past attention's decode tiling
        # a step of the whole budget and one of every multiple of 2048 rows below it, each as prompts of at most
        # `room` rows: fla autotunes its q/k L2 norm once per bucket of rows x key heads / 65536 (2048 rows at 32
        # heads), 25 configs compiled while every running request waits; steps past the prefill graphs' largest
        # bucket run eagerly
        batches = [_prompts(n, room) for n in [*range(2048, budget, 2048), budget]]
        if [min(budget, room)] not in batches:  # one prompt: what a step of few requests reaches
            batches.append([min(budget, room)])
        # FP8 GEMMs of more than DECODE_MAX_ROWS rows whose count is not a multiple of 4 take the Triton kernel
        # (cuBLAS the others, `fp8._cublas_fits`): the MTP head's pass over a prompt (eager, whatever its rows)
        # and eager steps past the prefill graphs' largest bucket; the graphs pad to multiples of 4
        batches.append([DECODE_MAX_ROWS + 1])
        if budget > MAX_GRAPH_TOKENS:
            batches.append(_prompts(budget - 1, room))
        batches += [[1], [2], [3], [5], [48], [short], [64, 96]]
        batches += [[1] * b for b in (2, 4, 8, 16)]  # steps of several requests: GDN's value blocks, MoE align chunks
        # the last prompt ends with a chunk of `tail` rows: split-K on a long context in each decode tiling (1, 2, 3
        # and 5 rows: one per power-of-two tile height) and in the prefill tiling, one tile and several; prompts
        # before it fill the first step (several of them when the budget exceeds two prompts of `room` rows)
        for tail in (1, 2, 3, 5, short, 20):
            batches.append([budget + tail] if budget + tail <= room else [*_prompts(budget + tail - room, room), room])
        batches = [b for b in batches if len(b) <= self.ecfg.max_num_seqs and max(b) <= room]
        # 2 tokens: a request that stopped at its first token would not draft (the MTP head's eager passes)
        params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
        # the prompts share their prefixes: from the prefix cache, most rows would not run
        prefix, self.scheduler.prefix = self.scheduler.prefix, None
        for lengths in batches:
            ids = [f"__warmup-{i}" for i in range(len(lengths))]
            for rid, n in zip(ids, lengths):
                self.add_request(rid, [i % self.cfg.vocab_size for i in range(n)], params)
            while any(r in self.sequences and self.sequences[r].in_prefill for r in ids):
                self.step()
            for rid in ids:
                self.abort(rid)
        self.scheduler.prefix = prefix
        self.masks.warm_up(self.ecfg.device)  # the first constrained step compiles nothing either
        log.info("prefill kernels warmed up in %.1f s", time.monotonic() - t0)

    def grammar_matcher(self, params: SamplingParams, prompt_token_ids: list[int]):
        """A request's structured-output matcher (None when it has no constraint), past the prompt's resumed
        output tokens (decode failover); ValueError for a constraint that does not compile or refuses them.
        Thread-safe: workers call it in their RPC threads, off the engine thread."""
        if params.structured_outputs is None:
            return None
        if self.grammars is None:
            raise ValueError("structured outputs are not available here: the engine has no tokenizer")
        return self.grammars.matcher(params.structured_outputs, prompt_token_ids)

    def _new_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      matcher) -> Sequence:
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        if matcher is None:
            matcher = self.grammar_matcher(params, prompt_token_ids)
        return Sequence(request_id, list(prompt_token_ids), params, eos_ids=list(self.cfg.eos_token_ids),
                        matcher=matcher)

    def _register(self, seq: Sequence) -> None:
        self.sequences[seq.request_id] = seq
        if seq.params.seed is not None:
            self.generators[seq.request_id] = torch.Generator(device=self.ecfg.device).manual_seed(seq.params.seed)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    matcher=None) -> None:
        """`matcher`: the request's `grammar_matcher`, when it was compiled beforehand (else it is compiled here)."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, matcher)
        self.scheduler.add(seq)
        self._register(seq)

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                matcher=None) -> Sequence | None:
        """Decode worker: holds a request's blocks and slots for its hand-off; None when they are not free now.
        Raises ValueError for a request that can never fit."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, matcher)
        if not self.scheduler.reserve(seq):
            return None
        self._register(seq)
        return seq

    def install_prefilled(self, seq: Sequence, first_token: int, first_logprob: dict | None, drafts: list[int],
                          state: dict[str, torch.Tensor], rng_state: torch.Tensor | None) -> None:
        """Decode worker: the reserved request continues from a prefill worker's state as if prefilled here."""
        scatter_state(self.cfg, self.pools, seq, state, self.ecfg.block_size, self.runner.model)
        seq.num_computed = len(seq.prompt_token_ids)
        seq.output_token_ids = [first_token]
        if seq.matcher is not None:  # the prefill worker sampled it under the same grammar
            seq.matcher.consume_token(first_token)
        seq.output_logprobs = [first_logprob] if first_logprob is not None else []
        seq.drafts = list(drafts)
        if rng_state is not None:
            self.generators[seq.request_id].set_state(rng_state)
        self.scheduler.admit_prefilled(seq)

    def prefill_reserved(self, seq: Sequence) -> None:
        """Decode worker serving colocated: a reserved request is prefilled here instead of by a hand-off."""
        self.scheduler.prefill_reserved(seq)  # running from its prefix-cache hit: the scheduler prefills the rest

    def take_prefilled(self) -> list[PrefilledRequest]:
        """Prefill-only engine: removes the requests whose first token (and drafts) are ready, with their state."""
        out = []
        for seq in [s for s in self.scheduler.running if not s.in_prefill]:
            gen = self.generators.get(seq.request_id)
            out.append(PrefilledRequest(seq, gather_state(self.cfg, self.pools, seq, self.ecfg.block_size,
                                                          self.runner.model),
                                        gen.get_state() if gen is not None else None))
            self._finish(seq, "handoff")
        return out

    def abort(self, request_id: str) -> None:
        seq = self.sequences.get(request_id)
        if seq is not None:
            self._finish(seq, "abort")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.generators.pop(seq.request_id, None)
        self.sequences.pop(seq.request_id, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @traced
    def step(self) -> list[Sequence]:
        """Runs one step; returns the sequences that finished in it. A step of decode requests (past their
        prompt) alone runs their fixed-shape forward (a CUDA graph when enabled); a step of prompt chunks, with or
        without decode requests, runs one forward over all its rows (piecewise graphs when enabled), so the
        weights are read once for both."""
        chunks = self.scheduler.schedule()
        finished = self._run(chunks)
        self.scheduler.cache(chunks)
        return finished

    def _run(self, chunks) -> list[Sequence]:
        decode = [c for c in chunks if not c.seq.in_prefill]
        prefill = [c for c in chunks if c.seq.in_prefill]
        self.last_step = StepShape(len(decode), sum(c.num_tokens for c in prefill)) if chunks else None
        if not prefill:
            return self._decode(decode) if decode else []
        forced = self._emulated(decode)
        batch, hidden = self.runner.forward(decode + prefill)
        # the earlier step's outputs go out only now: the woken stream threads would take the GIL between this
        # host-bound forward's launches (served FP8 mixed steps on the H200: ~9 ms a step)
        self._launched()
        n, todo = sum(c.num_tokens for c in decode), _Drafts()  # decode rows come first
        finished = self._verified(decode, self.runner.model.compute_logits(hidden[:n]), forced, False,
                                  todo) if decode else []
        finished += self._prefilled(prefill, hidden, batch.query_start_loc_cpu[len(decode):], todo)
        self._draft(todo, hidden)  # one pass of the MTP head for the decode requests and the prompts
        return finished

    @traced
    def _draft(self, todo: "_Drafts", hidden: torch.Tensor) -> None:
        if todo.items:
            drafts = draft(self.runner.model, self.runner, self.pools, todo.items, take_rows(hidden, todo.rows),
                           todo.drafting, self.ecfg.num_speculative_tokens)
            for (seq, _, _), d in zip(todo.items, drafts):
                seq.drafts = d

    def _launched(self) -> None:
        if self.on_launch is not None:
            self.on_launch()

    def _emit(self, seq: Sequence, tok: int, logprob) -> bool:
        """Appends a token; finishes the sequence (and returns True) when a stop rule fires."""
        seq.output_token_ids.append(tok)
        if seq.matcher is not None:
            seq.matcher.consume_token(tok)
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        reason = self._stop_reason(seq, tok)
        if reason:
            self._finish(seq, reason)
        return reason is not None

    def _emulated(self, chunks) -> list[list[bool]]:
        """Emulated acceptance, decided before the step (so the graph path uploads it with the step's inputs): per
        request and draft, whether the draft is taken whatever the target samples. One draw per draft, request by
        request, whether or not an earlier rejection makes it moot: each position is still accepted with its rate
        given the ones before it. A constrained request's drafts are forced only as far as its grammar allows them
        (`validate_tokens`: the longest valid prefix), so it never emits a token its grammar forbids."""
        rates, out = self.ecfg.emulated_acceptance, []
        for c in chunks:
            drafts = c.seq.drafts
            forced = [rates is not None and self._emulation_rng.random() < rates[j] for j in range(len(drafts))]
            if c.seq.matcher is not None and any(forced):
                valid = c.seq.matcher.validate_tokens(drafts)
                forced = [f and j < valid for j, f in enumerate(forced)]
            out.append(forced)
        return out

    @traced
    def _prefilled(self, chunks, hidden: torch.Tensor, qsl: list[int], todo: "_Drafts") -> list[Sequence]:
        """Prompt chunks after the step's forward (`hidden` its rows, chunk i's from qsl[i] to qsl[i + 1]): a
        request whose prompt completes samples its first token at its last row; with MTP, every row whose next
        token is now known goes to `todo` for the draft head (the completed ones also draft)."""
        k, model = self.ecfg.num_speculative_tokens, self.runner.model
        if any(c.seq.params.prompt_logprobs is not None for c in chunks):
            self._prompt_logprobs(chunks, hidden, qsl)
        done = [i for i, c in enumerate(chunks) if not c.seq.in_prefill]
        if done:
            logits = model.compute_logits(take_rows(hidden, [qsl[i + 1] - 1 for i in done]))
            self._mask([(r, chunks[i].seq, 1) for r, i in enumerate(done)], logits)
            tokens, lps = sample(logits, [chunks[i].seq for i in done], self.generators)
            first = dict(zip(done, zip(tokens.tolist(), lps)))
        finished = []
        for i, c in enumerate(chunks):
            seq, n = c.seq, c.num_tokens
            first_pos = seq.num_computed - n
            known = seq.tokens(first_pos + 1, first_pos + n + 1)  # the next token of each row, where known
            if i in done:
                if self._emit(seq, *first[i]):
                    finished.append(seq)
                    continue
                known.append(seq.output_token_ids[-1])
            if k:
                todo.add((seq, first_pos, known), range(qsl[i], qsl[i] + n), not seq.in_prefill)
        return finished

    @torch.inference_mode()
    def _prompt_logprobs(self, chunks, hidden: torch.Tensor, qsl: list[int]) -> None:
        """Prompt logprobs of the chunks whose requests ask for them: row r's logits give the logprob of prompt
        token r + 1 (the last prompt row's logits sample the first output token instead, as for everyone). Only
        these rows get logits, PROMPT_LOGPROB_ROWS at a time to bound the [rows, vocab] buffers."""
        rows, targets, owners = [], [], []
        for i, c in enumerate(chunks):
            seq = c.seq
            if seq.params.prompt_logprobs is None or len(seq.prompt_logprobs) == len(seq.prompt_token_ids):
                continue  # none asked, or all computed before a preemption
            first_pos = seq.num_computed - c.num_tokens
            if first_pos == 0:
                seq.prompt_logprobs = [None]  # nothing comes before the first prompt token
            nxt = seq.prompt_token_ids[first_pos + 1 : first_pos + c.num_tokens + 1]
            rows.extend(range(qsl[i], qsl[i] + len(nxt)))
            targets.extend(nxt)
            owners.extend([seq] * len(nxt))
        model = self.runner.model
        for s in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            idx, tgt, own = (x[s : s + PROMPT_LOGPROB_ROWS] for x in (rows, targets, owners))
            lp = model.compute_logits(take_rows(hidden, idx)).log_softmax(-1)
            for seq, d in zip(own, top_logprobs(lp, tgt, [seq.params.prompt_logprobs for seq in own])):
                seq.prompt_logprobs.append(d)

    def _decode(self, chunks) -> list[Sequence]:
        """A step of decode requests alone, each at its last token plus its drafts: their forward (the verify CUDA
        graph when the batch fits one), then `_verified`."""
        k, model, graphs = self.ecfg.num_speculative_tokens, self.runner.model, self.graphs
        use_graph = graphs is not None and graphs.fits(chunks)
        drafted = use_graph and k > 0  # acceptance and the next drafts come from the device
        forced = self._emulated(chunks)
        if use_graph:
            hidden, logits = graphs.verify(chunks, forced)
        else:
            _, hidden = self.runner.forward(chunks)
            logits = model.compute_logits(hidden)
        self._launched()
        todo = _Drafts()
        finished = self._verified(chunks, logits, forced, drafted, todo)
        self._draft(todo, hidden)
        return finished

    @traced
    def _verified(self, chunks, logits: torch.Tensor, forced, drafted: bool, todo: "_Drafts") -> list[Sequence]:
        """Decode requests after the step's forward (their rows first in it, `logits` theirs): every row is
        sampled in one batch (row j of a request in the context of its first j drafts), drafts are kept while they
        agree with the sampled tokens, and the last accepted row goes to `todo` for the MTP head's next drafts.
        When `drafted` (the graph path) acceptance and drafting ran on the device as well, and the step waits for
        the device once (`DecodeGraphs.accept_and_draft`); the host loop below then only replays the stop rules,
        logprobs and generators on the tokens that came back."""
        k, graphs = self.ecfg.num_speculative_tokens, self.graphs
        views, starts = [], []
        for c in chunks:
            starts.append(len(views))
            views.extend(VerifyRow(c.seq, c.seq.drafts[:j]) for j in range(c.num_tokens))
        seeded = {c.seq.request_id: g.get_state() for c in chunks
                  if (g := self.generators.get(c.seq.request_id)) is not None and not c.seq.params.greedy}
        self._mask([(start, c.seq, c.num_tokens) for c, start in zip(chunks, starts)], logits)
        tokens, lps = sample(logits, views, self.generators)
        if drafted:
            tokens, device_accepted, new_drafts = graphs.accept_and_draft(tokens)
        else:
            tokens = tokens.tolist()
        finished = []
        for i, (c, start) in enumerate(zip(chunks, starts)):
            seq, first_pos = c.seq, c.seq.num_computed - c.num_tokens
            drafts, seq.drafts = seq.drafts, []
            accepted, stopped = 0, False
            for j in range(c.num_tokens):
                tok = tokens[start + j]
                if j < len(drafts) and forced[i][j]:
                    tok = drafts[j]  # emulated acceptance: the draft is taken whatever the target says
                if self._emit(seq, tok, lps[start + j]):
                    stopped = True
                    break
                if j < len(drafts) and tok == drafts[j]:
                    accepted += 1
                else:
                    break
            if drafted:  # the same rule on the same tokens, except that a stop cuts the host's count short
                assert accepted <= device_accepted[i] if stopped else accepted == device_accepted[i], \
                    (seq.request_id, accepted, device_accepted[i])
            if not stopped and seq.request_id in seeded:  # its generator advances by the tokens emitted, as k = 0
                self._replay_noise(seq.request_id, seeded[seq.request_id], min(accepted + 1, c.num_tokens),
                                   logits.shape[1])
            if k:
                self.spec_stats.record(len(drafts), accepted)
            # a stopped request's new drafts (graph path) are dropped: the draft graph wrote only MTP KV, into blocks
            # it still held then (their next owner's work is queued after it) or into the null block
            if stopped:
                finished.append(seq)
                continue
            seq.num_computed = first_pos + accepted + 1  # rejected rows are rewound (their KV is overwritten later)
            if k:  # the GDN layers kept the rows: the next step replays the accepted ones
                seq.kept(accepted + 1)
            if drafted:
                seq.drafts = new_drafts[i]
            elif k:
                todo.add((seq, first_pos, drafts[:accepted] + seq.output_token_ids[-1:]),
                         range(start, start + accepted + 1), True)
        return finished

    def _mask(self, rows: list[tuple[int, Sequence, int]], logits: torch.Tensor) -> None:
        """Structured outputs: (first row, sequence, rows) per request; the constrained ones' rows of `logits` get
        their grammar masks (row j after the request's first j drafts). Nothing happens when none is constrained."""
        constrained = [(r, s.matcher, s.drafts[: n - 1]) for r, s, n in rows if s.matcher is not None]
        if constrained:
            self.masks.apply(logits, constrained)

    def _replay_noise(self, request_id: str, state: torch.Tensor, draws: int, vocab: int) -> None:
        gen = self.generators[request_id]
        gen.set_state(state)
        for _ in range(draws):
            draw_noise(vocab, gen, self.ecfg.device)

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in seq.eos_ids):
            # a grammar that was complete (nothing but EOS could follow) ends the request before min_tokens
            if len(seq.output_token_ids) >= p.min_tokens or (seq.matcher is not None and seq.matcher.is_stopped()):
                return "stop"
        if len(seq.output_token_ids) >= p.max_tokens:
            return "length"
        return None


def _prompts(rows: int, longest: int) -> list[int]:
    """Prompt lengths of at most `longest` that add up to `rows` (one warm-up step of that many rows)."""
    return [longest] * (rows // longest) + ([rows % longest] if rows % longest else [])
