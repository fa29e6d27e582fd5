"""Trains tandem-tiny (trunk + MTP head) on the tokenized ShareGPT stream and exports the checkpoint.

Loss = CE(main head, x_{p+1}) + sum_j w_j CE(MTP level j, x_{p+2}) + aux_coef * load-balancing loss, the MTP
levels as Tandem drafts with them (see training/model.py). AdamW, linear warm-up then cosine decay to 10 %, bf16
autocast on CUDA, fixed seed. Windows of --seq-len tokens: half start at a conversation start, half anywhere.

    python -m training.train --data .train_data --out models/tandem-tiny --steps 1500

`--steps auto` times --probe-steps steps first, picks the step count that fits --time-budget seconds and then
trains from scratch with it (the chosen count is printed: rerun with it for the same run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time

import numpy as np
import torch
import torch.nn.functional as F

from training.checkpoint import save_checkpoint, text_config
from training.model import TextConfig, TinyQwen35Moe
from training.prepare import load_stream

MTP_WEIGHTS = (0.5, 0.3, 0.2)


class Windows:
    """Seeded random windows of seq_len tokens from a token stream."""

    def __init__(self, stream: np.ndarray, starts: np.ndarray, seq_len: int, seed: int):
        self.stream, self.seq_len = stream, seq_len
        self.starts = starts[starts + seq_len <= len(stream)]
        self.rng = np.random.default_rng(seed)

    def batch(self, n: int) -> torch.Tensor:
        at_start = self.rng.random(n) < 0.5
        anywhere = self.rng.integers(0, len(self.stream) - self.seq_len + 1, n)
        conv = self.starts[self.rng.integers(0, len(self.starts), n)]
        offs = np.where(at_start, conv, anywhere)
        idx = offs[:, None] + np.arange(self.seq_len)[None]
        return torch.from_numpy(self.stream[idx].astype(np.int64))


def losses(model: TinyQwen35Moe, ids: torch.Tensor, levels: int = 3):
    """ids [B, L]: (main CE, [MTP CE per level], aux, [MTP-vs-main argmax agreement per level])."""
    h, aux = model.trunk(ids)
    logits = model.logits(h)
    main = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    outs, aux_m = model.mtp_levels(h, ids, levels)
    mtp, agree = [], []
    target_argmax = logits[:, 1:-1].argmax(-1)  # the main head's prediction of x_{p+2}
    for j, o in enumerate(outs, start=1):
        # level j is defined from position j-1 on; row p predicts x_{p+2}
        lg = model.logits(o[:, j - 1 : -1])
        mtp.append(F.cross_entropy(lg.flatten(0, 1).float(), ids[:, j + 1 :].flatten()))
        agree.append((lg.argmax(-1) == target_argmax[:, j - 1 :]).float().mean())
    n_moe = len(model.model.layers) + 1
    return main, mtp, (aux + aux_m) / n_moe, agree


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def build(args, device):
    torch.manual_seed(args.seed)
    text = text_config()
    model = TinyQwen35Moe(TextConfig.from_hf(text))
    model.init_weights(args.seed)
    model.to(device)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device == "cuda")
    return text, model, opt


def train(args, steps: int, device: str, log=print, probe: bool = False, deadline: float | None = None):
    """Returns (text config, model, seconds, history, steps run). A probe returns the seconds per step of its
    second half instead of the total. Past `deadline` (time.time()) the run stops early, as a safeguard."""
    text, model, opt = build(args, device)
    stream, starts = load_stream(args.data, "train")
    data = Windows(stream, starts, args.seq_len, args.seed)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)
    model.train()
    t0, tokens, history, t_mid, done = time.time(), 0, [], None, steps
    for step in range(steps):
        if probe and step == steps // 2:
            torch.cuda.synchronize() if device == "cuda" else None
            t_mid = time.time()
        if deadline is not None and time.time() > deadline:
            log(f"stopping early at step {step}: past the time limit")
            done = step
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, args.lr, min(args.warmup, max(1, steps // 10)))
        ids = data.batch(args.batch_size).to(device, non_blocking=True)
        with amp:
            main, mtp, aux, agree = losses(model, ids)
            loss = main + sum(w * m for w, m in zip(MTP_WEIGHTS, mtp)) + args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += ids.shape[0] * args.seq_len
        if not probe and (step % args.log_every == 0 or step == steps - 1):
            el = time.time() - t0
            rec = {"step": step, "loss": loss.item(), "main": main.item(), "mtp": [m.item() for m in mtp],
                   "agree": [a.item() for a in agree], "aux": aux.detach().item(), "gnorm": gnorm.item(),
                   "lr": opt.param_groups[0]["lr"], "elapsed_s": round(el, 1), "tok_per_s": round(tokens / el)}
            history.append(rec)
            log(f"step {step:5d} loss {rec['loss']:.3f} main {rec['main']:.3f} mtp "
                + " ".join(f"{m:.3f}" for m in rec["mtp"]) + " agree " + " ".join(f"{a:.2f}" for a in rec["agree"])
                + f" aux {rec['aux']:.3f} |g| {rec['gnorm']:.2f} lr {rec['lr']:.2e} {el:.0f}s {tokens / el:,.0f} tok/s")
    if device == "cuda":
        torch.cuda.synchronize()
    if probe:
        return text, model, (time.time() - t_mid) / (steps - steps // 2), history, done
    return text, model, time.time() - t0, history, done


@torch.no_grad()
def heldout_eval(model: TinyQwen35Moe, data_dir: str, seq_len: int, device: str, max_windows: int, batch: int = 16):
    """Perplexity of the main head over non-overlapping held-out windows, and per MTP level the teacher-forced
    top-1 accuracy and agreement with the main head's argmax; in fp32."""
    stream, _ = load_stream(data_dir, "heldout")
    n = min(max_windows, (len(stream) - 1) // seq_len)
    wins = torch.from_numpy(stream[: n * seq_len].astype(np.int64)).view(n, seq_len)
    nll, count, acc, agr, cnt_m = 0.0, 0, [0.0] * 3, [0.0] * 3, [0] * 3
    model.eval()
    for i in range(0, n, batch):
        ids = wins[i : i + batch].to(device)
        h, _ = model.trunk(ids)
        logits = model.logits(h).float()
        nll += F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
        count += ids[:, 1:].numel()
        main_arg = logits[:, 1:-1].argmax(-1)
        outs, _ = model.mtp_levels(h, ids, 3)
        for j, o in enumerate(outs, start=1):
            pred = model.logits(o[:, j - 1 : -1]).argmax(-1)
            acc[j - 1] += (pred == ids[:, j + 1 :]).sum().item()
            agr[j - 1] += (pred == main_arg[:, j - 1 :]).sum().item()
            cnt_m[j - 1] += pred.numel()
    return {"windows": n, "seq_len": seq_len, "tokens": count, "perplexity": math.exp(nll / count),
            "mtp_top1_accuracy": [a / c for a, c in zip(acc, cnt_m)],
            "mtp_agreement_with_main": [a / c for a, c in zip(agr, cnt_m)]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=".train_data")
    ap.add_argument("--out", default="models/tandem-tiny")
    ap.add_argument("--tokenizer", default="models/tandem-tiny", help="directory whose tokenizer files are copied")
    ap.add_argument("--steps", default="1500", help="an integer, or 'auto' (see --time-budget)")
    ap.add_argument("--time-budget", type=float, default=300.0, help="seconds of training for --steps auto")
    ap.add_argument("--probe-steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-windows", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = args.device
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    t_start = time.time()
    deadline = None
    if args.steps == "auto":
        # the first steps include warm-up costs: the probe times its second half
        _, _, per_step, _, _ = train(args, args.probe_steps, device, probe=True)
        steps = max(10, min(100_000, int(args.time_budget / per_step)))
        print(f"probe: {per_step * 1000:.0f} ms/step -> --steps {steps} for a {args.time_budget:.0f}s budget")
        deadline = time.time() + 1.25 * args.time_budget + 30
    else:
        steps = int(args.steps)
    text, model, secs, history, steps = train(args, steps, device, deadline=deadline)
    print(f"trained {steps} steps in {secs:.1f}s")

    size = save_checkpoint(model, text, args.out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        src, dst = os.path.join(args.tokenizer, f), os.path.join(args.out, f)
        if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(dst):
            shutil.copy(src, dst)
    # evaluate what ships: the bf16-rounded weights, in fp32
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    ev = heldout_eval(model.float(), args.data, args.seq_len, device, args.eval_windows)
    params = sum(p.numel() for p in model.parameters())
    report = {"steps": steps, "train_seconds": round(secs, 1), "wall_seconds": round(time.time() - t_start, 1),
              "batch_size": args.batch_size, "seq_len": args.seq_len,
              "tokens_seen": steps * args.batch_size * args.seq_len,
              "params": params, "safetensors_bytes": size, "device": torch.cuda.get_device_name() if device == "cuda"
              else "cpu", "torch": torch.__version__, "args": vars(args) | {"steps": steps}, "heldout": ev,
              "history": history}
    with open(os.path.join(args.out, "train_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"held-out perplexity {ev['perplexity']:.2f} over {ev['tokens']} tokens; MTP top-1 "
          + " ".join(f"{a:.3f}" for a in ev["mtp_top1_accuracy"]) + "; agreement with main "
          + " ".join(f"{a:.3f}" for a in ev["mtp_agreement_with_main"]))
    print(f"{params:,} parameters, model.safetensors {size / 1e6:.1f} MB -> {args.out}")


if __name__ == "__main__":
    main()
