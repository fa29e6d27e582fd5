"""Qwen3's thinking split from the answer (router/reasoning.py), on outputs written from the format's description,
fed whole, cut at every point, and cut at many random points: the split never depends on where the stream broke."""

import random

import pytest

from router.reasoning import ReasoningParser, prompt_opens_think


def split(text: str, cuts, prompt_in_think: bool) -> tuple[str, str]:
    p = ReasoningParser(prompt_in_think)
    reasoning, content = [], []
    bounds = [0, *sorted(cuts), len(text)]
    for a, b in zip(bounds, bounds[1:]):
        r, c = p.feed(text[a:b])
        reasoning.append(r)
        content.append(c)
    r, c = p.finish()
    return "".join(reasoning) + r, "".join(content) + c


def every_split(text: str, prompt_in_think: bool) -> list[tuple[str, str]]:
    rng = random.Random(len(text))
    outs = [split(text, [], prompt_in_think)]
    outs += [split(text, [i], prompt_in_think) for i in range(1, len(text))]
    outs += [split(text, rng.sample(range(1, len(text)), min(len(text) - 1, k)), prompt_in_think)
             for k in (2, 3, 5, 9) for _ in range(20)]
    outs.append(split(text, range(1, len(text)), prompt_in_think))  # one character at a time
    return outs


CASES = [  # (prompt ends inside <think>, output, reasoning, content)
    (True, "The user greets me.\nI reply.\n</think>\n\nHello!", "The user greets me.\nI reply.\n", "Hello!"),
    (True, "short</think>answer", "short", "answer"),
    (True, "no end: the output ran out of tokens <", "no end: the output ran out of tokens <", ""),
    (True, "a </thin and not a tag</think>\n\nx </think> y", "a </thin and not a tag", "x </think> y"),
    (True, "</think>\n\nonly content", "", "only content"),
    (False, "<think>\nthinking\n</think>\n\nanswer", "\nthinking\n", "answer"),
    (False, "\n<think>t</think>a", "t", "a"),
    (False, "plain answer with <think> later", "", "plain answer with <think> later"),
    (False, "<thin", "", "<thin"),
    (False, "  ", "", "  "),
    (False, "answer </think> stays", "", "answer </think> stays"),
    (False, "数学 <think>", "", "数学 <think>"),
]


@pytest.mark.parametrize("in_think,text,reasoning,content", CASES)
def test_split_in_every_cut(in_think, text, reasoning, content):
    for got in every_split(text, in_think):
        assert got == (reasoning, content)


@pytest.mark.parametrize("prompt,opens", [
    ("<|im_start|>assistant\n<think>\n", True),
    ("<|im_start|>assistant\n<think>", True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # thinking disabled: an empty block
    ("<|im_start|>assistant\n", False),
])
def test_prompt_opens_think(prompt, opens):
    assert prompt_opens_think(prompt) is opens
