"""q/k RMSNorm1p + partial RoPE with the keys and values written to their cache slots: the Triton kernel and the torch
reference against fp64 maths from the fp32 angles (positions up to 100k), over the strided views gated attention
takes from its fused projection."""

import pytest
import torch

from tandem.batch import ForwardBatch
from tandem.ops import rope


def fp64_norm_rope(x, w, eps, positions, inv_freq):
    x = x.double()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.double())
    half = inv_freq.shape[0]
    ang = (positions.float()[:, None] * inv_freq[None, :]).double()  # the model's fp32 angles (as HF's)
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2, keep = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, keep), -1)


def batch_of(positions):
    n = positions.numel()
    z = torch.zeros(1, dtype=torch.int32, device=positions.device)
    return ForwardBatch(input_ids=positions, positions=positions, query_start_loc=z, seq_lens=z, block_tables=z,
                        slot_mapping=positions, state_slots=positions, state_replay=positions,
                        state_pending=positions,
                        logits_indices=positions, query_start_loc_cpu=[0, n], seq_lens_cpu=None)


def check(device, dtype, tol):
    g = torch.Generator().manual_seed(0)
    for T, nh, nkv, hd, rotary in [(1, 2, 1, 16, 16), (5, 4, 2, 32, 8), (9, 8, 1, 48, 12)]:  # full, partial
        q_gate = torch.randn(T, nh, 2 * hd, generator=g).to(device, dtype)
        q = q_gate.chunk(2, dim=-1)[0]  # every other hd-wide slice: a strided view
        kv = torch.randn(T, 2, nkv, hd, generator=g).to(device, dtype)
        k, v = kv[:, 0], kv[:, 1]  # strided too, as the fused projection's outputs
        qw, kw = (torch.randn(hd, generator=g) * 0.3).to(device, dtype), (torch.randn(hd, generator=g) * 0.3).to(
            device, dtype)
        positions = torch.randint(0, 100_000, (T,), generator=g).to(device)
        slots = torch.randperm(4 * 3, generator=g)[:T].to(device)  # 4 blocks of 3 slots, each token its own
        inv_freq = rope.inv_frequencies(rotary, 1e7, device=device)
        batch = batch_of(positions)
        cos, sin = rope.rope_tables(batch, inv_freq, dtype)
        assert rope.rope_tables(batch, inv_freq, dtype)[0] is cos  # made once per forward
        want = (fp64_norm_rope(q, qw, 1e-6, positions, inv_freq), fp64_norm_rope(k, kw, 1e-6, positions, inv_freq))
        outs = []
        for impl in (rope.qk_norm_rope_write_kv_triton, rope.qk_norm_rope_write_kv):
            k_cache, v_cache = (torch.full((4, 3, nkv, hd), float("nan"), dtype=dtype, device=device) for _ in "kv")
            got_q = impl(q, k, v, qw, kw, 1e-6, cos, sin, k_cache, v_cache, slots)
            got = (got_q, k_cache.view(-1, nkv, hd)[slots])
            assert torch.equal(v_cache.view(-1, nkv, hd)[slots], v)
            unused = torch.ones(12, dtype=torch.bool, device=device)
            unused[slots] = False
            assert k_cache.view(12, -1)[unused].isnan().all() and v_cache.view(12, -1)[unused].isnan().all()
            for x, w in zip(got, want):
                assert x.dtype == dtype and x.shape == w.shape
                assert ((x.double() - w).abs() <= tol * (1 + w.abs())).all(), float((x.double() - w).abs().max())
            assert got_q.is_contiguous()
            outs.append(got)
        ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -21
        for x, ref in zip(*outs):  # the same roundings: at most one unit in the last place apart
            assert ((x.double() - ref.double()).abs() <= ulp * (1 + ref.double().abs())).all()


def test_qk_norm_rope_cpu_interpreter():
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case runs where there is no GPU")
    check("cpu", torch.float32, 1e-5)


@pytest.mark.gpu
def test_qk_norm_rope_gpu():
    check("cuda", torch.bfloat16, 2 ** -6)
