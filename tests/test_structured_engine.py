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
