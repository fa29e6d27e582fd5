"""Text prompts go through the model directory's tokenizer.json; outputs carry decoded text."""

import shutil

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tandem import LLM, SamplingParams


def test_text_prompt_uses_directory_tokenizer(hf_checkpoints, tmp_path):
    _, path = hf_checkpoints["moe"]
    d = tmp_path / "with-tokenizer"
    shutil.copytree(path, d)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world, the quick brown fox"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(d)
    llm = LLM(model=str(d), max_model_len=128)
    out = llm.generate(["hello world"], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    by_ids = llm.generate([{"prompt_token_ids": llm.tokenizer.encode("hello world")}],
                          SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt_token_ids == tok.encode("hello world").ids
    assert out.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
