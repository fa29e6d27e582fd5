"""Byte-level BPE for tandem-tiny, trained with HF `tokenizers` on the training split of ShareGPT.

Special tokens first (0 `<|endoftext|>`, 1 `<|im_start|>`, 2 `<|im_end|>`), then the 256 byte symbols, then merges
up to the vocabulary size. Digits are split one by one before the byte-level (GPT-2 style) split. Saved as an HF
`tokenizer.json` plus a `tokenizer_config.json` holding the Qwen-style chat template; eos is `<|im_end|>`.

    python -m training.tokenizer --out models/tandem-tiny --vocab-size 4096
"""

from __future__ import annotations

import argparse
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from training.data import CHAT_TEMPLATE, EOT, IM_END, SPECIAL_TOKENS, load_conversations, split, training_text


def train_tokenizer(texts, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def save(tok: Tokenizer, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    added = {str(i): {"content": t, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False,
                      "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": EOT,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/tandem-tiny")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    train, _ = split(load_conversations(), seed=args.seed)
    tok = train_tokenizer((training_text(c) for c in train), args.vocab_size)
    save(tok, args.out)
    print(f"vocab {tok.get_vocab_size()} -> {args.out}/tokenizer.json")


if __name__ == "__main__":
    main()
