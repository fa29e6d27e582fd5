"""The whole model on the kernel path: every op's Triton dispatch switched on for CPU tensors, so the engine runs
the kernels under Triton's interpreter end to end (prefill, decode, MTP drafting and k + 1-row verify steps, the
cache and state slots between them), against the same engine on the torch references. The op tests pin each
kernel to its reference; this pins how the model and the engine put them together."""

import os

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import ModelConfig
from tandem.model.presets import PRESETS, random_model
from tandem.ops import attention, fp8, gdn, linear, moe, norm, pointwise, rope
from test_fp8 import logits as prefill_logits  # every row's logits of one prompt's prefill forward

MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "tandem-tiny")


def run(prompts):
    """Greedy tokens of each prompt with MTP k = 2, and the engine's speculation counters."""
    llm = LLM(model=MODEL, max_num_seqs=len(prompts), max_model_len=64, block_size=16,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    return tokens, llm.engine.spec_stats


def test_tandem_tiny_on_the_kernel_path_cpu_interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case runs where there is no GPU")
    # two requests of different lengths (a 12-token prompt spans a 16-token KV block's end after 5 tokens)
    prompts = [list(range(5, 12)), list(range(40, 52))]
    want, want_spec = run(prompts)
    for module in (attention, fp8, gdn, linear, moe, norm, pointwise, rope):
        monkeypatch.setattr(module, "use_triton", lambda x: True)
    got, got_spec = run(prompts)
    assert want_spec.num_accepted_tokens > 0  # verify rows past the first were kept, not only rejected
    assert got == want
    assert got_spec == want_spec  # the same drafts accepted at each position


def test_hosted_shared_expert_on_the_kernel_path_cpu_interpreter(monkeypatch):
    """A MoE whose shared expert has the experts' size, as in every real Qwen3.5 MoE (the experts host it as expert
    E, and the next residual add sums the per-pair outputs): its prefill logits on the kernel path against the
    torch path, every row."""
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case runs where there is no GPU")
    cfg = ModelConfig.from_hf(dict(PRESETS["tiny-moe"], shared_expert_intermediate_size=32))
    model = random_model(cfg, "cpu", torch.float32, seed=3)
    assert all(layer.mlp.hosted for layer in model.model.layers)
    ids = list(range(7, 19))

    want = prefill_logits(cfg, model, ids)
    for module in (attention, fp8, gdn, linear, moe, norm, pointwise, rope):
        monkeypatch.setattr(module, "use_triton", lambda x: True)
    assert (prefill_logits(cfg, model, ids) - want).abs().max() <= 1e-4
