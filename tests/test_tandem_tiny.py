"""The shipped tandem-tiny checkpoint (models/tandem-tiny, trained by training/train.py): HF transformers and Tandem
give the same logits, the demo prompt's greedy answer is deterministic readable text, and MTP acceptance on a fixed
held-out prompt set stays above a floor set well under the value recorded in docs/BENCHMARKS.md."""

import json
import os
import string

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig, ModelConfig
from tandem.engine.engine import Engine
from tandem.engine.scheduler import ScheduledChunk
from tandem.model.loader import load_checkpoint
from admitted import admitted

MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "tandem-tiny")
DEMO = [{"role": "user", "content": "Hello! What can you do?"}]
TOL = 1e-4
# Recorded on these 8 prompts (k = 3, greedy, 48 tokens each, fp32 CPU): 0.798 / 0.664 / 0.571 per position
# (docs/BENCHMARKS.md, "tandem-tiny"). The floors sit 0.25 below.
ACCEPTANCE_FLOOR = (0.55, 0.40, 0.30)


def chat_ids(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


@pytest.fixture(scope="module")
def llm():
    return LLM(model=MODEL, max_num_seqs=16, max_model_len=1024)


def test_checkpoint_is_commit_sized_and_official_layout():
    assert os.path.getsize(os.path.join(MODEL, "model.safetensors")) <= 40_000_000
    with open(os.path.join(MODEL, "config.json")) as f:
        raw = json.load(f)
    assert raw["model_type"] == "qwen3_5_moe" and raw["text_config"]["model_type"] == "qwen3_5_moe_text"
    cfg = ModelConfig.from_hf(raw)
    assert cfg.layer_types.count("linear_attention") == 3 * cfg.layer_types.count("full_attention")
    assert all(cfg.moe_layers) and cfg.shared_expert_intermediate_size > 0 and cfg.num_mtp_layers == 1
    from safetensors import safe_open

    with safe_open(os.path.join(MODEL, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names
    assert any(n.startswith("mtp.") for n in names)


def test_logits_match_hf(llm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    ids = chat_ids(llm.tokenizer, DEMO + [{"role": "assistant", "content": "I can answer questions and write."},
                                          {"role": "user", "content": "Write a haiku about the sea."}])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    cfg = ModelConfig.from_dir(MODEL)
    model = load_checkpoint(MODEL, cfg, "cpu", torch.float32, progress=False)
    eng = Engine(cfg, model, EngineConfig(block_size=16, max_num_seqs=1, max_model_len=256))
    seq = admitted(eng, "a", ids, max_tokens=1)
    got = eng.runner.run([ScheduledChunk(seq, len(ids))], all_rows=True)
    assert (got - ref).abs().max() <= TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_demo_prompt_greedy_is_deterministic_readable_text(llm):
    params = SamplingParams(max_tokens=32, temperature=0.0)
    ids = chat_ids(llm.tokenizer, DEMO)
    a = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
    b = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
    assert a.token_ids == b.token_ids and a.text == b.text
    text = a.text.strip()
    assert text
    ok = sum(c.isalpha() or c.isspace() or c in string.punctuation or c.isdigit() for c in text)
    assert ok / len(text) >= 0.8
    words = [w.strip(string.punctuation) for w in text.split()]
    assert sum(w.isalpha() for w in words) >= 5, text


def test_mtp_acceptance_on_fixed_heldout_prompts():
    with open(os.path.join(MODEL, "heldout_prompts.json")) as f:
        prompts = json.load(f)
    spec = LLM(model=MODEL, max_num_seqs=len(prompts), max_model_len=1024,
               speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    ids = [chat_ids(spec.tokenizer, p) for p in prompts]
    spec.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(max_tokens=48, temperature=0.0))
    st = spec.engine.spec_stats
    rates = [a / st.num_drafts for a in st.accepted_per_position]
    assert all(r >= floor for r, floor in zip(rates, ACCEPTANCE_FLOOR)), rates
