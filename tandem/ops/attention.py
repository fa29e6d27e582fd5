"""Paged causal attention over the packed batch (prefill chunks and decode tokens together).

KV caches are per layer `[num_blocks, block_size, kv_heads, head_dim]`; request i's context is the first
`seq_lens[i]` slots of its block table, and its queries are the last `q_len` of those positions.

Two implementations behind `paged_attention`: the torch reference (walks requests on the host) and one Triton
kernel for CUDA tensors, which reads every piece of metadata from device tensors (no host syncs, graph-capturable).

The Triton kernel. One program owns a *tile* of one request: TQ consecutive query rows times all GROUP query heads
of one KV head (GQA: the K/V of a KV block are loaded once for all heads that share them), i.e. M = TQ * GROUP rows
of a flash-attention tile, and walks that request's KV blocks through its block table with an fp32 online softmax.
Grid: (tiles, kv_heads, splits).
- decode / verify (max q_len <= DECODE_MAX_Q): one tile per request (TQ >= max q_len), so the grid's first axis is
  the batch; split-K over the context (flash-decoding): split s takes the s-th of num_splits equal, BLOCK_N-aligned
  slices of the context (at least MIN_CHUNK tokens each, so short contexts leave the later splits empty) and writes
  an fp32 partial output plus its log-sum-exp; `_attn_reduce_kernel` merges them.
- prefill (any q_len): tiles of TQ = PREFILL_M // GROUP query tokens; a request with q_len rows owns
  cdiv(q_len, TQ) tiles. With no host copy of the lengths the grid is the bound cdiv(T, TQ) + B: request i's tiles
  start at query_start_loc[i] // TQ + i (strictly increasing, with room for all its tiles), and each program finds
  its request by a binary search over query_start_loc; programs past their request's rows return at once.
  Prefill also splits the context when there are too few tiles to fill the GPU (a short chunk on a long context).
Causal masking: query row r of a request sits at position seq_len - q_len + r and sees keys at positions <= its own.
"""

import math
import os

import torch

from tandem.batch import ForwardBatch
from tandem.ops.triton_utils import HAS_TRITON, pdl, use_triton

DECODE_MAX_Q = 8  # batches whose longest request has at most this many query rows take the decode tiling
DECODE_BLOCK_N, PREFILL_M, PREFILL_BLOCK_N, NUM_STAGES = 32, 128, 64, 2  # prefill: benchmarks/prefill_ops.py --sweep
# fp32 prefill tiles hold twice the bytes: 128 x 64 at head_dim 256 asks for 295 KB of shared memory, more than an
# H200 has (227 KB); half of each fits (tests/test_kernels_sm90.py compiles both for sm_90)
FP32_PREFILL_M, FP32_PREFILL_BLOCK_N = 64, 32
WIDE_TILE = 32 * 256  # tiles of more than this many (row, dim) elements run 8 warps (the fp32 accumulator), else 4
MIN_CHUNK = 64  # fewest context tokens one split takes (multiple of both BLOCK_Ns)
MAX_SPLITS = 64
SPLIT_CHUNK = 16  # partials the reduce merges at once: few registers, one load for the usual split counts
SEARCH_STEPS = 16  # the prefill tiling's binary search over requests: one variant for up to 2**16 requests
PROGRAMS_PER_SM = 2  # split-K aims at this many programs per SM

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tandem.ops.triton_utils import wait_for_prior_kernels

    @triton.jit
    def _kv_step(q, m_i, l_i, acc, start, hi_k, q_pos, bt_row, k_ptr, v_ptr, kvh, qk_scale,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 PRECISION: tl.constexpr):
        """One BLOCK_N slice of keys [start, start + BLOCK_N) (those < hi_k) into the online softmax."""
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi_k
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = n % BLOCK_SIZE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + (blk * stride_kb + slot * stride_ks + kvh * stride_kh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, BLOCK_N], log2 units
        s = tl.where(n_ok[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet stay at 0
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + (blk * stride_vb + slot * stride_vs + kvh * stride_vh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit(do_not_specialize=["num_reqs", "num_tokens", "num_splits", "stride_bt"])
    def _paged_attn_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, o_part_ptr, lse_part_ptr,
        qsl_ptr, seq_lens_ptr, bt_ptr,
        qk_scale, num_reqs, num_tokens, num_heads, num_splits,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        GROUP: tl.constexpr, GROUP_P2: tl.constexpr, TQ: tl.constexpr, SEARCH_STEPS: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        SPLIT_K: tl.constexpr, MIN_CHUNK: tl.constexpr, ONE_TILE_PER_REQ: tl.constexpr, PRECISION: tl.constexpr,
        LOOP_WHILE: tl.constexpr, PDL: tl.constexpr,
    ):
        wait_for_prior_kernels(PDL)
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        if ONE_TILE_PER_REQ:
            req = pid
            tile = 0
        else:
            # largest request i with tile_start(i) = query_start_loc[i] // TQ + i <= pid
            lo = pid * 0
            hi = lo + num_reqs
            for _ in tl.static_range(SEARCH_STEPS):  # steps past convergence keep lo (mid = lo, go holds)
                mid = (lo + hi) // 2
                go = tl.load(qsl_ptr + mid) // TQ + mid <= pid
                lo = tl.where(go, mid, lo)
                hi = tl.where(go, hi, mid)
            req = lo
            tile = pid - (tl.load(qsl_ptr + req) // TQ + req)
        q_start = tl.load(qsl_ptr + req)
        q_len = tl.load(qsl_ptr + req + 1) - q_start
        if tile * TQ >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + req)
        ctx0 = seq_len - q_len  # position of the request's first query row

        M: tl.constexpr = TQ * GROUP_P2
        rows = tl.arange(0, M)
        t = tile * TQ + rows // GROUP_P2  # query row within the request
        g = rows % GROUP_P2
        row_ok = (t < q_len) & (g < GROUP)
        head = kvh * GROUP + g
        q_pos = ctx0 + t
        tok = (q_start + t).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM

        # keys this tile needs: positions < kv_end; this split's slice of them: [lo_k, hi_k)
        kv_end = tl.minimum(seq_len, ctx0 + tile * TQ + TQ)
        if not SPLIT_K:
            lo_k = 0
            hi_k = kv_end
        else:
            chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
            chunk = tl.maximum(chunk, MIN_CHUNK)
            lo_k = split * chunk
            hi_k = tl.minimum(lo_k + chunk, kv_end)

        q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, BLOCK_D], tl.float32)
        bt_row = bt_ptr + req.to(tl.int64) * stride_bt
        if LOOP_WHILE:  # the interpreter cannot take a tensor as a range() bound (numpy >= 2.4)
            start = lo_k
            while start < hi_k:
                m_i, l_i, acc = _kv_step(q, m_i, l_i, acc, start, hi_k, q_pos, bt_row, k_ptr, v_ptr, kvh, qk_scale,
                                         stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                         HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, PRECISION)
                start += BLOCK_N
        else:
            for start in range(lo_k, hi_k, BLOCK_N):
                m_i, l_i, acc = _kv_step(q, m_i, l_i, acc, start, hi_k, q_pos, bt_row, k_ptr, v_ptr, kvh, qk_scale,
                                         stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                         HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, PRECISION)

        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        st_mask = row_ok[:, None] & d_ok[None, :]
        if not SPLIT_K:
            tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=st_mask)
        else:
            prow = (split * num_tokens + tok) * num_heads + head  # row of the [splits, T, heads] partials
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
            tl.store(lse_part_ptr + prow, lse, mask=row_ok)
            tl.store(o_part_ptr + prow[:, None] * HEAD_DIM + d[None, :], o, mask=st_mask)

    @triton.jit(do_not_specialize=["num_rows", "num_splits"])
    def _attn_reduce_kernel(out_ptr, o_part_ptr, lse_part_ptr, num_rows, num_heads, stride_ot, stride_oh, num_splits,
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
                            PDL: tl.constexpr):
        """One row's partials, SPLIT_CHUNK splits at a time (one variant for every split count: they vary with the
        batch), the running sum rescaled whenever a chunk raises the largest log-sum-exp."""
        wait_for_prior_kernels(PDL)
        row = tl.program_id(0).to(tl.int64)  # token * num_heads + head
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        m = tl.full([], float("-inf"), tl.float32)
        total = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        s0 = num_splits * 0
        while s0 < num_splits:
            s = s0 + tl.arange(0, SPLIT_CHUNK)
            s_ok = s < num_splits
            lse = tl.load(lse_part_ptr + s * num_rows + row, mask=s_ok, other=float("-inf"))
            m_new = tl.maximum(m, tl.max(lse, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            w = tl.exp2(lse - m_safe)  # splits with no visible key (lse = -inf) weigh 0, their partials are masked out
            part = tl.load(o_part_ptr + (s * num_rows + row)[:, None] * HEAD_DIM + d[None, :],
                           mask=s_ok[:, None] & d_ok[None, :], other=0.0)
            rescale = tl.exp2(m - m_safe)
            acc = acc * rescale + tl.sum(tl.where((w > 0.0)[:, None], part * w[:, None], 0.0), 0)
            total = total * rescale + tl.sum(w, 0)
            m = m_new
            s0 += SPLIT_CHUNK
        o = acc / tl.maximum(total, 1e-30)
        tok = row // num_heads
        head = row % num_heads
        tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor):
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)


def paged_attention(q, k_cache, v_cache, batch: ForwardBatch, scale: float, out=None) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim] (into `out` when given)."""
    if not use_triton(q):
        o = _paged_attention_torch(q, k_cache, v_cache, batch, scale)
        return o if out is None else out.copy_(o)
    qsl = batch.query_start_loc_cpu
    if qsl is not None and len(qsl) > 1:  # host copy already there: exact longest query (no device sync)
        max_q = max(b - a for a, b in zip(qsl[:-1], qsl[1:]))
    else:  # bound from shapes alone: every request has at least one row
        max_q = q.shape[0] - batch.seq_lens.shape[0] + 1
    return paged_attention_triton(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                                  scale, max_q, out=out)


_SM_COUNT: dict = {}


def _target_programs(device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return PROGRAMS_PER_SM * _SM_COUNT[idx]


def _workspace(shape, device) -> torch.Tensor:
    """fp32 split-K partials; every split writes all its rows (tests swap in NaN-filled ones to check that)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def _pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


def paged_attention_triton(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float,
                           max_q_len: int, out=None, num_splits: int | None = None, decode: bool | None = None,
                           block_n: int | None = None, prefill_m: int | None = None,
                           min_chunk: int = MIN_CHUNK) -> torch.Tensor:
    """The Triton path. `max_q_len` is a host-known bound on the longest request's query rows (it picks the
    tiling); everything per request comes from the device tensors. `out`, `num_splits`, `decode`, `block_n`,
    `prefill_m`, `min_chunk` override the defaults (tests)."""
    T, H, D = q.shape
    B = seq_lens.shape[0]
    _, block_size, kv_heads, _ = k_cache.shape
    assert H % kv_heads == 0 and B < 2**SEARCH_STEPS
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    group = H // kv_heads
    group_p2 = triton.next_power_of_2(group)
    if out is None:
        out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    if T == 0 or B == 0:
        return out
    decode = max_q_len <= DECODE_MAX_Q if decode is None else decode
    if decode:
        tq = max(triton.next_power_of_2(max(max_q_len, 1)), triton.cdiv(16, group_p2))  # tl.dot wants M >= 16
        n_tiles, bn = B, block_n or DECODE_BLOCK_N
    else:
        wide = q.element_size() <= 2
        tq = max((prefill_m or (PREFILL_M if wide else FP32_PREFILL_M)) // group_p2, 1)
        n_tiles, bn = triton.cdiv(T, tq) + B, block_n or (PREFILL_BLOCK_N if wide else FP32_PREFILL_BLOCK_N)
        if tq >= max_q_len:  # every request fits one tile: no search, no idle programs
            n_tiles, decode = B, True
    warps = 8 if tq * group_p2 * triton.next_power_of_2(D) > WIDE_TILE else 4
    if num_splits is None:
        ctx_cap = block_tables.shape[1] * block_size  # no context can be longer
        num_splits = _pow2_floor(min(_target_programs(q.device) // (n_tiles * kv_heads), MAX_SPLITS,
                                     triton.cdiv(ctx_cap, min_chunk)))
    if num_splits > 1:
        o_part = _workspace((num_splits, T, H, D), q.device)
        lse_part = _workspace((num_splits, T, H), q.device)
    else:
        o_part = lse_part = out  # unused
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _paged_attn_kernel[(n_tiles, kv_heads, num_splits)](
        q, k_cache, v_cache, out, o_part, lse_part,
        query_start_loc, seq_lens, block_tables,
        scale * math.log2(math.e), B, T, H, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_P2=group_p2, TQ=tq, SEARCH_STEPS=SEARCH_STEPS, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_N=bn, BLOCK_SIZE=block_size, SPLIT_K=num_splits > 1, MIN_CHUNK=triton.cdiv(min_chunk, bn) * bn,
        ONE_TILE_PER_REQ=decode, PRECISION=precision,
        LOOP_WHILE=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=warps, num_stages=NUM_STAGES, **pdl(q),
    )
    if num_splits > 1:
        _attn_reduce_kernel[(T * H,)](out, o_part, lse_part, T * H, H, out.stride(0), out.stride(1), num_splits,
                                      HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
                                      SPLIT_CHUNK=SPLIT_CHUNK, num_warps=4, **pdl(out))
    return out


def _paged_attention_torch(q, k_cache, v_cache, batch: ForwardBatch, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    qsl = batch.query_start_loc_cpu
    for i, ctx in enumerate(batch.seq_lens_cpu):
        start, end = qsl[i], qsl[i + 1]
        n_blocks = -(-ctx // block_size)
        blocks = batch.block_tables[i, :n_blocks].long()
        k = k_cache[blocks].reshape(-1, kv_heads, k_cache.shape[-1])[:ctx].repeat_interleave(group, dim=1)
        v = v_cache[blocks].reshape(-1, kv_heads, v_cache.shape[-1])[:ctx].repeat_interleave(group, dim=1)
        qi = q[start:end]
        scores = torch.einsum("qhd,khd->hqk", qi.float(), k.float()) * scale
        q_pos = torch.arange(ctx - (end - start), ctx, device=q.device)
        causal = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~causal[None], float("-inf"))
        probs = scores.softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
    return out
