"""lm-eval's `local-completions` model, unchanged, against `tandem serve`'s /v1/completions: a multiple-choice task
of local data (loglikelihood requests, i.e. echo + prompt logprobs of token-id prompts) and a generation task
(greedy completions until a stop string). Each loglikelihood lm-eval reports equals HF transformers' on the same
tokens (the shipped tandem-tiny checkpoint), and so does its greedy flag; each generation equals the colocated
engine's greedy text, cut before the stop string."""

import json

import lm_eval
import pytest
import torch

from cluster import Cluster
from tandem import LLM, SamplingParams
from tandem.worker_setup import DEFAULT_MODEL

MODEL = DEFAULT_MODEL
TOL = 1e-4
QUESTIONS = [("The capital of France is", ["Paris", "a dog", "blue"], 0),
             ("Once upon a", ["time", "banana", "hammer"], 0),
             ("Hello, how are", ["you", "the", "sixteen"], 0),
             ("Two plus two equals", ["four", "a tree", "yesterday"], 0)]
PROMPTS = ["Once upon a time", "The sea was", "Write a poem about"]


@pytest.fixture(scope="module")
def cluster():
    c = Cluster("--model", MODEL, "--dtype", "float32", "--prefill-workers", "0", "--max-model-len", "256",
                "--block-size", "4", "--max-num-batched-tokens", "32")
    yield c
    assert c.stop() == 0


def task_dir(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "mc.jsonl", "w") as f:
        for q, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    with open(data / "gen.jsonl", "w") as f:
        for p in PROMPTS:
            f.write(json.dumps({"prompt": p}) + "\n")
    (tmp_path / "tandem_mc.yaml").write_text(f"""task: tandem_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (tmp_path / "tandem_gen.yaml").write_text(f"""task: tandem_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: ""
generation_kwargs:
  until: ["."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return tmp_path


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's documented split (TemplateLM._encode_pair): trailing spaces of the context move to the
    continuation, which is the tail of the whole text's encoding."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


def test_local_completions_loglikelihood_and_generation(cluster, tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = (f"model=tandem-tiny,base_url=http://{cluster.http}/v1/completions,tokenizer={MODEL},"
            "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1")
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["tandem_mc", "tandem_gen"],
                                  task_manager=TaskManager(include_path=str(task_dir(tmp_path))), log_samples=True)
    assert 0.0 <= out["results"]["tandem_mc"]["acc,none"] <= 1.0

    tok = AutoTokenizer.from_pretrained(MODEL)
    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    mc = sorted(out["samples"]["tandem_mc"], key=lambda s: s["doc_id"])
    assert len(mc) == len(QUESTIONS)
    for sample, (q, choices, _) in zip(mc, QUESTIONS):
        for (loglik, greedy), choice in zip([r[0] for r in sample["resps"]], choices):
            ctx, cont = encode_pair(tok, q, " " + choice)  # lm-eval's default target delimiter
            with torch.no_grad():
                lp = hf(torch.tensor([ctx + cont])).logits[0].log_softmax(-1)
            rows = lp[len(ctx) - 1 : len(ctx) + len(cont) - 1]
            want = rows[torch.arange(len(cont)), torch.tensor(cont)].sum().item()
            assert abs(float(loglik) - want) <= TOL * len(cont), (q, choice)
            assert (greedy in (True, "True")) == bool((rows.argmax(-1) == torch.tensor(cont)).all()), (q, choice)

    llm = LLM(model=MODEL, max_model_len=256, block_size=4)
    gen = sorted(out["samples"]["tandem_gen"], key=lambda s: s["doc_id"])
    assert len(gen) == len(PROMPTS)
    for sample, prompt in zip(gen, PROMPTS):
        ids = tok(prompt, add_special_tokens=False).input_ids
        (o,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=12, temperature=0.0))
        assert sample["resps"][0][0] == o.outputs[0].text.split(".")[0], prompt  # the text before the stop string
