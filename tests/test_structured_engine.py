"""Structured outputs in the engine (tandem/engine/grammar.py, tandem/structured.py): the mask kernel and its torch
reference against a plain loop over the bits, the masks of MTP verify rows against matchers advanced one token at
a time, and the engine with k = 2 (drafts verified under the grammar, rejected ones rolled back; the decode graphs'
padded path) against the engine with k = 0, token for token, every answer checked by jsonschema / re / the choice
list."""

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from tandem.engine.grammar import GrammarMasks
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams
from tandem.ops.token_mask import mask_rows_torch_, mask_rows_triton_
from tandem.ops.triton_utils import HAS_TRITON
from tandem.structured import GrammarCompiler, StructuredOutputs, grammar_spec

TINY = "models/tandem-tiny"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99},
                                           "tag": {"enum": ["red", "blue"]}, "s": {"type": "string", "maxLength": 3}},
          "required": ["ok", "n", "tag", "s"], "additionalProperties": False}
REGEX = r"[a-c]{2,4}-\d\d"
CHOICES = ["yes", "no", "maybe so"]


def test_mask_rows_kernel_and_reference_equal_bit_loop():
    """Rows 3 and 0 of 5 masked in place (a vocabulary that is not a multiple of 32 or of the kernel's block), by
    the torch reference and the Triton kernel (interpreted on the CPU), against a loop over the bits."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1100, generator=g)
    words = torch.randint(-2**31, 2**31 - 1, (2, 35), generator=g, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([3, 0])
    want = logits.clone()
    for i, r in enumerate(rows.tolist()):
        for t in range(1100):
            if not (int(words[i, t // 32]) >> (t % 32)) & 1:
                want[r, t] = float("-inf")
    ref = logits.clone()
    mask_rows_torch_(ref, rows, words)
    assert torch.equal(ref, want)
    if HAS_TRITON:
        out = logits.clone()
        mask_rows_triton_(out, rows, words, block=256)
        assert torch.equal(out, want)


def _allowed(bits: np.ndarray, vocab: int) -> set[int]:
    return set(np.nonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab])[0].tolist())


def test_verify_row_masks_follow_the_drafts():
    """Row j's mask is the matcher's state after the first j drafts; a refused draft leaves the rows after it
    unmasked (never used); the matcher itself is left where it was (the drafts are rolled back)."""
    compiler = GrammarCompiler(TINY, 4096, [2])
    so = StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)
    tok = compiler._ll()
    good = tok.tokenize_str('{"ok":true,"n":')
    masks = GrammarMasks(4096, [2])
    m = compiler.matcher(so)
    m.consume_tokens(good[:2])
    drafts = good[2:5] + [tok.tokenize_str("}")[0], good[5]]  # three fine drafts, then one the grammar refuses
    targets, bits = masks.fill([(7, m, drafts)])
    assert targets == list(range(7, 7 + len(drafts) + 1))
    for j in range(len(drafts) + 1):
        ref = compiler.matcher(so)  # the oracle: a fresh matcher fed one token at a time
        assert ref.consume_tokens(good[: 2 + min(j, 3)])
        want = _allowed(np.frombuffer(ref.compute_bitmask(), dtype=np.int32)[:128].copy(), 4096)
        got = _allowed(bits[j], 4096)
        assert got == (want if j <= 3 else set(range(4096))), j
    assert m.validate_tokens(good[2:]) == len(good) - 2  # still right after good[:2]


def test_bad_constraints_name_the_parser_error():
    for so, words in ((StructuredOutputs(regex="a(b"), "unclosed group"),
                      (StructuredOutputs(json='{"type": "nope"}'), "nope"),
                      (StructuredOutputs(json="{not json"), "not valid JSON"),
                      (StructuredOutputs(grammar="start: undefined_rule"), "undefined_rule")):
        with pytest.raises(ValueError, match=re.escape(words)):
            grammar_spec(so)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])


def _params():
    json_so = StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)
    return [SamplingParams(max_tokens=48, temperature=0.0, structured_outputs=json_so),
            SamplingParams(max_tokens=48, temperature=1.0, seed=7, structured_outputs=json_so),
            SamplingParams(max_tokens=16, temperature=1.0, seed=3, structured_outputs=StructuredOutputs(regex=REGEX)),
            SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputs(choice=CHOICES)),
            SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)]


PROMPTS = ["Hello there", "The sea is", "Count: one two", "Answer yes or no", "Tell me a story"]


def _run(k: int, graphs: bool):
    llm = LLM(TINY, max_num_seqs=8, max_model_len=256, block_size=4, cuda_graphs=graphs,
              speculative_config={"num_speculative_tokens": k} if k else None)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, _params())]
    assert llm.engine.pools.blocks.num_used == 0 and llm.engine.pools.slots.num_used == 0
    return outs, llm.engine


def _check_answers(outs):
    assert json.loads(outs[0].text) is not None
    for o in outs[:2]:
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert re.fullmatch(REGEX, outs[2].text)
    assert outs[3].text in CHOICES
    assert all(o.finish_reason == "stop" for o in outs[:4])


def test_mtp_under_grammar_equals_k0(monkeypatch):
    """k = 2 through the decode graphs' padded path (verify rows masked, acceptance on the device) gives the k = 0
    engine's tokens for greedy and seeded constrained requests beside an unconstrained one; drafts the grammar or
    the target refused were rejected and rolled back along the way."""
    base, _ = _run(0, False)
    _check_answers(base)
    spec, engine = _run(2, True)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    stats = engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens

    # a batch with no constrained row does no mask work
    monkeypatch.setattr(engine.masks, "apply", lambda *a: pytest.fail("masked an unconstrained batch"))
    engine.add_request("plain", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0))
    while engine.has_work():
        engine.step()


def test_after_think_constraint_starts_after_the_reasoning():
    """`after_think`: any text (tags and half tags included) up to the first `</think>`, blank lines, then the
    constraint; the mask after the reasoning is the constraint's own start mask."""
    compiler = GrammarCompiler(TINY, 4096, [2])
    so = StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)
    tok = compiler._ll()
    m = compiler.matcher(StructuredOutputs(json=so.json, disable_any_whitespace=True, after_think=True))
    thought = tok.tokenize_str('Hmm {"ok": <th </thin> x</think>\n\n')
    assert m.consume_tokens(thought)
    start = np.frombuffer(compiler.matcher(so).compute_bitmask(), dtype=np.int32)[:128].copy()
    after = np.frombuffer(m.compute_bitmask(), dtype=np.int32)[:128].copy()
    assert _allowed(start, 4096) <= _allowed(after, 4096)  # the constraint's start (and more blank lines)
    assert not m.is_accepting() and m.consume_tokens(tok.tokenize_str('{"ok":true,"n":5,"tag":"red","s":""}'))
    assert m.is_accepting()


@pytest.fixture(scope="module")
def llm_k2():
    return LLM(TINY, max_num_seqs=8, max_model_len=256, block_size=4,
               speculative_config={"num_speculative_tokens": 2})


def _idle(llm):
    assert llm.engine.pools.blocks.num_used == 0 and llm.engine.pools.slots.num_used == 0


def test_resumed_matcher_continues_the_output(llm_k2):
    """Decode failover re-places a request with its output so far appended to the prompt (`resumed_tokens`): the
    new matcher starts after those tokens, so the greedy continuation is the rest of the uninterrupted answer
    (which a fresh matcher, back at the grammar's start, would not allow). Tokens the grammar refuses, or more of
    them than the prompt has, are a ValueError before the request takes a seat."""
    json_so = StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)
    prompt = llm_k2.tokenizer.encode("The sea is")
    full = llm_k2.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=48, temperature=0.0,
                                                                     structured_outputs=json_so))[0].outputs[0]
    jsonschema.validate(json.loads(full.text), SCHEMA)
    ids = full.token_ids
    cuts = [1, len(ids) // 2, len(ids) - 1]
    resumed = [SamplingParams(max_tokens=48 - m, temperature=0.0,
                              structured_outputs=StructuredOutputs(json=SCHEMA, disable_any_whitespace=True,
                                                                   resumed_tokens=m)) for m in cuts]
    outs = llm_k2.generate([{"prompt_token_ids": prompt + ids[:m]} for m in cuts], resumed)
    for m, o in zip(cuts, outs):
        assert ids[:m] + o.outputs[0].token_ids == ids and o.outputs[0].finish_reason == "stop", m
    for so, words in ((StructuredOutputs(json=SCHEMA, resumed_tokens=len(prompt) + 1), "exceeds the prompt"),
                      (StructuredOutputs(choice=CHOICES, resumed_tokens=2), "do not follow")):
        with pytest.raises(ValueError, match=words):
            llm_k2.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, structured_outputs=so))
    _idle(llm_k2)


def test_min_tokens_yields_to_a_grammar_that_can_only_end(llm_k2):
    """min_tokens past the grammar's end: once only EOS can follow, EOS is not suppressed and ends the request
    ("stop", EOS the last token); a grammar that can still go on (more digits) goes on until min_tokens, validly.
    Greedy and seeded, beside an unconstrained min_tokens request that is held to it."""
    eos = llm_k2.engine.cfg.eos_token_ids
    digits = r"[a-c]{2}-\d+"
    params = [SamplingParams(max_tokens=12, min_tokens=10, temperature=0.0,
                             structured_outputs=StructuredOutputs(choice=CHOICES)),
              SamplingParams(max_tokens=12, min_tokens=10, temperature=1.0, seed=5,
                             structured_outputs=StructuredOutputs(regex=REGEX)),
              SamplingParams(max_tokens=90, min_tokens=60, temperature=0.0,
                             structured_outputs=StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)),
              SamplingParams(max_tokens=12, min_tokens=10, temperature=0.0,
                             structured_outputs=StructuredOutputs(regex=digits)),
              SamplingParams(max_tokens=12, min_tokens=10, temperature=0.0)]
    outs = [o.outputs[0] for o in llm_k2.generate(PROMPTS, params)]
    assert outs[0].text in CHOICES and re.fullmatch(REGEX, outs[1].text), outs
    jsonschema.validate(json.loads(outs[2].text), SCHEMA)
    for o, least in zip(outs[:3], (10, 10, 60)):
        assert o.finish_reason == "stop" and o.token_ids[-1] in eos and len(o.token_ids) < least, o
    assert re.fullmatch(digits, outs[3].text) and len(outs[3].token_ids) >= 10, outs[3]
    assert len(outs[4].token_ids) >= 10
    _idle(llm_k2)


def test_max_tokens_mid_json_ends_with_length(llm_k2):
    """A schema's answer cut by max_tokens: "length", what came is the start of the object, and the engine goes
    on serving."""
    so = StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)
    out = llm_k2.generate("The sea is", SamplingParams(max_tokens=4, temperature=0.0,
                                                       structured_outputs=so))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4 and out.text.startswith('{"'), out
    with pytest.raises(ValueError):
        json.loads(out.text)
    _idle(llm_k2)


def test_emulated_acceptance_forces_only_drafts_the_grammar_allows():
    """`emulated_acceptance` (benchmark mode) takes drafts whatever the target samples, but a constrained
    request's only as far as its grammar allows them: every answer still validates, and drafts are still forced
    (acceptance above what the same batch gets without emulation)."""
    rates = {}
    for emulated in (None, (1.0, 1.0)):
        llm = LLM(TINY, max_num_seqs=8, max_model_len=256, block_size=4, emulated_acceptance=emulated,
                  speculative_config={"num_speculative_tokens": 2})
        outs = [o.outputs[0] for o in llm.generate(PROMPTS[:4], _params()[:4])]
        _check_answers(outs)
        _idle(llm)
        stats = llm.engine.spec_stats
        rates[emulated] = stats.num_accepted_tokens / stats.num_draft_tokens
    assert rates[(1.0, 1.0)] > rates[None], rates
