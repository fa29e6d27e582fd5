"""The MTP head over the paged cache against an independent reference: HF's full-attention decoder layer (the
MTP layer is one) with the fc / norm glue written here from the equations, recomputed over the whole sequence
with no cache, including the k > 1 recursion on the head's own output hidden."""

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe
from transformers import Qwen3_5MoeTextConfig

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import ScheduledChunk
from tandem.engine.sequence import Sequence
from tandem.model.presets import PRESETS, preset_config, random_model
from admitted import admitted


def rms1p(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def reference_mtp(model, hf_layer, rotary, next_ids, hiddens):
    """All positions 0..n-1 at once: inputs (embed(next_ids[i]), hiddens[i]) at position i."""
    m = model.mtp
    e = model.model.embed_tokens(next_ids)
    u = F.linear(torch.cat([rms1p(e, m.pre_fc_norm_embedding.weight), rms1p(hiddens, m.pre_fc_norm_hidden.weight)], -1),
                 m.fc.weight)[None]
    pos = torch.arange(len(next_ids))[None]
    # (3, 1, n): one position row per mRoPE axis, all equal for text
    out = hf_layer(u, position_embeddings=rotary(u, pos[None].expand(3, -1, -1)), attention_mask=None, position_ids=pos)
    out = out[0] if isinstance(out, tuple) else out
    return rms1p(out[0], m.norm.weight)


def hf_mtp_layer(cfg, model):
    """HF's decoder layer holding the MTP layer's weights, and its rotary embedding."""
    hf_cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in PRESETS["tiny-moe"].items() if k != "model_type"})
    hf_cfg._attn_implementation = "sdpa"
    hf_layer = hf_moe.Qwen3_5MoeDecoderLayer(hf_cfg, cfg.attention_layers[0]).eval()
    hf_layer.load_state_dict(model.mtp.layers[0].state_dict())
    return hf_layer, hf_moe.Qwen3_5MoeTextRotaryEmbedding(hf_cfg)


@torch.no_grad()
def prompt_hidden(cfg, model, prompt):
    """A plain engine (no speculation) holding the prompt as one sequence, and the target's final hidden states over
    its rows: (engine, sequence, hidden [N, H])."""
    eng = Engine(cfg, model, EngineConfig(block_size=4, max_num_seqs=2, max_model_len=64))
    target = admitted(eng, "t", prompt, max_tokens=8)
    return eng, target, model(eng.runner.build_batch([ScheduledChunk(target, len(prompt))]), eng.pools.layer_caches)


def test_mtp_head_and_recursion_match_reference():
    cfg = preset_config("tiny-moe")
    model = random_model(cfg, "cpu", torch.float32, seed=3)
    hf_layer, rotary = hf_mtp_layer(cfg, model)
    prompt = torch.randint(2, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(0)).tolist()
    eng, target, h = prompt_hidden(cfg, model, prompt)
    with torch.no_grad():
        t_next = int(model.compute_logits(h[-1:]).argmax())
        # the MTP inputs at positions 0..N-1 are the tokens shifted by one: x_1 .. x_{N-1}, t_N
        mtp_seq = Sequence("m", prompt[1:] + [t_next], SamplingParams(max_tokens=8), block_ids=target.block_ids,
                           state_slots=target.state_slots)
        hiddens, next_ids, drafts, ours = list(h), prompt[1:] + [t_next], [], []
        step_hidden = h
        for step in range(3):  # k = 3: the first draft, then two recursion steps on the head's own output
            n = len(prompt) if step == 0 else 1
            b = eng.runner.build_batch([ScheduledChunk(mtp_seq, n)])
            out = model.mtp(model.model.embed_tokens(b.input_ids), step_hidden, b, model.inv_freq, eng.pools.mtp_cache)
            mtp_seq.num_computed += n
            ours.append(out)
            d = int(model.compute_logits(out[-1:]).argmax())
            drafts.append(d)
            mtp_seq.prompt_token_ids.append(d)
            step_hidden = out[-1:]
        ref_all = None
        for step in range(3):
            ref_all = reference_mtp(model, hf_layer, rotary, torch.tensor(next_ids), torch.stack(hiddens))
            hiddens.append(ref_all[-1])
            next_ids.append(drafts[step])
        # ref_all covers positions 0..N+1: the first N rows are step 0, then one row per recursion step
        assert (torch.cat(ours) - ref_all[: len(prompt) + 2]).abs().max() <= 1e-5
        n = len(prompt)
        ref_drafts = [int(model.compute_logits(ref_all[n - 1 + i : n + i]).argmax()) for i in range(3)]
        assert drafts == ref_drafts


def test_engine_drafts_match_reference():
    """The engine's own draft loop (`spec.draft`: the head over the prompt's rows, then k - 1 recursion steps, each
    fed the previous draft) against the reference recursion, with k = 3, after a prompt's one prefill step."""
    cfg = preset_config("tiny-moe")
    model = random_model(cfg, "cpu", torch.float32, seed=3)
    hf_layer, rotary = hf_mtp_layer(cfg, model)
    prompt = torch.randint(2, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    # one step for the whole prompt: a prefix cache would end a chunk at the prompt's last block boundary
    eng = Engine(cfg, model, EngineConfig(block_size=4, max_num_seqs=2, max_model_len=64, num_speculative_tokens=3,
                                          enable_prefix_caching=False))
    eng.add_request("r", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    seq = eng.sequences["r"]
    eng.step()
    assert seq.num_computed == len(prompt) and len(seq.drafts) == 3
    _, _, h = prompt_hidden(cfg, model, prompt)
    with torch.no_grad():
        first = int(model.compute_logits(h[-1:]).argmax())
        assert seq.output_token_ids == [first]
        hiddens, next_ids, want = list(h), prompt[1:] + [first], []
        for _ in range(3):
            ref = reference_mtp(model, hf_layer, rotary, torch.tensor(next_ids), torch.stack(hiddens))
            want.append(int(model.compute_logits(ref[-1:]).argmax()))
            hiddens.append(ref[-1])
            next_ids.append(want[-1])
    assert seq.drafts == want


def test_draft_tokens_are_the_argmax_of_the_fp32_logits():
    """Drafting takes the argmax on the lm_head's bf16 output, without the fp32 copy: the same token as the fp32
    logits' argmax, ties included (two vocabulary rows made equal: both take the first)."""
    cfg = preset_config("tiny-moe")
    model = random_model(cfg, "cpu", torch.bfloat16, seed=3)
    hidden = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    want = model.compute_logits(hidden).argmax(-1)
    after, before = (int(want[0]) + 1) % cfg.vocab_size, int(want[1]) - 1
    model.lm_head_weight.data[after] = model.lm_head_weight.data[want[0]]  # a tie after the winner...
    model.lm_head_weight.data[before] = model.lm_head_weight.data[want[1]]  # ...and one before it
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits[0, want[0]] == logits[0, after]
    assert torch.equal(model.draft_tokens(hidden), logits.argmax(-1))
