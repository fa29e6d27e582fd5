"""Tokenizes the ShareGPT split into flat uint16 token streams (one per side) plus the offsets where each
conversation starts, and writes the held-out chat prompts used to measure MTP acceptance.

    python -m training.prepare --tokenizer models/tandem-tiny --out .train_data

Writes train.bin, train_starts.npy, heldout.bin, heldout_starts.npy, eval_prompts.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from tokenizers import Tokenizer

from training.data import eval_prompts, load_conversations, split, training_text


def encode_stream(tok: Tokenizer, convs) -> tuple[np.ndarray, np.ndarray]:
    encs = tok.encode_batch([training_text(c) for c in convs], add_special_tokens=False)
    lens = np.array([len(e.ids) for e in encs], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    stream = np.fromiter((i for e in encs for i in e.ids), dtype=np.uint16, count=int(lens.sum()))
    return stream, starts


def prepare(tokenizer_dir: str, out: str, seed: int = 0, n_prompts: int = 256) -> None:
    t0 = time.time()
    os.makedirs(out, exist_ok=True)
    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    assert tok.get_vocab_size() <= 65536
    train, held = split(load_conversations(), seed=seed)
    for name, convs in (("train", train), ("heldout", held)):
        stream, starts = encode_stream(tok, convs)
        stream.tofile(os.path.join(out, f"{name}.bin"))
        np.save(os.path.join(out, f"{name}_starts.npy"), starts)
        print(f"{name}: {len(convs)} conversations, {len(stream)} tokens")
    with open(os.path.join(out, "eval_prompts.json"), "w") as f:
        json.dump(eval_prompts(held, n_prompts, seed=seed), f)
    print(f"prepared in {time.time() - t0:.1f}s -> {out}")


def load_stream(data_dir: str, name: str) -> tuple[np.ndarray, np.ndarray]:
    return (np.fromfile(os.path.join(data_dir, f"{name}.bin"), dtype=np.uint16),
            np.load(os.path.join(data_dir, f"{name}_starts.npy")))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="models/tandem-tiny")
    ap.add_argument("--out", default=".train_data")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    prepare(args.tokenizer, args.out, args.seed)


if __name__ == "__main__":
    main()
