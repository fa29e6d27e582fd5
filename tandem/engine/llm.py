"""The vLLM-shaped `LLM` API over the colocated engine (`tandem/engine/engine.py`), and how its model is built."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from tandem.cache.sizing import size_caches
from tandem.config import ConfigError, EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Sequence, Status
from tandem.engine.tensor_parallel import LeaderModel, launch
from tandem.model.source import load_model, model_config
from tandem.parallel import check_divisible
from tandem.structured import GrammarCompiler
from tandem.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

def build_model(model: str, ecfg: EngineConfig, seed: int = 0, tensor_parallel_size: int = 1):
    """The model an engine runs: loaded here on one rank; with `tensor_parallel_size` > 1, ranks 1.. started as
    processes of their own and this process's `LeaderModel` (its `shutdown()` stops them). Returns
    (cfg, model, model_dir)."""
    if tensor_parallel_size == 1:
        return load_model(model, ecfg.device, ecfg.dtype, seed)
    cfg = model_config(model)
    check_divisible(cfg, tensor_parallel_size)  # before starting any process
    if ecfg.enable_prefix_caching:  # snapshots would be copied on rank 0 only
        log.warning("prefix caching is off under tensor parallelism")
        ecfg.enable_prefix_caching, ecfg.num_state_snapshots = False, 0
    if ecfg.num_kv_blocks is None:  # every rank builds its pools of these sizes when it starts
        if ecfg.kv_cache_memory_bytes is None:
            raise ConfigError("with tensor parallelism on GPUs, size the caches with kv_cache_memory_bytes "
                              "(--kv-cache-memory-bytes, per GPU) or num_kv_blocks")
        size_caches(cfg, ecfg, cfg.num_mtp_layers > 0, ecfg.kv_cache_memory_bytes, tensor_parallel_size)
    return launch(model, ecfg, seed, tensor_parallel_size)


def parse_speculative_config(spec: dict | None) -> int:
    """vLLM's `speculative_config={"method": "mtp", "num_speculative_tokens": k}` -> k (0 when None)."""
    if not spec:
        return 0
    unknown = set(spec) - {"method", "num_speculative_tokens"}
    if unknown:
        raise ValueError(f"speculative_config: unsupported keys {sorted(unknown)}")
    if spec.get("method", "mtp") != "mtp":
        raise ValueError(f"speculative_config.method: only 'mtp' is supported, got {spec.get('method')!r}")
    return spec.get("num_speculative_tokens", 1)


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None
    emulated: bool = False  # produced under emulated acceptance (benchmark only): not the model's output


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # SamplingParams.prompt_logprobs set: per prompt position, None for the first, else {token id: logprob} of
    # the top-n tokens and the prompt token (as vLLM's RequestOutput.prompt_logprobs, with floats for Logprob)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV and state came from the prefix cache


class LLM:
    """`LLM(model="tiny-moe").generate([{"prompt_token_ids": [...]}], SamplingParams(...))`.

    `tensor_parallel_size` > 1 spawns ranks 1.. as processes of their own (gloo on the CPU, NCCL with one GPU
    per rank); this process is rank 0. `close()` (or leaving a `with` block, or exit) stops them."""

    def __init__(self, model: str, dtype: str | torch.dtype = "auto", device: str | None = None,
                 max_num_seqs: int = 64, max_model_len: int = 4096, max_num_batched_tokens: int = 2048,
                 block_size: int = 16, seed: int = 0, speculative_config: dict | None = None,
                 emulated_acceptance: tuple[float, ...] | None = None, tensor_parallel_size: int = 1,
                 cuda_graphs: bool | None = None, kv_cache_memory_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.9, num_kv_blocks: int | None = None,
                 enable_prefix_caching: bool = True):
        from tandem.worker_setup import checkpoint_dtype

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if dtype == "auto":  # float32 on a CPU, where bf16 is slow
            dtype = checkpoint_dtype(model) if device.startswith("cuda") else "float32"
        ecfg = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                            kv_cache_memory_bytes=kv_cache_memory_bytes, num_kv_blocks=num_kv_blocks,
                            gpu_memory_utilization=gpu_memory_utilization,
                            max_num_batched_tokens=max_num_batched_tokens, dtype=dtype, device=device,
                            num_speculative_tokens=parse_speculative_config(speculative_config),
                            emulated_acceptance=emulated_acceptance, cuda_graphs=cuda_graphs,
                            enable_prefix_caching=enable_prefix_caching)
        cfg, net, model_dir = build_model(model, ecfg, seed, tensor_parallel_size)
        self.tokenizer = load_tokenizer(model_dir)
        self.engine = Engine(cfg, net, ecfg)
        self.engine.grammars = GrammarCompiler(model, cfg.vocab_size, cfg.eos_token_ids, self.tokenizer)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stops the other tensor-parallel ranks (nothing to do on one rank)."""
        model = self.engine.runner.model
        if isinstance(model, LeaderModel):
            model.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]} instead of text")
            return self.tokenizer.encode(prompt)
        raise ValueError("a prompt is a string or {'prompt_token_ids': [...]}")

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self._prompt_ids(p) for p in prompts]  # validate everything before queuing anything
        seqs = []
        try:
            for toks, p in zip(ids, params):
                rid = str(next(self._ids))
                self.engine.add_request(rid, toks, p)
                seqs.append(self.engine.sequences[rid])
            while self.engine.has_work():
                self.engine.step()
        finally:
            for s in seqs:
                if s.status != Status.FINISHED:
                    self.engine.abort(s.request_id)
        return [self._output(s) for s in seqs]

    def _output(self, s: Sequence) -> RequestOutput:
        text = self.tokenizer.decode(s.output_token_ids, skip_special_tokens=True) if self.tokenizer else None
        lps = s.output_logprobs if s.params.logprobs is not None else None
        return RequestOutput(s.request_id, s.prompt_token_ids,
                             [CompletionOutput(0, list(s.output_token_ids), text, s.finish_reason, lps,
                                               emulated=self.engine.ecfg.emulated_acceptance is not None)],
                             list(s.prompt_logprobs) if s.params.prompt_logprobs is not None else None,
                             s.num_cached_tokens or 0)
