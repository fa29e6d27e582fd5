"""Paged attention: the Triton kernel against the torch reference over packed batches that mix decode rows,
verify rows and prefill chunks (with and without earlier cached context), through random non-contiguous block
tables. Every output element must be written (outputs start as NaN), and cache slots outside any context hold NaN
so a stray read shows. On the CPU the kernel runs under Triton's interpreter at small sizes; on the GPU (-m gpu)
at the real shape through the dispatch."""

import pytest
import torch

from tandem.batch import ForwardBatch
from tandem.ops import attention

BLOCK_SIZE = 16


def make_case(reqs, heads, kv_heads, head_dim, dtype, device, seed, num_blocks=None, spare_cols=2):
    """reqs: [(cached, q_len)]; request i's context is cached + q_len tokens, its queries the last q_len."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in reqs]
    need = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = num_blocks or sum(need) + 8
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0 is the null block
    width = max(need) + spare_cols
    tables = torch.zeros(len(reqs), width, dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    k_cache = torch.full((num_blocks, BLOCK_SIZE, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    # only context slots hold numbers
    req = torch.repeat_interleave(torch.arange(len(reqs)), torch.tensor(seq_lens))
    pos = torch.cat([torch.arange(s) for s in seq_lens])
    slots = tables[req, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
    k_cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(len(slots), kv_heads, head_dim, generator=g)
    v_cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(len(slots), kv_heads, head_dim, generator=g)
    lens = [n for _, n in reqs]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], heads, head_dim, generator=g)
    to = dict(device=device)
    batch = ForwardBatch(
        input_ids=torch.zeros(qsl[-1], dtype=torch.long, **to), positions=torch.zeros(qsl[-1], dtype=torch.long, **to),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, **to),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, **to), block_tables=tables.to(device),
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.long, **to),
        state_slots=torch.zeros(len(reqs), dtype=torch.long, **to),
        state_replay=torch.zeros(len(reqs), dtype=torch.long, **to),
        state_pending=torch.zeros(len(reqs), 2, dtype=torch.long, **to),
        logits_indices=torch.tensor(qsl[1:], **to) - 1, query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
    return q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype), batch


def reference(q, k_cache, v_cache, batch, scale):
    """fp32 maths on the (possibly bf16) inputs, on the NaN-free reference path."""
    return attention._paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), batch, scale)


def run_kernel(q, k_cache, v_cache, batch, scale, **kw):
    out = torch.full_like(q, float("nan"))
    max_q = max(b - a for a, b in zip(batch.query_start_loc_cpu[:-1], batch.query_start_loc_cpu[1:]))
    attention.paged_attention_triton(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                                     scale, max_q, out=out, **kw)
    return out


def check(out, ref, tol):
    assert not out.isnan().any(), "an output element was not written (or a NaN cache slot was read)"
    err = (out.float() - ref).abs().max().item()
    assert err <= tol, err


DECODE_REQS = [(5, 1), (40, 1), (0, 1), (17, 3), (60, 3), (1, 1), (31, 3)]  # decode and verify rows
MIXED_REQS = [(23, 1), (9, 3), (0, 20), (0, 5), (17, 12), (30, 33), (48, 1)]  # + prefill with/without cached context


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1), (6, 2)])  # GQA 1, 4 and a group that is no power of two
def test_paged_attention_kernel_cpu_interpreter(heads, kv_heads, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case runs where there is no GPU")
    nan_workspace = lambda shape, device: torch.full(shape, float("nan"), device=device)  # noqa: E731
    monkeypatch.setattr(attention, "_workspace", nan_workspace)  # split partials nobody writes must not be read
    hd, scale = 32, 32**-0.5
    q, kc, vc, b = make_case(DECODE_REQS, heads, kv_heads, hd, torch.float32, "cpu", seed=heads * 10 + kv_heads)
    ref = reference(q, kc, vc, b, scale)
    check(run_kernel(q, kc, vc, b, scale, num_splits=1, block_n=16), ref, 1e-5)  # decode tiling, no split
    check(run_kernel(q, kc, vc, b, scale, num_splits=4, block_n=16, min_chunk=16), ref, 1e-5)  # split-K + reduce
    check(run_kernel(q, kc, vc, b, scale, decode=False, prefill_m=8, block_n=16), ref, 1e-5)  # prefill tiling
    # long contexts in 20 splits: the reduce merges them in two chunks, keys in both, splits without keys last
    q, kc, vc, b = make_case([(300, 1), (5, 3), (290, 3)], heads, kv_heads, hd, torch.float32, "cpu", seed=heads)
    check(run_kernel(q, kc, vc, b, scale, num_splits=20, block_n=16, min_chunk=16), reference(q, kc, vc, b, scale),
          1e-5)

    q, kc, vc, b = make_case(MIXED_REQS, heads, kv_heads, hd, torch.float32, "cpu", seed=heads * 10 + kv_heads + 1)
    ref = reference(q, kc, vc, b, scale)
    # prefill tiles of 16 rows (16 // group tokens): the tile search, partial tiles, requests of many tiles
    check(run_kernel(q, kc, vc, b, scale, prefill_m=16, block_n=16), ref, 1e-5)
    check(run_kernel(q, kc, vc, b, scale, prefill_m=16, block_n=32, num_splits=2, min_chunk=32), ref, 1e-5)


def test_paged_attention_dispatch_cpu_takes_reference():
    q, kc, vc, b = make_case([(3, 1), (0, 4)], 4, 2, 32, torch.float32, "cpu", seed=0)
    ref = attention._paged_attention_torch(q, kc, vc, b, 0.2)
    assert torch.equal(attention.paged_attention(q, kc, vc, b, 0.2), ref)


# ---------------------------------------------------------------------------------------------------- GPU, real size

def gpu_reqs(seed, bsz, kind):
    g = torch.Generator().manual_seed(seed)
    ctx = lambda hi: int(torch.randint(0, hi + 1, (), generator=g))  # noqa: E731
    if kind == "decode":
        return [(ctx(4096) + 1, 1) for _ in range(bsz)]
    if kind == "verify":
        return [(ctx(4096) + 1, 3) for _ in range(bsz)]
    if kind == "mixed":  # continuous batching: decodes, verifies, chunked prefills with and without cached context
        return ([(ctx(4096) + 1, 1) for _ in range(bsz // 2)] + [(ctx(4096) + 1, 3) for _ in range(bsz // 4)]
                + [(0, 517), (1024, 256), (0, 64), (3000, 1000)])
    return [(0, 2048)] * bsz  # plain prefill


@pytest.mark.gpu
@pytest.mark.parametrize("seed,kind,bsz", [(0, "decode", 1), (1, "decode", 32), (2, "verify", 1), (3, "verify", 32),
                                           (4, "mixed", 16), (5, "prefill", 4)])
@pytest.mark.parametrize("heads,kv_heads", [(16, 2), (16, 16), (16, 4)])
def test_paged_attention_gpu(seed, kind, bsz, heads, kv_heads):
    hd, scale = 256, 256**-0.5
    reqs = gpu_reqs(seed, bsz, kind)
    for dtype, tol in [(torch.bfloat16, 2e-2), (torch.float32, 2e-5)]:
        q, kc, vc, b = make_case(reqs, heads, kv_heads, hd, dtype, "cuda", seed=7)
        ref = reference(q, kc, vc, b, scale)
        check(attention.paged_attention(q, kc, vc, b, scale), ref, tol)  # the dispatch
        check(run_kernel(q, kc, vc, b, scale), ref, tol)  # NaN-filled output


@pytest.mark.gpu
def test_paged_attention_gpu_split_extremes():
    """B=1 on a long context (many splits), and forced split counts on both tilings."""
    hd, scale = 256, 256**-0.5
    q, kc, vc, b = make_case([(8191, 1)], 16, 2, hd, torch.bfloat16, "cuda", seed=3, spare_cols=200)
    ref = reference(q, kc, vc, b, scale)
    for ns in (None, 1, 3, 64):
        check(run_kernel(q, kc, vc, b, scale, num_splits=ns), ref, 2e-2)
    q, kc, vc, b = make_case([(2000, 40), (5, 1), (0, 77)], 16, 2, hd, torch.bfloat16, "cuda", seed=4)
    ref = reference(q, kc, vc, b, scale)
    for ns in (None, 1, 4):
        check(run_kernel(q, kc, vc, b, scale, num_splits=ns), ref, 2e-2)
