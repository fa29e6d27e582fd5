"""Engine step benchmark: decode and verify step time per batch size next to the HBM floor of the bytes the step
must move, prefill throughput, and the same model in Hugging Face transformers as a peer.

    # CPU, tiny preset (the bandwidth is then a nominal figure and the ratios only indicative; on a shared CPU
    # OMP_NUM_THREADS=1 keeps oversubscribed OpenMP threads from stalling for whole seconds)
    .venv/bin/python benchmarks/step.py --model tiny-moe --batch-sizes 1,4 --k 0,2 --steps 5 --prefill 2x64 \
        --hf-peer
    # one H200
    python3 benchmarks/step.py --model qwen3.5-35b-a3b --dtype bfloat16 --batch-sizes 1,8,32 --k 0,2 \
        --prefill 8x2048 --hf-peer

Decode (`--k`, one run per value; k > 0 is MTP speculation with `--acceptance` emulated, as random weights would
accept nothing). With k = 0 a step is one token per request; with k > 0 it is one verify step over the k + 1 rows
of every request (last token + k drafts) followed by the MTP head's k drafting passes. --warmup-steps untimed steps
come first. Output tok/s counts the tokens the timed steps emitted (growth of every request's output_token_ids),
not steps * B; tok/step is that per request and step (the mean acceptance length when k > 0).

The floor is the bytes of one step at --bandwidth-gbs (4250 GB/s on the H200), with T = B * (k + 1) target rows:
  verify: every dense weight of the target model and the lm_head once, T embedding rows, the routed experts that T
    tokens are expected to touch under uniform routing (E * (1 - (1 - top_k/E)^T) per MoE layer), the KV of every
    attention layer read once per request over its context, the GDN recurrent state read and written once per
    request, and with k > 0 the kept GDN rows (k + 1 written, at most k + 1 replayed: `tandem/ops/gdn.py`).
  draft (k > 0 only): k passes of the MTP head, each reading its dense weights, the lm_head, the experts touched by
    B tokens (a lower bound: the first pass has 1 + accepted rows per request) and its KV once per request.
The MTP head's weights are not counted when k = 0 (it does not run). Conv states and KV writes are left out (small).

Mixed (`--mixed COUNTxLEN`, `--mixed-budget`): after each decode run, COUNT prompts of LEN tokens arrive while the
batch decodes; the steps until each has its first token are timed (a second round; the first compiles), with
their prompt tokens' rate beyond one decode step's time, and profiled under --profile.

Prefill (`--prefill COUNTxLEN,...`, k = 0): COUNT prompts of LEN random tokens added at once and stepped until every
request has its first token, with max_num_batched_tokens = min(COUNT * LEN, 16384) (or each of --prefill-budgets:
a served step's chunk budget), on an engine whose CUDA
graphs (the prefill graphs of up to 4096 rows) are captured first; timed on a second run of the same shapes (the
first one compiles kernels; its time is printed too). Reports prompt tokens/s. With --hf-peer and no --prefill the
shape is 32x256.

HF peer (`--hf-peer`): after Tandem's model is freed, transformers' model of the same config is built with random
weights directly on the device (`with torch.device(device): AutoModelForCausalLM.from_config(...)`, never on the
CPU first), in the same dtype. Decode step = the time difference of greedy `generate(use_cache=True)` calls with
2 and 2 + --steps new tokens (this cancels the prefill; the fastest of --hf-repeats calls of each length), at the
same batch sizes and prompt length; prefill = one forward (use_cache=True, logits of the last row only) over each
--prefill shape, after a warm-up forward. Speed-ups are Tandem tok/s over HF tok/s. The HF figures depend on the
fast paths transformers found (fla, causal_conv1d, its experts implementation; printed).

`--json PATH` writes every figure; the run ends with a summary block in the form of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tandem.config import EngineConfig, parse_dtype  # noqa: E402
from tandem.engine.engine import Engine  # noqa: E402
from tandem.engine.llm import build_model  # noqa: E402
from tandem.model.source import load_model, model_config  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.model.presets import PRESETS  # noqa: E402
from tandem.model.qwen3_5 import DecoderLayer  # noqa: E402
from tandem.ops import gdn  # noqa: E402
from tandem.ops.gdn import pending_width  # noqa: E402
from tandem.profiling import PREFIX  # noqa: E402
from trace_gaps import summarize  # noqa: E402  (this script's directory is on sys.path)

PREFILL_TOKEN_CAP = 16384
PROFILE_STEPS = 3
HF_DEFAULT_PREFILL = "32x256"  # the prefill shape of --hf-peer when --prefill is not given
HF_DECODE_BASE = 2  # new tokens of the shorter HF generate (prefill + 1 decode step), subtracted from the longer one


# ---------------------------------------------------------------------------------------------------------- floor


def touched_experts(cfg, tokens: int) -> float:
    """Expected number of distinct experts `tokens` tokens route to under uniform routing."""
    if not cfg.num_experts:
        return 0.0
    return cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** tokens)


def step_bytes(cfg, model, batch: int, context: float, dtype_bytes: int, k: int = 0) -> tuple[float, float]:
    """(verify bytes, draft bytes) of one step; see the module docstring. k = 0: a plain decode step, draft 0."""
    dense = {"target": 0, "mtp": 0}
    expert_layers = {"target": {}, "mtp": {}}  # layer prefix -> bytes of all its experts
    for name, p in model.named_parameters():
        part = "mtp" if name.startswith("mtp.") else "target"
        nbytes = p.numel() * p.element_size()
        if ".experts." in name:
            prefix = name.split(".experts.")[0]
            expert_layers[part][prefix] = expert_layers[part].get(prefix, 0) + nbytes
        else:
            dense[part] += nbytes
    table = cfg.vocab_size * cfg.hidden_size * dtype_bytes
    lm_head = table  # tied or not, computing logits reads a vocab x hidden matrix
    rows = batch * (k + 1)

    def experts(part: str, tokens: int) -> float:
        return sum(b / cfg.num_experts * touched_experts(cfg, tokens) for b in expert_layers[part].values())

    verify = dense["target"] + (lm_head if cfg.tie_word_embeddings else 0)  # an untied lm_head is a parameter
    verify += -table + rows * cfg.hidden_size * dtype_bytes  # embeddings: only the rows are read, not the table
    verify += experts("target", rows)
    kv_per_layer = 2 * context * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    ssm_bytes = 4 if cfg.ssm_dtype == torch.float32 else dtype_bytes
    state = len(cfg.gdn_layers) * cfg.gdn_num_v_heads * cfg.gdn_k_dim * cfg.gdn_v_dim * ssm_bytes
    kept_rows = len(cfg.gdn_layers) * pending_width(cfg.conv_dim, cfg.gdn_num_k_heads, cfg.gdn_k_dim,
                                                    cfg.gdn_num_v_heads, cfg.gdn_v_dim) * dtype_bytes
    verify += batch * (len(cfg.attention_layers) * kv_per_layer + 2 * state + (2 * (k + 1) * kept_rows if k else 0))
    if k == 0:
        return verify, 0.0
    mtp_pass = dense["mtp"] + lm_head + batch * cfg.hidden_size * dtype_bytes + experts("mtp", batch)
    mtp_pass += batch * cfg.num_mtp_layers * kv_per_layer
    return verify, k * mtp_pass


# --------------------------------------------------------------------------------------------------------- tandem


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def profiled(device: str, fn, rows: int = 30, trace: str | None = None, stacks: bool = False):
    """fn() under torch's profiler -> (its result, device-busy ms, kernels launched, the top-`rows` table); with
    `trace`, the Chrome trace is written there (with `stacks`, the Python stacks are recorded in it too)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                 with_stack=trace is not None and stacks) as prof:
        out = fn()
        synchronize(device)
    if trace:
        prof.export_chrome_trace(trace)
    events = prof.key_averages()
    # device events only: a CPU op that launched kernels from Python (fla's autograd Function) carries their time
    # as its own self device time too, which counted it twice (213.6 against 182.3 ms in a mixed-step profile)
    # and not the engine's named ranges (`tandem.profiling.phase`), whose device-side spans (a graph replay's
    # range holds the whole step) counted every kernel twice (25.6 ms "busy" in a 13.1 ms step)
    on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                 and not (getattr(e, "is_user_annotation", False) or e.key.startswith(PREFIX))]
    busy_ms = sum(e.self_device_time_total for e in on_device) / 1e3
    kernels = sum(e.count for e in on_device)
    table = events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=rows,
                         max_name_column_width=60)
    return out, busy_ms, kernels, table


def profile_steps(eng, steps: int, device: str, trace: str | None = None, stacks: bool = False) -> None:
    """Device time per step against wall time (the gap is host overhead), and the kernels that take it; with
    `trace`, also writes the Chrome trace there and prints where the device waited on the host."""
    _, busy_ms, kernels, table = profiled(device, lambda: [eng.step() for _ in range(steps)], trace=trace,
                                          stacks=stacks)
    if device.startswith("cuda"):
        print(f"  profiled: device busy {busy_ms / steps:.3f} ms per step, {kernels / steps:.0f} kernels per step")
    print(table)
    if trace:
        print(summarize(trace))


def trace_path(args, name: str) -> str | None:
    """Where --trace writes the Chrome trace `name` (None without --trace)."""
    return str(Path(args.trace) / name) if args.trace else None


def profile_prefill(eng, cfg, args, count: int, length: int) -> None:
    """The top kernels of one more prefill run of the shape, and how much of its wall time the device was busy."""
    r, busy_ms, _, table = profiled(args.device, lambda: tandem_prefill(eng, cfg, args, count, length), rows=25)
    if args.device.startswith("cuda"):
        print(f"  profiled: {r['ms']:.1f} ms wall (under the profiler), device busy {busy_ms:.1f} ms")
    print(table)


def host_profile_prefill(eng, cfg, args, count: int, length: int) -> None:
    """Where the host time of one more prefill run of the shape goes: cProfile's top functions by own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    r = tandem_prefill(eng, cfg, args, count, length)
    prof.disable()
    print(f"  host profile: {r['ms']:.1f} ms wall (under cProfile)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def prompt(i: int, length: int, vocab: int) -> list[int]:
    return [(7 * i + j) % vocab for j in range(length)]


def new_engine(cfg, model, args, ecfg: EngineConfig) -> Engine:
    """An engine over `model`, or with --tensor-parallel-size N > 1 over N ranks launched for it, as a serving
    worker launches them (each rank's cache pools follow the engine config); `release` stops them."""
    if args.tensor_parallel_size > 1:
        model = build_model(args.model, ecfg, tensor_parallel_size=args.tensor_parallel_size)[1]
    return Engine(cfg, model, ecfg)


def release(eng: Engine, args) -> None:
    """Stops the tensor-parallel ranks `new_engine` launched (nothing on one rank). Rank 0's engine goes with the
    caller's last reference; its blocks stay in this process's caching allocator for the next run's engine."""
    if args.tensor_parallel_size > 1:
        eng.runner.model.shutdown()


def tandem_decode(cfg, model, args, batch: int, k: int, rates: tuple[float, ...]) -> dict:
    """One engine of `batch` requests: prefill, --warmup-steps, then --steps timed decode (k = 0) or verify steps."""
    # nobody finishes inside the timed (or --profile) steps, even accepting every draft, though the first requests
    # start decoding while the last ones still prefill
    count, length = args.mixed or (0, 0)  # --mixed: prompts that arrive later, in three rounds
    budget = max(args.mixed_budget if count else 2048, batch * (k + 1))
    prefill_steps = -(-batch * args.prompt_len // budget)
    mixed_steps = 3 * (-(-count * length // (budget - batch * (k + 1))) + 1) if count else 0
    max_tokens = (prefill_steps + args.warmup_steps + args.steps + PROFILE_STEPS + mixed_steps + 4) * (k + 1)
    ecfg = EngineConfig(dtype=args.dtype, device=args.device, max_num_seqs=batch + count,
                        max_model_len=max(args.prompt_len + max_tokens, length) + k + 8, max_num_batched_tokens=budget,
                        num_speculative_tokens=k, emulated_acceptance=rates[:k] if k else None)
    eng = new_engine(cfg, model, args, ecfg)
    eng.capture_graphs()  # every bucket now, so no capture falls into the timed or profiled steps
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    seqs = []
    for i in range(batch):
        eng.add_request(str(i), prompt(i, args.prompt_len, cfg.vocab_size), params)
        seqs.append(eng.sequences[str(i)])
    while any(s.in_prefill or not s.output_token_ids for s in seqs):
        eng.step()
    for _ in range(args.warmup_steps):  # decode / verify shapes (kernel compiles, graph captures)
        eng.step()
    synchronize(args.device)
    before = sum(len(s.output_token_ids) for s in seqs)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    synchronize(args.device)
    seconds = time.perf_counter() - t0
    emitted = sum(len(s.output_token_ids) for s in seqs) - before
    ms = seconds / args.steps * 1e3
    context = args.prompt_len + (2 * before + emitted) / (2 * batch)  # mean over the timed steps
    dtype_bytes = torch.tensor([], dtype=ecfg.dtype).element_size()
    verify, drafting = step_bytes(cfg, eng.runner.model, batch, context, dtype_bytes, k)  # rank 0's: per GPU
    to_ms = 1e3 / (args.bandwidth_gbs * 1e9)
    row = dict(batch=batch, k=k, step_ms=ms, floor_ms=(verify + drafting) * to_ms, verify_floor_ms=verify * to_ms,
               draft_floor_ms=drafting * to_ms, context=context, emitted=emitted,
               tokens_per_step=emitted / (args.steps * batch), tok_s=emitted / seconds)
    row["ratio"] = ms / row["floor_ms"]
    split = f"   (floor: verify {verify * to_ms:.4f} + draft {drafting * to_ms:.4f})" if k else ""
    print(f"{batch:>5} {ms:>9.3f} {row['floor_ms']:>9.4f} {row['ratio']:>7.1f} {row['tokens_per_step']:>8.2f} "
          f"{row['tok_s']:>9.1f}{split}")
    if args.profile:
        profile_steps(eng, PROFILE_STEPS, args.device, trace_path(args, f"decode-B{batch}-k{k}.json.gz"),
                      args.trace_stacks)
    if args.mixed:
        row["mixed"] = tandem_mixed(eng, cfg, args, batch, ms)
    for s in seqs:
        eng.abort(s.request_id)
    release(eng, args)
    return row


def tandem_mixed(eng, cfg, args, batch: int, decode_ms: float) -> dict:
    """Mixed steps, as serving runs them: the running requests' decode (verify) rows plus the chunks of
    --mixed COUNT prompts of LEN tokens arriving together, stepped until each prompt has its first token. Three
    rounds: the first compiles, the second is timed, the third is profiled under --profile."""
    count, length = args.mixed
    rounds = []
    for rnd in range(3 if args.profile else 2):
        ids = [f"mixed-{rnd}-{i}" for i in range(count)]
        for i, rid in enumerate(ids):
            eng.add_request(rid, prompt(1000 * rnd + i, length, cfg.vocab_size),
                            SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0))
        waiting = [eng.sequences[r] for r in ids]

        def run():
            times = []
            while any(not s.output_token_ids for s in waiting):
                synchronize(args.device)
                t0 = time.perf_counter()
                eng.step()
                synchronize(args.device)
                times.append((eng.last_step.kind, eng.last_step.prompt_tokens, time.perf_counter() - t0))
            return times

        if rnd == 2:
            trace = trace_path(args, f"mixed-B{batch}-k{eng.ecfg.num_speculative_tokens}.json.gz")  # one per decode run
            times, busy_ms, _, table = profiled(args.device, run, trace=trace, stacks=args.trace_stacks)
            print(f"  mixed, profiled: {sum(t for _, _, t in times) * 1e3:.1f} ms wall over {len(times)} steps, "
                  f"device busy {busy_ms:.1f} ms")
            print(table)
            if trace:
                print(summarize(trace))
        else:
            times = run()
        for r in ids:
            eng.abort(r)
        rounds.append(times)
    mixed = [(n, t) for kind, n, t in rounds[1] if kind == "mixed"]
    res = dict(count=count, length=length, budget=eng.ecfg.max_num_batched_tokens, steps=len(mixed),
               step_ms=sum(t for _, t in mixed) / max(1, len(mixed)) * 1e3,
               prompt_tokens=sum(n for n, _ in mixed), cold_ms=sum(t for _, _, t in rounds[0]) * 1e3)
    # the prompt tokens' own rate: each mixed step less one decode step's time
    extra = sum(t for _, t in mixed) - len(mixed) * decode_ms / 1e3
    res["prompt_tok_s"] = res["prompt_tokens"] / extra if extra > 0 else float("inf")
    print(f"  mixed: {len(mixed)} steps of {batch} decode requests + {res['prompt_tokens'] / max(1, len(mixed)):.0f} "
          f"prompt tokens (budget {res['budget']}), {res['step_ms']:.1f} ms a step; prompt tokens at "
          f"{res['prompt_tok_s']:.0f} tok/s beyond the decode step (first round, compiling: {res['cold_ms']:.0f} ms)")
    return res


def prefill_engine(cfg, model, args, count: int, length: int, budget: int) -> tuple[Engine, float]:
    """An engine for `count` prompts of `length` tokens at a step budget of `budget` tokens, its CUDA graphs
    captured (as a serving worker does before it takes requests); returns it and the capture's seconds."""
    ecfg = EngineConfig(dtype=args.dtype, device=args.device, max_num_seqs=count, max_model_len=length + 8,
                        max_num_batched_tokens=budget)
    eng = new_engine(cfg, model, args, ecfg)
    t0 = time.perf_counter()
    eng.capture_graphs()
    return eng, time.perf_counter() - t0


def tandem_prefill(eng, cfg, args, count: int, length: int) -> dict:
    """`count` prompts added at once, stepped until each has its first token."""
    budget = eng.ecfg.max_num_batched_tokens
    gen = torch.Generator().manual_seed(count * 100003 + length)
    prompts = torch.randint(0, cfg.vocab_size, (count, length), generator=gen).tolist()
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    synchronize(args.device)
    t0 = time.perf_counter()
    seqs = []
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
        seqs.append(eng.sequences[str(i)])
    steps = 0
    while not all(s.output_token_ids for s in seqs):
        if not eng.has_work():
            raise RuntimeError("prefill: the engine ran out of work before every request had its first token")
        eng.step()
        steps += 1
    synchronize(args.device)
    seconds = time.perf_counter() - t0
    for s in seqs:
        eng.abort(s.request_id)
    return dict(count=count, length=length, budget=budget, steps=steps, ms=seconds * 1e3,
                tok_s=count * length / seconds)


# ------------------------------------------------------------------------------------------------------- HF peer


def hf_config(model: str):
    from transformers import AutoConfig

    if os.path.isdir(model):
        return AutoConfig.from_pretrained(model)
    d = dict(PRESETS[model])
    return AutoConfig.for_model(d.pop("model_type"), **d)


def hf_build(model: str, device: str, dtype: torch.dtype):
    """transformers' model with random weights, allocated and initialised on `device` (never on the CPU first)."""
    from transformers import AutoModelForCausalLM

    hcfg = hf_config(model)
    synchronize(device)
    t0 = time.perf_counter()
    with torch.device(device):
        net = AutoModelForCausalLM.from_config(hcfg, dtype=dtype)
    net.eval()
    synchronize(device)
    seconds = time.perf_counter() - t0
    where = {p.device.type for p in net.parameters()}
    if where != {torch.device(device).type}:
        raise RuntimeError(f"HF model parameters ended up on {where}, not {device}")
    return net, seconds


def hf_implementations(net) -> dict:
    cfg = net.config
    return dict(cls=type(net).__name__, attn=getattr(cfg, "_attn_implementation", None),
                experts=getattr(cfg, "_experts_implementation", None) if getattr(cfg, "num_experts", 0) else None,
                fla=importlib.util.find_spec("fla") is not None,
                causal_conv1d=importlib.util.find_spec("causal_conv1d") is not None)


@torch.inference_mode()
def hf_decode(net, args, batch: int, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, vocab, (batch, args.prompt_len), generator=gen).to(args.device)
    mask = torch.ones_like(ids)

    def generate(new_tokens: int) -> float:
        synchronize(args.device)
        t0 = time.perf_counter()
        out = net.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, use_cache=True, pad_token_id=0)
        synchronize(args.device)
        assert out.shape[1] == args.prompt_len + new_tokens, out.shape
        return time.perf_counter() - t0

    generate(HF_DECODE_BASE + args.steps)  # warm-up (the first calls are slow)
    # the best of a few interleaved calls each: a one-off stall in one call would otherwise land in the difference
    pairs = [(generate(HF_DECODE_BASE), generate(HF_DECODE_BASE + args.steps)) for _ in range(args.hf_repeats)]
    short, long = min(p[0] for p in pairs), min(p[1] for p in pairs)
    ms = (long - short) / args.steps * 1e3
    if ms <= 0:
        print(f"  warning: HF batch {batch}: the longer generate was not slower ({long:.3f} s vs {short:.3f} s); "
              "the machine is too noisy for this figure (raise --steps or --hf-repeats)")
    return dict(batch=batch, step_ms=ms, tok_s=batch / ms * 1e3)


@torch.inference_mode()
def hf_prefill(net, args, count: int, length: int, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(count * 100003 + length)
    ids = torch.randint(0, vocab, (count, length), generator=gen).to(args.device)
    net(input_ids=ids, use_cache=True, logits_to_keep=1)  # warm-up on the same shape: its kernels compile here
    synchronize(args.device)
    t0 = time.perf_counter()
    net(input_ids=ids, use_cache=True, logits_to_keep=1)
    synchronize(args.device)
    seconds = time.perf_counter() - t0
    return dict(count=count, length=length, ms=seconds * 1e3, tok_s=count * length / seconds)


# ---------------------------------------------------------------------------------------------------------- report


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        count, _, length = item.lower().partition("x")
        if not (count.isdigit() and length.isdigit()) or int(count) <= 0 or int(length) <= 0:
            raise SystemExit(f"--prefill: {item!r} is not COUNTxLENGTH (e.g. 8x2048)")
        shapes.append((int(count), int(length)))
    return shapes


def run_meta(args) -> dict:
    root = Path(__file__).resolve().parents[1]

    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    try:
        import transformers

        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else (platform.processor() or "cpu")
    return dict(date=datetime.date.today().isoformat(), commit=commit or None, device=args.device,
                device_name=device_name, torch=torch.__version__, transformers=hf_version,
                command="python3 benchmarks/step.py " + " ".join(sys.argv[1:]), model=args.model, dtype=args.dtype,
                prompt_len=args.prompt_len, steps=args.steps, bandwidth_gbs=args.bandwidth_gbs,
                acceptance=args.acceptance, warmup_steps=args.warmup_steps)


def speedups(res: dict) -> dict:
    hf = res.get("hf")
    if not hf:
        return {}
    hf_decode_by_b = {r["batch"]: r for r in hf["decode"]}
    hf_prefill_by_shape = {(r["count"], r["length"]): r for r in hf["prefill"]}
    return dict(
        decode=[dict(batch=r["batch"], k=r["k"], speedup=r["tok_s"] / hf_decode_by_b[r["batch"]]["tok_s"])
                for r in res["decode"] if r["batch"] in hf_decode_by_b],
        prefill=[dict(count=r["count"], length=r["length"], budget=r["budget"],
                      speedup=r["tok_s"] / hf_prefill_by_shape[(r["count"], r["length"])]["tok_s"])
                 for r in res["prefill"] if (r["count"], r["length"]) in hf_prefill_by_shape])


def print_summary(res: dict) -> None:
    m, hf, sp = res["meta"], res.get("hf"), res.get("speedup", {})
    hf_dec = {r["batch"]: r for r in hf["decode"]} if hf else {}
    hf_pre = {(r["count"], r["length"]): r for r in hf["prefill"]} if hf else {}
    sp_dec = {(r["batch"], r["k"]): r["speedup"] for r in sp.get("decode", [])}
    sp_pre = {(r["count"], r["length"], r["budget"]): r["speedup"] for r in sp.get("prefill", [])}
    print("\n===== summary (docs/BENCHMARKS.md) =====")
    print(f"{m['date']}, commit `{m['commit']}`, {m['device_name']} ({m['device']}), torch {m['torch']}, "
          f"transformers {m['transformers']}.\n")
    print(f"```\n{m['command']}\n```\n")
    print(f"Random-weight {m['model']} ({m['dtype']}) ready in {res['load_s']:.1f} s; {gdn_prefill_path()}"
          + (f"; HF {hf['impl']['cls']} ready in {hf['init_s']:.1f} s (attn {hf['impl']['attn']}, experts "
             f"{hf['impl']['experts']}, fla {'yes' if hf['impl']['fla'] else 'no'}, causal_conv1d "
             f"{'yes' if hf['impl']['causal_conv1d'] else 'no'})" if hf else "") + ".")
    k_max = max((r["k"] for r in res["decode"]), default=0)
    rates = ", ".join(m["acceptance"].split(",")[:k_max])
    acc = f"; k > 0 with emulated acceptance {rates} (per draft position)" if k_max else ""
    print(f"Decode, prompt {m['prompt_len']}, {m['steps']} timed steps, floor at {m['bandwidth_gbs']:.0f} GB/s{acc}:\n")
    head = "| batch | k | step ms | floor ms | ratio | tok/step | tok/s |"
    if hf:
        head += " HF step ms | HF tok/s | speed-up |"
    print(head)
    print("|" + "---:|" * (head.count("|") - 1))
    for r in res["decode"]:
        line = (f"| {r['batch']} | {r['k']} | {r['step_ms']:.3f} | {r['floor_ms']:.4f} | {r['ratio']:.1f} | "
                f"{r['tokens_per_step']:.2f} | {r['tok_s']:.1f} |")
        if hf:
            h = hf_dec.get(r["batch"])
            line += (f" {h['step_ms']:.3f} | {h['tok_s']:.1f} | {sp_dec[(r['batch'], r['k'])]:.2f}x |" if h
                     else " – | – | – |")
        print(line)
    mixed = [r for r in res["decode"] if "mixed" in r]
    if mixed:
        print("\nMixed steps (decode rows + arriving prompts' chunks, as served):\n")
        print("| batch | k | prompts x length | budget | steps | step ms | decode step ms | "
              "prompt tok/s beyond decode |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in mixed:
            m = r["mixed"]
            print(f"| {r['batch']} | {r['k']} | {m['count']} x {m['length']} | {m['budget']} | {m['steps']} | "
                  f"{m['step_ms']:.1f} | {r['step_ms']:.3f} | {m['prompt_tok_s']:.0f} |")
    if res["prefill"]:
        print("\nPrefill (k = 0), until every request has its first token:\n")
        head = "| prompts | length | budget | ms | prompt tok/s |" + (" HF ms | HF tok/s | speed-up |" if hf else "")
        print(head)
        print("|" + "---:|" * (head.count("|") - 1))
        for r in res["prefill"]:
            line = f"| {r['count']} | {r['length']} | {r['budget']} | {r['ms']:.1f} | {r['tok_s']:.0f} |"
            if hf:
                h = hf_pre[(r["count"], r["length"])]
                line += f" {h['ms']:.1f} | {h['tok_s']:.0f} | {sp_pre[(r['count'], r['length'], r['budget'])]:.2f}x |"
            print(line)
    print("=====")


# ------------------------------------------------------------------------------------------------------------ main


def gdn_prefill_path() -> str:
    """Without fla-core, prompt chunks run the recurrent kernel: 78 ms of a 122 ms mixed step on an H100, where
    fla's chunked kernel takes ~5; a run that lacks it must say so."""
    if gdn.HAS_FLA:
        return "GDN prefill: fla-core's chunked kernel"
    return ("GDN prefill: the recurrent kernel (fla-core is not installed; on a GPU the prefill and mixed figures "
            "then mislead)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-moe", help="a preset name or a checkpoint directory")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--k", default="0", help="speculative tokens per verify step, comma separated (0: plain decode)")
    ap.add_argument("--acceptance", default="0.84,0.66",
                    help="emulated acceptance probability of each draft position for k > 0 (needs at least k values)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps before the timed ones")
    ap.add_argument("--prefill", default="", help="prefill shapes COUNTxLENGTH, comma separated (e.g. 8x2048,32x256); "
                    f"with --hf-peer the default is {HF_DEFAULT_PREFILL}")
    ap.add_argument("--prefill-budgets", default="", help="step token budgets to run each prefill shape at, comma "
                    f"separated (default: min(count * length, {PREFILL_TOKEN_CAP}))")
    ap.add_argument("--mixed", type=lambda t: parse_shapes(t)[0], default=None, metavar="COUNTxLEN",
                    help="after each decode run, time the mixed steps of COUNT prompts of LEN tokens arriving while "
                    "the batch decodes (as served)")
    ap.add_argument("--mixed-budget", type=int, default=2048, help="the step token budget of --mixed")
    ap.add_argument("--hf-peer", action="store_true", help="also time Hugging Face transformers on the same model")
    ap.add_argument("--hf-repeats", type=int, default=3, help="HF generate calls of each length (the fastest counts)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bandwidth-gbs", type=float, default=4250.0, help="memory bandwidth for the floor")
    ap.add_argument("--profile", action="store_true", help="also print the top kernels of a few profiled steps")
    ap.add_argument("--host-profile", action="store_true", help="also print where a prefill run's host time goes")
    ap.add_argument("--trace", metavar="DIR", default=None,
                    help="implies --profile: the decode and mixed profiles write their Chrome traces here "
                         "(decode-B*-k*.json.gz, mixed-B*-k*.json.gz) and print where the device waited on the "
                         "host (benchmarks/trace_gaps.py), by the engine's named ranges (tandem/profiling.py)")
    ap.add_argument("--trace-stacks", action="store_true",
                    help="--trace records Python stacks too: the host's exact frames, but slowed so much that the "
                         "gaps move (a mixed step's trace then runs to tens of MB)")
    ap.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="ranks (GPUs) per engine, each run launching its own, as `tandem serve` does; floors per GPU")
    ap.add_argument("--quantizer-launches", action="store_true",
                    help="FP8: quantise each GEMM input by a launch of its own instead of in the kernel that "
                         "produced it (the norms, the attention output gate), to compare the two")
    args = ap.parse_args()
    if args.trace:
        args.profile = True
        Path(args.trace).mkdir(parents=True, exist_ok=True)

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    ks = [int(k) for k in args.k.split(",")]
    rates = tuple(float(r) for r in args.acceptance.split(",")) if args.acceptance else ()
    if max(ks) > len(rates):
        raise SystemExit(f"--acceptance: k = {max(ks)} needs {max(ks)} rates, got {len(rates)} ({args.acceptance!r})")
    shapes = parse_shapes(args.prefill or (HF_DEFAULT_PREFILL if args.hf_peer else ""))
    dtype = parse_dtype(args.dtype)
    res = dict(meta=run_meta(args), decode=[], prefill=[])

    synchronize(args.device)
    t0 = time.perf_counter()
    if args.tensor_parallel_size > 1:  # each run launches its ranks (`new_engine`)
        if args.quantizer_launches:
            raise SystemExit("--quantizer-launches: FP8 compute does not run under tensor parallelism")
        cfg, model = model_config(args.model), None
    else:
        cfg, model, _ = load_model(args.model, args.device, dtype)
    if args.quantizer_launches:
        for layer in model.modules():
            if isinstance(layer, DecoderLayer):
                layer.quantize_in_producers(False)
    synchronize(args.device)
    res["load_s"] = time.perf_counter() - t0
    print(f"model={args.model} dtype={args.dtype} device={args.device} prompt={args.prompt_len} "
          f"floor bandwidth={args.bandwidth_gbs:.0f} GB/s (loaded in {res['load_s']:.1f} s); {gdn_prefill_path()}"
          + (f"; tensor parallel over {args.tensor_parallel_size} ranks, each run launching its own, floors per "
             "rank, no CUDA graphs" if args.tensor_parallel_size > 1 else ""))
    for k in ks:
        acc = f", emulated acceptance {rates[:k]}" if k else ""
        print(f"\ndecode k={k}{acc}" + (": a step verifies k+1 rows per request and drafts k" if k else ""))
        print(f"{'batch':>5} {'step ms':>9} {'floor ms':>9} {'ratio':>7} {'tok/step':>8} {'tok/s':>9}")
        for b in batch_sizes:
            res["decode"].append(tandem_decode(cfg, model, args, b, k, rates))  # prints its row
    if shapes:
        print(f"\nprefill (k=0), token budget {args.prefill_budgets or f'min(count*length, {PREFILL_TOKEN_CAP})'}")
        print(f"{'prompts':>7} {'length':>6} {'budget':>6} {'steps':>5} {'ms':>10} {'prompt tok/s':>12}")
        budgets = [int(b) for b in args.prefill_budgets.split(",")] if args.prefill_budgets else [None]
        for (count, length), budget in itertools.product(shapes, budgets):
            eng, capture_s = prefill_engine(cfg, model, args, count, length,
                                            budget or min(count * length, PREFILL_TOKEN_CAP))
            cold = tandem_prefill(eng, cfg, args, count, length)  # the same shapes once: kernel compiles
            r = tandem_prefill(eng, cfg, args, count, length)
            r["first_run_ms"], r["capture_s"] = cold["ms"], capture_s
            res["prefill"].append(r)
            print(f"{count:>7} {length:>6} {r['budget']:>6} {r['steps']:>5} {r['ms']:>10.1f} {r['tok_s']:>12.0f}   "
                  f"(first run, compiling: {cold['ms']:.0f} ms; graphs captured in {capture_s:.1f} s)")
            if args.profile:
                profile_prefill(eng, cfg, args, count, length)
            if args.host_profile:
                host_profile_prefill(eng, cfg, args, count, length)
            release(eng, args)
            del eng

    if args.hf_peer:
        vocab = cfg.vocab_size
        del model  # both models must fit one after the other
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
            print(f"\nTandem's model freed: {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated")
        import transformers

        transformers.logging.set_verbosity_error()  # the fast paths found are printed below instead
        net, init_s = hf_build(args.model, args.device, dtype)
        impl = hf_implementations(net)
        res["hf"] = dict(init_s=init_s, impl=impl, decode=[], prefill=[])
        print(f"\nHF peer: transformers {transformers.__version__} {impl['cls']} built on {args.device} in "
              f"{init_s:.1f} s; attn={impl['attn']} experts={impl['experts']} fla={impl['fla']} "
              f"causal_conv1d={impl['causal_conv1d']}")
        print(f"HF decode: generate({HF_DECODE_BASE} + {args.steps}) - generate({HF_DECODE_BASE}), greedy, use_cache, "
              f"best of {args.hf_repeats}")
        print(f"{'batch':>5} {'step ms':>9} {'tok/s':>9}")
        for b in batch_sizes:
            r = hf_decode(net, args, b, vocab)
            res["hf"]["decode"].append(r)
            print(f"{b:>5} {r['step_ms']:>9.3f} {r['tok_s']:>9.1f}")
        if shapes:
            print("HF prefill: one forward, use_cache, logits of the last row")
            print(f"{'prompts':>7} {'length':>6} {'ms':>10} {'prompt tok/s':>12}")
            for count, length in shapes:
                r = hf_prefill(net, args, count, length, vocab)
                res["hf"]["prefill"].append(r)
                print(f"{count:>7} {length:>6} {r['ms']:>10.1f} {r['tok_s']:>12.0f}")
        res["speedup"] = speedups(res)
        print("\nspeed-up (Tandem tok/s / HF tok/s)")
        for r in res["speedup"]["decode"]:
            print(f"  decode batch {r['batch']:>3} k={r['k']}: {r['speedup']:.2f}x")
        for r in res["speedup"]["prefill"]:
            print(f"  prefill {r['count']}x{r['length']} (budget {r['budget']}): {r['speedup']:.2f}x")

    print_summary(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
