"""Tokenizer from a model directory (HF `tokenizer.json`), or None when the model has none (presets)."""

from __future__ import annotations

import os


def load_tokenizer(model_dir: str | None):
    if model_dir is None or not os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
