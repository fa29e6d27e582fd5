"""The OpenAI-compatible HTTP endpoint (router/http.py) in front of `tandem serve`, driven by the official `openai`
client and by raw HTTP: completions and chat, streaming and not, n, logprobs, usage, stop, errors, disconnects.

The model is a checkpoint directory: the tiny-moe preset's config, random weights in the official layout and a
small byte-level BPE tokenizer (vocab 512) with a ChatML template, so the text and chat paths run for real."""

import json
import os
import threading
import time
from types import SimpleNamespace

import openai
import pytest
import requests
import torch
from safetensors.torch import save_file

from cluster import Cluster, assert_idle
from router.cors import Cors
from router.http import start_http_server
from tandem.model.presets import PRESETS, preset_config, random_model
from tandem.tokenizer import load_tokenizer
from test_detokenizer import byte_level_tokenizer

ENGINE = ["--dtype", "float32", "--num-speculative-tokens", "2", "--block-size", "4", "--max-model-len", "256",
          "--max-num-seqs", "8", "--max-num-batched-tokens", "64"]
MAX_MODEL_LEN = 256
ORIGIN = "http://app.example"


def make_text_model_dir(path) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(PRESETS["tiny-moe"], f)
    model = random_model(preset_config("tiny-moe"), "cpu", torch.float32, seed=0)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(path, "model.safetensors"))
    byte_level_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model_dir(tmp_path_factory.mktemp("text-model"))


@pytest.fixture(scope="module")
def server(model_dir):
    # the router's own HTTP endpoint (tandem serve --http-port), with CORS for one origin
    cluster = Cluster("--model", model_dir, "--served-model-name", "text-model", "--allowed-origins",
                      f'["{ORIGIN}"]', *ENGINE)
    tok = load_tokenizer(model_dir)
    try:
        yield cluster, SimpleNamespace(port=int(cluster.http.rsplit(":", 1)[1])), tok
    finally:
        assert cluster.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    _, http, _ = server
    return openai.OpenAI(base_url=f"http://127.0.0.1:{http.port}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def url(server):
    return f"http://127.0.0.1:{server[1].port}"


GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})


def test_models_and_health(client, url):
    models = client.models.list()
    assert [m.id for m in models.data] == ["text-model"]
    assert requests.get(url + "/health", timeout=10).status_code == 200
    assert requests.get(url + "/v1/models", timeout=10).json()["data"][0]["root"] == "text-model"  # vLLM's bench


def test_completions_text_and_stream(client, server):
    cluster, _, tok = server
    out = client.completions.create(model="text-model", prompt="hello world", **GREEDY)
    choice = out.choices[0]
    assert out.object == "text_completion" and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(tok.encode("hello world")) and out.usage.completion_tokens == 12
    # the same request over gRPC: the HTTP layer only translates
    from tandem import SamplingParams
    ref = cluster.client.generate_unary("hello world", SamplingParams(max_tokens=12, temperature=0.0,
                                                                      ignore_eos=True), timeout=60)
    assert choice.text == tok.decode(list(ref.token_ids), skip_special_tokens=True)
    chunks = list(client.completions.create(model="text-model", prompt="hello world", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completions_token_prompts_n_and_logprobs(client):
    out = client.completions.create(model="text-model", prompt=[[5, 6, 7], [8, 9]], n=2, logprobs=3,
                                    max_tokens=5, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 20
    for c in out.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        # 3 or 4 (the sampled token when outside the top 3), fewer where byte tokens share a string ("\ufffd")
        assert all(1 <= len(t) <= 4 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs), lp
    # seeded: the same request gives the same choices; the n choices of one prompt got different seeds
    again = client.completions.create(model="text-model", prompt=[[5, 6, 7], [8, 9]], n=2, logprobs=3,
                                      max_tokens=5, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    key = lambda r: sorted((c.index, c.logprobs.tokens) for c in r.choices)  # noqa: E731
    assert key(out) == key(again)
    by_index = {c.index: c for c in out.choices}
    assert by_index[0].logprobs.tokens != by_index[1].logprobs.tokens


def test_chat_and_stream(client, server):
    _, _, tok = server
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    out = client.chat.completions.create(model="text-model", messages=messages, logprobs=True, top_logprobs=2,
                                         max_completion_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    c = out.choices[0]
    assert out.object == "chat.completion" and c.message.role == "assistant" and c.finish_reason == "length"
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))
    assert len(c.logprobs.content) == 8 and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert "".join(t.token for t in c.logprobs.content) == c.message.content
    chunks = list(client.chat.completions.create(model="text-model", messages=messages, stream=True,
                                                 max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.message.content
    assert chunks[-1].usage.completion_tokens == 8


def test_chat_default_max_tokens_fills_context(client):
    out = client.chat.completions.create(model="text-model", messages=[{"role": "user", "content": "hi"}],
                                         temperature=0.0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.total_tokens == MAX_MODEL_LEN - 2  # the room left by the 2 speculative tokens


def test_stop_strings(client):
    base = client.completions.create(model="text-model", prompt="the quick", **GREEDY).choices[0].text
    assert len(base) >= 4
    stop = base[2:4]
    out = client.completions.create(model="text-model", prompt="the quick", stop=[stop, "\x00"], **GREEDY)
    c = out.choices[0]
    assert c.text == base[:base.find(stop)] and c.finish_reason == "stop"


def test_errors(client, url):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="text-model", prompt="x", max_tokens=MAX_MODEL_LEN)
    assert "max_model_len" in e.value.message
    with pytest.raises(openai.BadRequestError):  # a validation error on a stream still answers 400
        list(client.completions.create(model="text-model", prompt=[600], stream=True))
    r = requests.post(url + "/v1/completions", json={"prompt": "x", "temperature": "hot"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = requests.post(url + "/v1/completions", data=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = requests.post(url + "/v1/chat/completions", json={"messages": []}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_tokenize_and_detokenize(server, url):
    """vLLM's tokenizer routes (its `bench serve` aligns prompts through them): the model's own tokenizer."""
    _, _, tok = server
    r = requests.post(url + "/tokenize", timeout=10,
                      json={"model": "text-model", "prompt": "Hello there", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello there") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN and r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    messages = [{"role": "user", "content": "hi"}]
    r = requests.post(url + "/tokenize", json={"messages": messages}, timeout=10).json()
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert r["tokens"] == tok.encode(want, add_special_tokens=False)
    r = requests.post(url + "/detokenize", json={"tokens": tok.encode("Hello there")}, timeout=10).json()
    assert r["prompt"] == "Hello there"
    for path, body, param in [("/detokenize", {"tokens": [len(tok)]}, "tokens"), ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")]:
        r = requests.post(url + path, json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
    assert requests.post(url + "/tokenize", json={"model": "other", "prompt": "x"}, timeout=10).status_code == 404


def test_chat_needs_template(server):
    cluster, _, _ = server
    http = start_http_server(cluster.address, "127.0.0.1", 0, "text-model", None, MAX_MODEL_LEN)
    try:
        r = requests.post(f"http://127.0.0.1:{http.port}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10)
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    finally:
        http.stop()


def test_disconnect_cancels(server, url):
    cluster = server[0]
    body = {"prompt": [5, 6], "max_tokens": 200, "stream": True, "ignore_eos": True, "temperature": 0.0}
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith(b"data: {")
    # the client is gone after one chunk: the request must be aborted everywhere, nothing left allocated
    assert_idle(cluster)


def assert_openai_error(r, status: int, param=None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["Content-Type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    return err


SURROGATE = "\\ud800"  # JSON's escape of a lone surrogate: decodes to a str that protobuf and tokenizers refuse
BAD_BODIES = [  # (path, raw JSON body, the param named in the 400)
    ("/v1/completions", f'{{"prompt": "a{SURROGATE}b", "max_tokens": 2}}', "prompt"),
    ("/v1/completions", f'{{"prompt": ["ok", "{SURROGATE}"], "max_tokens": 2}}', "prompt"),
    ("/v1/completions", f'{{"prompt": [5], "stop": ["x{SURROGATE}"], "max_tokens": 2}}', "stop"),
    ("/v1/completions", f'{{"prompt": [5], "stop": "{SURROGATE}"}}', "stop"),
    ("/v1/completions", f'{{"prompt": [5], "user": "{SURROGATE}"}}', "user"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}', "messages"),
    ("/v1/chat/completions",
     f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "{SURROGATE}"}}]}}]}}', "messages"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "u{SURROGATE}", "content": "hi"}}]}}', "messages"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "hi", "name": "{SURROGATE}"}}]}}',
     "messages"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "hi"}}], "stop": ["{SURROGATE}"]}}', "stop"),
    ("/tokenize", f'{{"prompt": "{SURROGATE}"}}', "prompt"),
    ("/tokenize", f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}', "messages"),
    # integers past the proto field's type (uint32, int64)
    ("/v1/completions", '{"prompt": [5], "top_k": 4294967296}', "top_k"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "top_k": 4294967296}', "top_k"),
    ("/v1/completions", '{"prompt": [5, 4294967296]}', "prompt"),
    ("/v1/completions", '{"prompt": [[5], [4294967296]]}', "prompt"),
    ("/v1/completions", '{"prompt": [5], "stop_token_ids": [4294967296]}', "stop_token_ids"),
    ("/v1/completions", '{"prompt": [5], "seed": 9223372036854775808}', "seed"),
    ("/v1/completions", '{"prompt": [5], "max_tokens": 4294967296}', "max_tokens"),
    ("/v1/completions", '{"prompt": [5], "min_tokens": 4294967296}', "min_tokens"),
    ("/v1/completions", '{"prompt": [5], "n": 4294967296}', "n"),
    ("/v1/completions", '{"prompt": [5], "logprobs": 4294967296}', "logprobs"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4294967296}',
     "max_completion_tokens"),
    ("/v1/completions", '{"prompt": [5], "repetition_penalty": 1' + "0" * 400 + "}", "repetition_penalty"),
    ("/v1/completions", '{"prompt": [5], "temperature": NaN}', "temperature"),
    # nesting: past the parser's recursion limit, and past the endpoint's own bound
    ("/v1/completions", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", None),
    ("/v1/completions", '{"prompt": [5], "user": ' + "[" * 100 + "]" * 100 + "}", "user"),
    ("/v1/chat/completions", '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", None),
]


@pytest.mark.parametrize("path,body,param", BAD_BODIES, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD_BODIES)])
def test_bad_input_is_a_400_naming_the_field(url, path, body, param):
    r = requests.post(url + path, data=body.encode(), headers={"Content-Type": "application/json"}, timeout=30)
    assert_openai_error(r, 400, param)


def test_valid_unicode_passes(url, server):
    _, _, tok = server
    text = "héllo wörld, 你好 😀"  # non-ASCII, astral plane: valid, so not refused by the surrogate check
    r = requests.post(url + "/tokenize", json={"prompt": text}, timeout=10)
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode(text)
    r = requests.post(url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": text}], "max_tokens": 2, "stop": ["😀"]})
    assert r.status_code == 200, r.text


def test_prompt_over_max_model_len_is_a_400_naming_the_numbers(url, server):
    _, _, tok = server
    text = "the quick brown fox " * 100
    messages = [{"role": "user", "content": text}]
    chat_ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)
    for path, body, n, param in (
            ("/v1/chat/completions", {"messages": messages, "max_tokens": 1}, len(chat_ids), "messages"),
            ("/v1/completions", {"prompt": text, "max_tokens": 1}, len(tok.encode(text)), None)):
        assert n > MAX_MODEL_LEN
        err = assert_openai_error(requests.post(url + path, json=body, timeout=30), 400, param)
        assert str(MAX_MODEL_LEN) in err["message"] and str(n) in err["message"], err


def test_server_errors_are_openai_json(url, server):
    assert_openai_error(requests.get(url + "/v1/nothing", timeout=10), 404)
    assert_openai_error(requests.post(url + "/nothing", json={}, timeout=10), 404)
    r = requests.put(url + "/v1/completions", json={}, timeout=10)
    assert_openai_error(r, 405)
    assert r.headers["Allow"] == "POST"
    cluster = server[0]
    small = start_http_server(cluster.address, "127.0.0.1", 0, "text-model", None, MAX_MODEL_LEN, max_body_bytes=1000)
    try:
        r = requests.post(f"http://127.0.0.1:{small.port}/v1/completions", json={"prompt": [5] * 1000}, timeout=10)
        assert_openai_error(r, 413)
    finally:
        small.stop()


def test_metrics_on_the_http_port(url, server):
    """The router's own registry, the same families as on its --metrics-port."""
    cluster = server[0]
    r = requests.get(url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    families = lambda text: {ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE")}  # noqa: E731
    router_port = requests.get(f"http://{cluster.metrics[0]}/metrics", timeout=10).text
    assert families(r.text) == families(router_port) and "tandem:num_requests_waiting" in families(r.text)
    assert 'worker="router"' in r.text


def test_cors(url):
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "Authorization, Content-Type"}
    r = requests.options(url + "/v1/chat/completions", headers=pre, timeout=10)
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in r.headers["Access-Control-Allow-Methods"]
    assert {h.strip().lower() for h in r.headers["Access-Control-Allow-Headers"].split(",")} >= {"authorization",
                                                                                                  "content-type"}
    r = requests.options(url + "/v1/chat/completions", headers=dict(pre, Origin="http://evil.example"), timeout=10)
    assert r.status_code >= 400 and "Access-Control-Allow-Origin" not in r.headers
    r = requests.get(url + "/v1/models", headers={"Origin": ORIGIN}, timeout=10)
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
    r = requests.post(url + "/v1/completions", json={"prompt": 5}, headers={"Origin": ORIGIN}, timeout=10)
    assert r.status_code == 400 and r.headers["Access-Control-Allow-Origin"] == ORIGIN  # errors too
    with requests.post(url + "/v1/completions", json={"prompt": [5], "max_tokens": 2, "stream": True},
                       headers={"Origin": ORIGIN}, stream=True, timeout=30) as r:
        assert r.headers["Access-Control-Allow-Origin"] == ORIGIN and b"[DONE]" in r.content  # event streams too
    r = requests.get(url + "/v1/models", headers={"Origin": "http://evil.example"}, timeout=10)
    assert "Access-Control-Allow-Origin" not in r.headers
    assert "Access-Control-Allow-Origin" not in requests.get(url + "/v1/models", timeout=10).headers


def test_cors_preflight_needs_no_api_key(server):
    """Browsers send no credentials on a preflight: it is answered before the key check; a 401 still gets the
    origin header, so the page can read the error."""
    cluster = server[0]
    http = start_http_server(cluster.address, "127.0.0.1", 0, "text-model", None, MAX_MODEL_LEN, api_key="k",
                             cors=Cors(("*",)))
    base = f"http://127.0.0.1:{http.port}"
    try:
        r = requests.options(base + "/v1/models", timeout=10, headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "GET",
            "Access-Control-Request-Headers": "authorization"})
        assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "*"
        r = requests.get(base + "/v1/models", headers={"Origin": ORIGIN}, timeout=10)
        assert_openai_error(r, 401)
        assert r.headers["Access-Control-Allow-Origin"] == "*"
        r = requests.get(base + "/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer k"}, timeout=10)
        assert r.status_code == 200
    finally:
        http.stop()


def test_health_stays_quick_while_a_large_chat_is_tokenized(url):
    """A multi-megabyte chat body is templated and tokenized off the event loop: /health answers meanwhile."""
    content = "the quick brown fox jumps over the lazy dog, " * 80_000  # 3.6 MB, seconds of tokenization here
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 1}).encode()
    done = {}

    def big():
        t0 = time.monotonic()
        done["r"] = requests.post(url + "/v1/chat/completions", data=body, timeout=120,
                                  headers={"Content-Type": "application/json"})
        done["s"] = time.monotonic() - t0

    t = threading.Thread(target=big)
    t.start()
    latencies = []
    while t.is_alive() and len(latencies) < 1000:
        t0 = time.monotonic()
        assert requests.get(url + "/health", timeout=30).status_code == 200
        latencies.append(time.monotonic() - t0)
        time.sleep(0.05)
    t.join(120)
    print(f"\nchat {done['s']:.2f} s, {len(latencies)} /health probes meanwhile, slowest {max(latencies):.3f} s")
    assert max(latencies) < 1.0, (max(latencies), done["s"])
    assert done["s"] > 1.0 and len(latencies) >= 5, (done["s"], latencies)  # the probes overlapped the work
    err = assert_openai_error(done["r"], 400, "messages")
    assert "max_model_len" in err["message"]
