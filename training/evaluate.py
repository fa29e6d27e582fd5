"""Held-out perplexity and MTP acceptance per draft position of a tandem-tiny checkpoint.

Acceptance runs Tandem's own engine (`LLM(..., speculative_config={"method": "mtp", "num_speculative_tokens": k})`,
greedy) over held-out chat prompts and reads the spec counters: position i's rate is the share of verify steps
whose first i+1 drafts were all accepted (`accepted_per_position[i] / num_drafts`, as vLLM reports it).
Perplexity runs the training model (pinned equal to Tandem by training/check.py) over held-out windows.

    python -m training.evaluate --model models/tandem-tiny --data .train_data --num-prompts 64
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from safetensors.torch import load_file

from training.model import TextConfig, TinyQwen35Moe


def load_training_model(model_dir: str, device: str = "cpu") -> TinyQwen35Moe:
    with open(os.path.join(model_dir, "config.json")) as f:
        text = json.load(f)["text_config"]
    model = TinyQwen35Moe(TextConfig.from_hf(text))
    sd = {("model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k): v.float()
          for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()}
    model.load_state_dict(sd, strict=True)
    return model.to(device).eval()


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def acceptance(model_dir: str, prompts: list[list[dict]], k: int = 3, max_tokens: int = 128, device: str | None = None,
               max_num_seqs: int = 64) -> dict:
    from tandem import LLM, SamplingParams

    llm = LLM(model=model_dir, device=device, max_num_seqs=max_num_seqs, max_model_len=2048,
              speculative_config={"method": "mtp", "num_speculative_tokens": k})
    ids = [chat_prompt_ids(llm.tokenizer, p) for p in prompts]
    t0 = time.time()
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(max_tokens=max_tokens, temperature=0.0))
    secs = time.time() - t0
    st = llm.engine.spec_stats
    return {
        "prompts": len(prompts), "k": k, "max_tokens": max_tokens, "seconds": round(secs, 1),
        "num_drafts": st.num_drafts, "num_draft_tokens": st.num_draft_tokens,
        "num_accepted_tokens": st.num_accepted_tokens,
        "acceptance_per_position": [a / st.num_drafts if st.num_drafts else 0.0 for a in st.accepted_per_position],
        "acceptance_rate": st.acceptance_rate, "acceptance_length": st.acceptance_length,
        "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "samples": [o.outputs[0].text for o in outs[:3]],
    }


def print_table(acc: dict, ppl: dict | None = None) -> None:
    if ppl is not None:
        print(f"held-out perplexity: {ppl['perplexity']:.2f} ({ppl['tokens']} tokens, {ppl['windows']} windows of "
              f"{ppl['seq_len']})")
    print(f"MTP acceptance over {acc['prompts']} held-out prompts, greedy, k = {acc['k']}, "
          f"{acc['num_drafts']} verify steps, {acc['generated_tokens']} tokens:")
    print("| position | acceptance |")
    print("|---:|---:|")
    for i, a in enumerate(acc["acceptance_per_position"], start=1):
        print(f"| {i} | {a:.3f} |")
    print(f"draft acceptance rate {acc['acceptance_rate']:.3f}, mean acceptance length {acc['acceptance_length']:.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tandem-tiny")
    ap.add_argument("--data", default=".train_data", help="prepared data (held-out stream and eval_prompts.json)")
    ap.add_argument("--prompts", default=None, help="a JSON list of chat prompts (default: DATA/eval_prompts.json)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--ppl-windows", type=int, default=256, help="0: skip perplexity")
    ap.add_argument("--device", default=None)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ppl = None
    if args.ppl_windows:
        from training.train import heldout_eval

        ppl = heldout_eval(load_training_model(args.model, device), args.data, 1024, device, args.ppl_windows)
    with open(args.prompts or os.path.join(args.data, "eval_prompts.json")) as f:
        prompts = json.load(f)[: args.num_prompts]
    acc = acceptance(args.model, prompts, args.k, args.max_tokens, device)
    print_table(acc, ppl)
    for s in acc["samples"]:
        print("---\n" + s[:400])
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"heldout": ppl, "acceptance": acc}, f, indent=1)


if __name__ == "__main__":
    main()
