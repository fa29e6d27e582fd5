"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs) and OpenAI's `echo` on /v1/completions, as lm-eval's
`local-completions` loglikelihood tasks use them: the `LLM` against HF transformers on the shipped tandem-tiny
checkpoint (chunked prefill over several steps, a batch mixing requests with and without), then `tandem serve`
(disaggregated and colocated, started together) over HTTP with the official `openai` client and over gRPC against
the `LLM`, and the bad-input cases."""

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
import requests
import torch

from cluster import Cluster, assert_idle
from tandem import LLM, SamplingParams
from tandem.worker_setup import DEFAULT_MODEL

MODEL = DEFAULT_MODEL
TOL = 1e-4
BUDGET = 16  # max_num_batched_tokens: every prompt below but the shortest spans several prefill steps
ENGINE = ["--model", MODEL, "--served-model-name", "tiny", "--dtype", "float32", "--num-speculative-tokens", "2",
          "--block-size", "4", "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens",
          str(BUDGET)]
PROMPT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs, then sleep."


@pytest.fixture(scope="module")
def llm():
    return LLM(model=MODEL, max_num_batched_tokens=BUDGET, max_model_len=256, block_size=4)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


def hf_logprobs(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_against(ref, ids, entries, n):
    """entries: vLLM's prompt_logprobs of `ids` (None first); ref: the oracle's [len(ids), V] logprobs."""
    assert len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        d, row = entries[pos], ref[pos - 1]
        assert abs(d[ids[pos]] - row[ids[pos]].item()) <= TOL, pos
        top = row.topk(n)
        assert list(d)[:n] == top.indices.tolist(), pos  # the top n first, best first, then the prompt token
        assert len(d) in (n, n + 1) and all(abs(d[t] - v) <= TOL for t, v in zip(top.indices.tolist(),
                                                                                  top.values.tolist()))


GREEDY = dict(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mixed(llm):
    """One batch: a short prompt without prompt logprobs, a medium one with prompt_logprobs=0, PROMPT with 5 (and
    logprobs 1), a one-token prompt with 2. The short ones come first, so PROMPT's first chunk shares a step with
    them and its other chunks run on their own (it spans three steps)."""
    tok = llm.tokenizer
    long, short = tok.encode(PROMPT), tok.encode("Hello there, general")
    medium = tok.encode("One, two, three, four, five, six, seven and eight")
    assert len(long) > 2 * BUDGET and len(short) < BUDGET < len(medium)
    prompts = [short, medium, long, [long[0]]]
    params = [SamplingParams(**GREEDY), SamplingParams(prompt_logprobs=0, **GREEDY),
              SamplingParams(prompt_logprobs=5, logprobs=1, **GREEDY), SamplingParams(prompt_logprobs=2, **GREEDY)]
    return prompts, params, llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def test_llm_prompt_logprobs_equal_hf_chunked_and_mixed(llm, hf, mixed):
    prompts, params, outs = mixed
    assert outs[0].prompt_logprobs is None
    assert outs[3].prompt_logprobs == [None]  # a one-token prompt has nothing to score
    for i, n in ((1, 0), (2, 5)):
        check_against(hf_logprobs(hf, prompts[i]), prompts[i], outs[i].prompt_logprobs, n)
    # asking for prompt logprobs changes nothing else: the same tokens and output logprobs as without (up to the
    # rounding of other chunk boundaries: the batch differs)
    alone = llm.generate([{"prompt_token_ids": prompts[i]} for i in (0, 2)],
                         [SamplingParams(logprobs=params[i].logprobs, **GREEDY) for i in (0, 2)])
    for i, b in zip((0, 2), alone):
        assert outs[i].outputs[0].token_ids == b.outputs[0].token_ids and b.prompt_logprobs is None
        for d, e in zip(outs[i].outputs[0].logprobs or [], b.outputs[0].logprobs or []):
            assert d.keys() == e.keys() and all(abs(d[t] - e[t]) <= TOL for t in d)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


# ---- through `tandem serve` -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def clusters():
    """A disaggregated (1 prefill + 1 decode worker) and a colocated cluster, started side by side."""
    with ThreadPoolExecutor(2) as pool:
        futures = {mode: pool.submit(Cluster, *ENGINE, "--prefill-workers", n)
                   for mode, n in (("disaggregated", "1"), ("colocated", "0"))}
    started, errors = {}, []
    for mode, f in futures.items():
        try:
            started[mode] = f.result()
        except Exception as e:  # noqa: BLE001 - stop the other one, then report
            errors.append(e)
    try:
        if errors:
            raise errors[0]
        yield started
    finally:
        with ThreadPoolExecutor(2) as pool:
            codes = list(pool.map(lambda c: c.stop(), started.values()))
        assert codes == [0] * len(codes)


@pytest.fixture(scope="module")
def expected(mixed):
    """PROMPT's ids, and the LLM's prompt logprobs cut to top 1 (as logprobs=1 asks) and greedy output: the
    serving answers must match them."""
    prompts, _, outs = mixed
    ids, out = prompts[2], outs[2]
    top1 = [None] + [{t: d[t] for t in (next(iter(d)), tok)} for d, tok in zip(out.prompt_logprobs[1:], ids[1:])]
    return ids, dataclasses.replace(out, prompt_logprobs=top1)


MODES = ["disaggregated", "colocated"]


def openai_client(cluster):
    return openai.OpenAI(base_url=f"http://{cluster.http}/v1", api_key="unused", max_retries=0, timeout=60)


def check_prompt_part(lp, ids, entries, tok, text_start=0):
    """OpenAI completion logprobs of the prompt against the LLM's prompt_logprobs."""
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[: len(ids)] == [tok.decode([t]) for t in ids]
    for pos in range(1, len(ids)):
        assert abs(lp.token_logprobs[pos] - entries[pos][ids[pos]]) <= TOL, pos
        want = {tok.decode([t]): v for t, v in entries[pos].items()}
        got = lp.top_logprobs[pos]
        assert got.keys() == want.keys() and all(abs(got[k] - want[k]) <= TOL for k in want), pos
    offsets = [text_start]
    for s in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(s))
    assert lp.text_offset == offsets


@pytest.mark.parametrize("mode", MODES)
def test_echo_over_http_equals_llm(clusters, expected, llm, mode):
    cluster, (ids, out) = clusters[mode], expected
    client, tok = openai_client(cluster), llm.tokenizer
    # the prompt alone (max_tokens 0): its text and one logprob entry per prompt token, the first one empty
    r = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    c = r.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == len(ids)
    check_prompt_part(c.logprobs, ids, out.prompt_logprobs, tok)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    # the prompt, then 3 generated tokens (greedy: the LLM's)
    r = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=3,
                                  temperature=0.0, extra_body={"ignore_eos": True})
    c, gen = r.choices[0], out.outputs[0]
    assert c.text == PROMPT + gen.text and len(c.logprobs.tokens) == len(ids) + 3
    check_prompt_part(c.logprobs, ids, out.prompt_logprobs, tok)
    for j, t in enumerate(gen.token_ids):
        assert c.logprobs.tokens[len(ids) + j] == tok.decode([t])
        assert abs(c.logprobs.token_logprobs[len(ids) + j] - gen.logprobs[j][t]) <= TOL
    # streamed: the first chunk carries the prompt and its logprobs, the text adds up to the same
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=3,
                                            temperature=0.0, stream=True, extra_body={"ignore_eos": True}))
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT) and len(first.logprobs.tokens) >= len(ids)
    check_prompt_part(first.logprobs, ids, out.prompt_logprobs, tok)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    stream_offsets = [o for ch in chunks if ch.choices for o in ch.choices[0].logprobs.text_offset]
    assert stream_offsets == c.logprobs.text_offset
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0,
                                            stream=True))
    assert [(ch.choices[0].text, ch.choices[0].finish_reason) for ch in chunks] == [(PROMPT, "length")]
    check_prompt_part(chunks[0].choices[0].logprobs, ids, out.prompt_logprobs, tok)
    # echo without logprobs: the text only, no prompt logprobs computed
    r = client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=0)
    assert r.choices[0].text == PROMPT and r.choices[0].logprobs is None
    assert_idle(cluster)


@pytest.mark.parametrize("mode", MODES)
def test_lm_eval_loglikelihood_request(clusters, expected, llm, mode):
    """lm-eval's local-completions payload: a batch of token-id prompts, echo, logprobs 1, max_tokens 1;
    it sums token_logprobs[ctxlen:-1] and checks each continuation token is the top one."""
    ids, out = expected
    ctxlen = 5
    body = {"model": "tiny", "prompt": [ids, ids[:12]], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    r = requests.post(f"http://{clusters[mode].http}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for c, p in zip(choices, (ids, ids[:12])):
        assert c["text"].startswith(llm.tokenizer.decode(p)) and len(c["logprobs"]["tokens"]) == len(p) + 1
        got = c["logprobs"]["token_logprobs"][ctxlen:-1]
        want = [out.prompt_logprobs[pos][p[pos]] for pos in range(ctxlen, len(p))]
        assert len(got) == len(want) and all(abs(a - b) <= TOL for a, b in zip(got, want))
        tops = c["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(lp == max(top.values()) for lp, top in zip(got, tops))
        assert greedy == all(max(out.prompt_logprobs[pos], key=out.prompt_logprobs[pos].get) == p[pos]
                             for pos in range(ctxlen, len(p)))


@pytest.mark.parametrize("mode", MODES)
def test_grpc_prompt_logprobs_on_the_first_message(clusters, expected, mode):
    cluster, (ids, out) = clusters[mode], expected
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    msgs = list(cluster.client.generate(ids, params, timeout=60))
    assert list(msgs[0].prompt_token_ids) == ids and len(msgs[0].prompt_logprobs) == len(ids) - 1
    assert all(not m.prompt_logprobs and not m.prompt_token_ids for m in msgs[1:])
    for pos, lp in enumerate(msgs[0].prompt_logprobs, start=1):
        d = dict(zip(lp.token_ids, lp.logprobs))
        assert d.keys() == out.prompt_logprobs[pos].keys()
        assert all(abs(d[t] - v) <= TOL for t, v in out.prompt_logprobs[pos].items())
    assert [t for m in msgs for t in m.token_ids] == out.outputs[0].token_ids
    unary = cluster.client.generate_unary(ids, params, timeout=60)
    assert list(unary.prompt_token_ids) == ids and len(unary.prompt_logprobs) == len(ids) - 1
    # without prompt_logprobs nothing extra is sent
    plain = cluster.client.generate_unary(ids, SamplingParams(max_tokens=2), timeout=60)
    assert not plain.prompt_logprobs and not plain.prompt_token_ids


def test_bad_input(clusters):
    cluster = clusters["disaggregated"]
    client = openai_client(cluster)
    with pytest.raises(openai.BadRequestError) as e:  # max_tokens 0 needs echo
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)
    assert "max_tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=21, max_tokens=0)
    assert "logprobs" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=-1)
    assert "max_tokens" in e.value.message
    r = requests.post(f"http://{cluster.http}/v1/completions", json={"prompt": "x", "prompt_logprobs": 1}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    with pytest.raises(grpc.RpcError) as e:
        cluster.client.generate_unary([1, 2, 3], SamplingParams(max_tokens=2, prompt_logprobs=21), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in e.value.details()
    assert_idle(cluster)


def test_chat_echo_continues_the_assistant_message(clusters):
    """vLLM's chat `echo`: the answer starts with the last message when it is the assistant's."""
    client = openai_client(clusters["colocated"])
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    kw = dict(model="tiny", messages=messages, max_tokens=4, temperature=0.0)
    extra = {"add_generation_prompt": False, "ignore_eos": True}
    plain = client.chat.completions.create(**kw, extra_body=extra).choices[0].message.content
    echoed = client.chat.completions.create(**kw, extra_body=dict(extra, echo=True))
    assert echoed.choices[0].message.content == "My favourite is" + plain
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body=dict(extra, echo=True)))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "My favourite is" + plain
