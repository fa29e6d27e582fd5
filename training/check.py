"""Pins the training model (training/model.py) against Tandem and HF transformers in fp32, on a small random config:
the chunk-wise delta rule against the token-by-token recurrence, trunk logits through the exported official-layout
checkpoint (Tandem's loader and HF's `from_pretrained`), and every MTP level against Tandem's drafting recursion.

    python -m training.check            # CPU, ~a minute
"""

from __future__ import annotations

import sys
import tempfile

import torch

from training.checkpoint import save_checkpoint, text_config
from training.model import TextConfig, TinyQwen35Moe, chunk_gated_delta_rule

SMALL = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=48, eos_token_id=2, pad_token_id=0,
             rope_parameters={"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
                              "mrope_section": [2, 1, 1], "mrope_interleaved": True})


def recurrent_reference(q, k, v, g, beta):
    B, L, h, dk = k.shape
    S = torch.zeros(B, h, dk, v.shape[-1], dtype=q.dtype)
    out = []
    for t in range(L):
        S = S * g[:, t].exp()[..., None, None]
        d = (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])) * beta[:, t][..., None]
        S = S + k[:, t][..., None] * d[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(out, 1)


def check_delta_rule():
    g = torch.Generator().manual_seed(0)
    B, L, h, dk, dv = 2, 150, 3, 8, 5
    q = torch.nn.functional.normalize(torch.randn(B, L, h, dk, generator=g, dtype=torch.float64), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(B, L, h, dk, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, L, h, dv, generator=g, dtype=torch.float64)
    gg = -torch.rand(B, L, h, generator=g, dtype=torch.float64) * 2
    beta = torch.rand(B, L, h, generator=g, dtype=torch.float64)
    err = (chunk_gated_delta_rule(q, k, v, gg, beta, chunk=16) - recurrent_reference(q, k, v, gg, beta)).abs().max()
    print(f"chunked delta rule vs recurrence (fp64): max abs diff {err:.2e}")
    return err < 1e-10


def random_model(text, seed=0):
    torch.manual_seed(seed)
    model = TinyQwen35Moe(TextConfig.from_hf(text))
    model.init_weights(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and not name.endswith(("A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.2)
            elif p.ndim > 1:
                p.normal_(0.0, 0.1)
    return model.float().eval()


def check_against_tandem_and_hf(tmp):
    from tandem.config import EngineConfig, ModelConfig
    from tandem.engine.engine import Engine
    from tandem.engine.sampling_params import SamplingParams
    from tandem.engine.scheduler import ScheduledChunk
    from tandem.engine.sequence import Sequence
    from tandem.model.loader import load_checkpoint

    text = text_config(**SMALL)
    ours = random_model(text)
    save_checkpoint(ours, text, tmp, dtype=torch.float32)
    ids = torch.randint(3, text["vocab_size"], (1, 83), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h, _ = ours.trunk(ids)
        ref = ours.logits(h)[0]
    ok = True

    cfg = ModelConfig.from_dir(tmp)
    tmodel = load_checkpoint(tmp, cfg, "cpu", torch.float32, progress=False)
    eng = Engine(cfg, tmodel, EngineConfig(block_size=4, max_num_seqs=2, max_model_len=128, num_speculative_tokens=3))
    prompt = ids[0].tolist()
    seq = Sequence("a", prompt, SamplingParams(max_tokens=8))
    eng.scheduler.add(seq)
    assert eng.scheduler._try_admit(eng.scheduler.waiting.popleft())
    with torch.no_grad():
        batch = eng.runner.build_batch([ScheduledChunk(seq, len(prompt))])
        th = tmodel(batch, eng.pools.layer_caches)
        tl = tmodel.compute_logits(th)
    err = (tl - ref).abs().max()
    print(f"trunk logits, training model vs Tandem: max abs diff {err:.2e}")
    ok &= bool(err < 1e-4)

    try:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        with torch.no_grad():
            hl = hf(ids).logits[0].float()
        err = (hl - ref).abs().max()
        print(f"trunk logits, training model vs HF {type(hf).__name__}: max abs diff {err:.2e}")
        ok &= bool(err < 1e-4)
    except Exception as e:  # reported, and a failure
        print(f"HF from_pretrained failed: {type(e).__name__}: {e}")
        ok = False

    # MTP: Tandem's step 0 over the prompt rows, then two recursion steps on its own drafts
    m = tmodel
    with torch.no_grad():
        t_next = int(tl[-1].argmax())
        mtp_seq = Sequence("m", prompt[1:] + [t_next], SamplingParams(max_tokens=8), block_ids=seq.block_ids,
                           state_slots=seq.state_slots)
        step_hidden, drafts, touts = th, [], []
        for step in range(3):
            n = len(prompt) if step == 0 else 1
            b = eng.runner.build_batch([ScheduledChunk(mtp_seq, n)])
            out = m.mtp(m.model.embed_tokens(b.input_ids), step_hidden, b, m.inv_freq, eng.pools.mtp_cache)
            mtp_seq.num_computed += n
            touts.append(out)
            d = int(m.compute_logits(out[-1:]).argmax())
            drafts.append(d)
            mtp_seq.prompt_token_ids.append(d)
            step_hidden = out[-1:]
        full = torch.tensor([prompt + [t_next] + drafts[:2]])
        fh, _ = ours.trunk(full)
        levels, _ = ours.mtp_levels(fh, full, 3)
        N = len(prompt)
        errs = [(levels[0][0, :N] - touts[0]).abs().max(), (levels[1][0, N] - touts[1][0]).abs().max(),
                (levels[2][0, N + 1] - touts[2][0]).abs().max()]
    print("MTP levels 1..3 vs Tandem drafting: max abs diff " + ", ".join(f"{e:.2e}" for e in errs))
    ok &= all(bool(e < 1e-4) for e in errs)
    return ok


def main():
    ok = check_delta_rule()
    with tempfile.TemporaryDirectory() as tmp:
        ok &= check_against_tandem_and_hf(tmp)
    print("OK" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
