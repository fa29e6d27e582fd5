"""Mixture of experts: fp32 softmax routing, top-k, optional renormalisation, SwiGLU experts.

Expert weights are fused: `gate_up [E, 2I, H]` (gate rows first) and `down [E, H, I]`.

Each op has a torch reference and a Triton path behind one dispatch (`use_triton(x)`: CUDA tensors take the
kernels). The Triton path never synchronises with the host, so a decode step that contains it can be captured in a
CUDA graph:

1. `route`: router logits by cuBLAS, then one kernel per token does the fp32 softmax, the top-k (k rounds of
   arg-max) and the renormalisation.
2. align (`moe_align`): the T*top_k (token, slot) pairs are grouped by expert on the device; each expert's segment
   is padded up to a multiple of BLOCK_M with the sentinel T*top_k. It yields `sorted_ids [P_max]` (pair indices,
   sentinel in the padding), `block_expert [P_max / BLOCK_M]` (the expert of each block) and `total [1]` (the
   padded count). P_max = T*top_k + min(E, T*top_k) * (BLOCK_M - 1), rounded up to BLOCK_M, is the worst case and
   known on the host; blocks at or past `total` exit at once (so the align leaves them unwritten). The experts'
   histogram places each expert's segment; each pair goes to its expert's segment in pair order (deterministic).
   Up to 1024 pairs (decode, verify) several programs each place 64 pairs by their rank among their expert's
   earlier pairs; more pairs take a program per chunk of 1024, which sorts (expert, pair) keys in registers after
   a counting launch has made every chunk's histogram. A sort-based torch reference gives the same layout.
   Ranked routing (`route_logits(..., ranked=True)`, up to 1024 pairs: the model's decode and verify steps): the
   routing kernel counts each pair into its expert's counter by an atomic add, whose old value is the pair's rank,
   so the align only places pairs (counting ranks was most of its time at verify sizes: 9 of 16 µs on the H200).
   The order inside an expert's segment is then the atomics' (not pair order); no result depends on it, since
   every pair's row is computed on its own and lands in the pair's own row of `buf`. The counters are one zeroed
   buffer per device that every MoE layer shares (one after another on a stream); the gate/up kernel of a ranked
   routing zeroes them again once the align has read them. Up to RANK_PAIRS pairs (one request's decode or verify
   step, where launches cost more than work) one program routes every token and then aligns the pairs in pair
   order, counting their ranks itself (`_route_align_kernel`): one launch for both, no counters.
3. `_moe_gate_up_kernel`: a grouped GEMM over (block, I tile): gathers the block's token rows of x, multiplies by
   the block's expert's gate and up rows (two fp32 accumulators) and writes SiLU(gate) * up to `inter [P_max, I]`.
   Only experts that received tokens own blocks, so at decode only the routed experts' weights are read.
4. `_moe_down_kernel`: a grouped GEMM over (block, H tile) of `inter` by the expert's down weight, scaled by the
   routing weight and stored to the pair's own row of `buf [T*top_k, H]` (each pair is written exactly once: no
   atomics). `buf.view(T, top_k, H).sum(1)` then adds the top_k contributions in a fixed order: deterministic.

FP8 experts (e4m3 weights with 128 x 128 block scales) run the same two kernels with e4m3 dots: x is quantised per
token and 128-channel group before step 3 (by the norm that produced it, when it did: `activation_groups`), and
`inter` per pair row (up to `total`, read on the device) before step 4, by one launch of `tandem/ops/fp8.py`'s
group quantiser; each K step is one group, rescaled once (at prefill sizes with Hopper's fast accumulation inside
the group: `fp8.dot_mode`).
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tandem.ops.fp8 import dot_mode, w8a8_linear_torch
from tandem.ops.pointwise import gated_sum, silu_mul_torch
from tandem.ops.triton_utils import HAS_TRITON, pdl, use_triton, zeroed_counters

# (token, slot) pairs one align program sorts in registers; more pairs take more programs. Up to this many pairs
# (decode, verify) the align ranks pairs instead, RANK_PAIRS a program
ALIGN_CHUNK = 1024
RANK_PAIRS = 64


class Aligned(NamedTuple):
    """The pairs already aligned (`moe_align`'s three results, for blocks of `block_m` rows), as the routing of a
    few tokens hands them to `fused_experts` in place of ranks (`route_logits`)."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    total: torch.Tensor
    block_m: int


if HAS_TRITON:
    import triton
    import triton.language as tl

    from tandem.ops.fp8 import activation_groups, group_dot, quantize_activations_triton
    from tandem.ops.triton_utils import wait_for_prior_kernels

    @triton.jit
    def _route_token(t, logits_ptr, shared_ptr, w_out_ptr, e_out_ptr, E, stride_t, stride_s, TOP_K: tl.constexpr,
                     K_P2: tl.constexpr, E_P2: tl.constexpr, RENORM: tl.constexpr, SHARED: tl.constexpr):
        """Token t: fp32 softmax over E logits, top-k by k rounds of arg-max (lowest index on ties), renorm.
        SHARED: one more pair, expert E with weight sigmoid(shared logit). Stores its pairs' weights and experts;
        returns the experts and their slots."""
        ex = tl.arange(0, E_P2)
        valid = ex < E
        z = tl.load(logits_ptr + t * stride_t + ex, mask=valid, other=float("-inf")).to(tl.float32)
        p = tl.exp(z - tl.max(z, axis=0))
        p = tl.where(valid, p, 0.0)
        p = p / tl.sum(p, axis=0)
        rest = tl.where(valid, p, -1.0)
        ks = tl.arange(0, K_P2)
        top_w = tl.zeros([K_P2], tl.float32)
        top_e = tl.zeros([K_P2], tl.int64)
        for j in tl.static_range(TOP_K):
            m = tl.max(rest, axis=0)
            idx = tl.minimum(tl.min(tl.where(rest == m, ex, E_P2), axis=0), E - 1)  # NaN logits: stay in range
            top_w = tl.where(ks == j, m, top_w)
            top_e = tl.where(ks == j, idx.to(tl.int64), top_e)
            rest = tl.where(ex == idx, -2.0, rest)
        if RENORM:
            top_w = top_w / tl.sum(top_w, axis=0)
        width: tl.constexpr = TOP_K + SHARED
        if SHARED:
            top_w = tl.where(ks == TOP_K, tl.sigmoid(tl.load(shared_ptr + t * stride_s).to(tl.float32)), top_w)
            top_e = tl.where(ks == TOP_K, E, top_e)
        tl.store(w_out_ptr + t * width + ks, top_w.to(w_out_ptr.dtype.element_ty), mask=ks < width)
        tl.store(e_out_ptr + t * width + ks, top_e, mask=ks < width)
        return top_e, ks

    @triton.jit
    def _route_kernel(logits_ptr, shared_ptr, w_out_ptr, e_out_ptr, counts_ptr, rank_out_ptr, E, stride_t, stride_s,
                      TOP_K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, RENORM: tl.constexpr,
                      SHARED: tl.constexpr, RANKED: tl.constexpr, PDL: tl.constexpr):
        """One token a program (`_route_token`). RANKED: each pair's rank among its expert's pairs, from the
        expert's counter."""
        wait_for_prior_kernels(PDL)
        t = tl.program_id(0).to(tl.int64)
        top_e, ks = _route_token(t, logits_ptr, shared_ptr, w_out_ptr, e_out_ptr, E, stride_t, stride_s, TOP_K,
                                 K_P2, E_P2, RENORM, SHARED)
        if RANKED:
            width: tl.constexpr = TOP_K + SHARED
            tl.store(rank_out_ptr + t * width + ks, tl.atomic_add(counts_ptr + top_e, 1, mask=ks < width),
                     mask=ks < width)

    @triton.jit(do_not_specialize=["T"])
    def _route_align_kernel(logits_ptr, shared_ptr, w_out_ptr, e_out_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                            T, E, stride_t, stride_s, TOP_K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr,
                            RENORM: tl.constexpr, SHARED: tl.constexpr, EX_P2: tl.constexpr, N_P2: tl.constexpr,
                            BLOCK_M: tl.constexpr, B_CHUNK: tl.constexpr, PDL: tl.constexpr):
        """A few tokens (at most N_P2 pairs: a decode or verify step of one request) in one program: it routes
        them one after another, then aligns their pairs as one `_moe_align_ranks_kernel` program would (the
        histogram and ranks counted here; EX_P2 covers the experts, the shared one included). One launch
        instead of two, with no counters."""
        wait_for_prior_kernels(PDL)
        t = 0
        while t < T:  # while: the interpreter cannot take a runtime value as a range() bound
            _route_token(t, logits_ptr, shared_ptr, w_out_ptr, e_out_ptr, E, stride_t, stride_s, TOP_K, K_P2, E_P2,
                         RENORM, SHARED)
            t += 1
        tl.debug_barrier()  # every thread's pairs stored before any thread reads them back
        _place_pairs(0, 1, e_out_ptr, e_out_ptr, e_out_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                     T * (TOP_K + SHARED), EX_P2, N_P2, N_P2, N_P2, BLOCK_M, B_CHUNK, False)

    @triton.jit(do_not_specialize=["N"])
    def _moe_count_kernel(experts_ptr, counts_ptr, N, E_P2: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
        """counts[c] = histogram of the experts of pairs [c * CHUNK, (c + 1) * CHUNK)."""
        wait_for_prior_kernels(PDL)
        c = tl.program_id(0)
        pair = c * CHUNK + tl.arange(0, CHUNK)
        e = tl.load(experts_ptr + pair, mask=pair < N, other=0).to(tl.int32)
        tl.store(counts_ptr + c * E_P2 + tl.arange(0, E_P2), tl.histogram(e, E_P2, mask=pair < N))

    @triton.jit(do_not_specialize=["N", "n_chunks"])
    def _moe_align_kernel(experts_ptr, counts_ptr, sorted_ptr, block_expert_ptr, total_ptr, N, n_chunks,
                          E_P2: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, B_CHUNK: tl.constexpr,
                          PDL: tl.constexpr):
        """One program per chunk of CHUNK pairs (more than one chunk: fewer pairs take `_moe_align_ranks_kernel`). The
        chunks' histograms from `_moe_count_kernel` give each expert's padded segment and this chunk's offset inside it
        (the pairs of the chunks before). Sorting the keys expert * CHUNK + local index puts the chunk's pairs in expert
        order, each expert's in pair order, so across chunks every expert's pairs lie in pair order (deterministic: the
        layout of `_moe_align_torch`). Each program also writes the sentinel N into the padding of the experts e = c
        (mod n_chunks) and a share of `block_expert` (block b's expert: the number of experts whose segment ends at or
        before b * BLOCK_M); pairs and sentinels go to distinct slots, so no program waits for another. Blocks at or
        past `total` stay unwritten: the GEMM kernels return before reading them."""
        wait_for_prior_kernels(PDL)
        c = tl.program_id(0)
        i = tl.arange(0, CHUNK)
        n_here = tl.minimum(N - c * CHUNK, CHUNK)
        e = tl.load(experts_ptr + c * CHUNK + i, mask=i < n_here, other=E_P2).to(tl.int32)  # padding sorts last
        ex = tl.arange(0, E_P2)
        mine = tl.load(counts_ptr + c * E_P2 + ex)
        counts, before = tl.zeros([E_P2], tl.int32), tl.zeros([E_P2], tl.int32)
        k = 0
        while k < n_chunks:  # while loops: the interpreter cannot take a runtime value as a range() bound
            row = tl.load(counts_ptr + k * E_P2 + ex)
            counts += row
            before += tl.where(k < c, row, 0)
            k += 1
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        starts = ends - padded
        total = tl.sum(padded, axis=0)
        if c == 0:
            tl.store(total_ptr, total)
        keys = tl.sort(e * CHUNK + i)
        expert, local = keys // CHUNK, keys % CHUNK
        shift = starts + before - (tl.cumsum(mine, axis=0) - mine)  # sorted position i -> slot i + shift[expert]
        dest = i + tl.gather(shift, tl.minimum(expert, E_P2 - 1), 0)
        tl.store(sorted_ptr + dest, c * CHUNK + local, mask=i < n_here)  # sorted positions < n_here are real
        _pad_and_own(sorted_ptr, block_expert_ptr, counts, padded, ends, total, N, c, n_chunks, E_P2, BLOCK_M,
                     B_CHUNK)

    @triton.jit
    def _pad_and_own(sorted_ptr, block_expert_ptr, counts, padded, ends, total, N, c, n_programs,
                     E_P2: tl.constexpr, BLOCK_M: tl.constexpr, B_CHUNK: tl.constexpr):
        """Program c of n_programs writes the sentinel N into the padding of the experts e = c (mod n_programs)
        and its share of `block_expert` (block b's expert: the number of experts whose segment ends at or before
        b * BLOCK_M), from the experts' counts, padded counts and segment ends."""
        ex = tl.arange(0, E_P2)
        j = tl.arange(0, BLOCK_M)
        pad = ((ex % n_programs) == c)[:, None] & (j[None, :] < (padded - counts)[:, None])
        tl.store(sorted_ptr + (ends - padded + counts)[:, None] + j[None, :],
                 tl.zeros([E_P2, BLOCK_M], tl.int32) + N, mask=pad)
        n_blocks = total // BLOCK_M
        share = (n_blocks + n_programs - 1) // n_programs
        b = 0
        while b < share:
            step = b + tl.arange(0, B_CHUNK)
            blk = c * share + step
            owner = tl.sum((ends[None, :] <= blk[:, None] * BLOCK_M).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + blk, owner, mask=(step < share) & (blk < n_blocks))
            b += B_CHUNK

    @triton.jit(do_not_specialize=["N"])
    def _moe_align_ranks_kernel(experts_ptr, counts_ptr, ranks_ptr, sorted_ptr, block_expert_ptr, total_ptr, N,
                                E_P2: tl.constexpr, N_P2: tl.constexpr, PAIRS: tl.constexpr, J_TILE: tl.constexpr,
                                BLOCK_M: tl.constexpr, B_CHUNK: tl.constexpr, RANKED: tl.constexpr, PDL: tl.constexpr):
        """The layout of `_moe_align_kernel` for up to N_P2 pairs (decode, verify) by several programs instead of
        one (`_place_pairs`)."""
        wait_for_prior_kernels(PDL)
        _place_pairs(tl.program_id(0), tl.num_programs(0), experts_ptr, counts_ptr, ranks_ptr, sorted_ptr,
                     block_expert_ptr, total_ptr, N, E_P2, N_P2, PAIRS, J_TILE, BLOCK_M, B_CHUNK, RANKED)

    @triton.jit
    def _place_pairs(p, n_programs, experts_ptr, counts_ptr, ranks_ptr, sorted_ptr, block_expert_ptr, total_ptr, N,
                     E_P2: tl.constexpr, N_P2: tl.constexpr, PAIRS: tl.constexpr, J_TILE: tl.constexpr,
                     BLOCK_M: tl.constexpr, B_CHUNK: tl.constexpr, RANKED: tl.constexpr):
        """Program p of n_programs: each builds the whole histogram itself, places pairs [p * PAIRS, (p + 1) *
        PAIRS) at their expert's segment start plus their rank among that expert's earlier pairs (counted in
        [PAIRS, J_TILE] tiles: no sort), and writes its share of the padding and of `block_expert`. RANKED: the
        counts and ranks come from the routing kernel's counters instead."""
        pairs = tl.arange(0, N_P2)
        if RANKED:
            counts = tl.load(counts_ptr + tl.arange(0, E_P2))
        else:
            counts = tl.histogram(tl.load(experts_ptr + pairs, mask=pairs < N, other=0).to(tl.int32), E_P2,
                                  mask=pairs < N)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        total = tl.sum(padded, axis=0)
        if p == 0:
            tl.store(total_ptr, total)
        i = p * PAIRS + tl.arange(0, PAIRS)
        e = tl.load(experts_ptr + i, mask=i < N, other=0).to(tl.int32)
        if RANKED:
            rank = tl.load(ranks_ptr + i, mask=i < N, other=0)
        else:
            rank = tl.zeros([PAIRS], tl.int32)
            for j0 in tl.static_range(0, N_P2, J_TILE):
                if j0 < (p + 1) * PAIRS:  # tiles wholly after this program's pairs count nothing
                    j = j0 + tl.arange(0, J_TILE)
                    ej = tl.load(experts_ptr + j, mask=j < N, other=E_P2).to(tl.int32)  # padding: no expert's
                    rank += tl.sum(((ej[None, :] == e[:, None]) & (j[None, :] < i[:, None])).to(tl.int32), axis=1)
        tl.store(sorted_ptr + tl.gather(ends - padded, e, 0) + rank, i, mask=i < N)
        _pad_and_own(sorted_ptr, block_expert_ptr, counts, padded, ends, total, N, p, n_programs, E_P2,
                     BLOCK_M, B_CHUNK)

    @triton.jit
    def _block_rows(sorted_ptr, block_expert_ptr, pid_m, N_PAIRS, BLOCK_M: tl.constexpr):
        """A block's expert, its rows in the sorted order, their token-expert pair ids and which are real."""
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + offs_m)
        return e, offs_m, pair, pair < N_PAIRS

    @triton.jit(do_not_specialize=["N_PAIRS"])
    def _moe_gate_up_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, inter_ptr, sorted_ptr, block_expert_ptr, total_ptr, N_PAIRS,
                            counts_ptr, stride_x, TOP_K: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            PRECISION: tl.constexpr, FP8: tl.constexpr, GROUP_N: tl.constexpr, DOT: tl.constexpr,
                            ZERO_COUNTS: tl.constexpr, PDL: tl.constexpr):
        """FP8: x is e4m3 with scales xs [T, KB] (quantised per token and group), w e4m3 with scales
        ws [E, 2 * IB, KB] (gate rows' scale rows, then up rows'); BLOCK_K is the group, so each K step rescales
        its products once. ZERO_COUNTS (a ranked routing, whose align is done): the first program zeroes the
        routing counters for the next layer."""
        wait_for_prior_kernels(PDL)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if ZERO_COUNTS > 0:
            if (pid_m == 0) & (pid_n == 0):
                tl.store(counts_ptr + tl.arange(0, ZERO_COUNTS), tl.zeros([ZERO_COUNTS], tl.int32))
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        e, offs_m, pair, valid = _block_rows(sorted_ptr, block_expert_ptr, pid_m, N_PAIRS, BLOCK_M)
        tok = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < I
        k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tok[:, None] * stride_x + k[None, :]
        g_ptrs = w_ptr + e * (2 * I * H) + n[None, :].to(tl.int64) * H + k[:, None]  # [BLOCK_K, BLOCK_N]
        u_ptrs = g_ptrs + I * H
        KB: tl.constexpr = (H + BLOCK_K - 1) // BLOCK_K
        IB: tl.constexpr = (I + GROUP_N - 1) // GROUP_N
        gs_ptrs = ws_ptr + e * (2 * IB * KB) + (n // GROUP_N) * KB
        xs_ptrs = xs_ptr + tok * KB
        us_ptrs = gs_ptrs + IB * KB
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(KB):
            if H % BLOCK_K == 0:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                wg = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
                wu = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = kb * BLOCK_K + k < H
                a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
                wg = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                wu = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FP8:
                s = tl.load(xs_ptrs + kb, mask=valid, other=0.0)
                sg = tl.load(gs_ptrs + kb, mask=n_ok, other=0.0)
                su = tl.load(us_ptrs + kb, mask=n_ok, other=0.0)
                acc_g += group_dot(a, wg, s, sg, DOT)
                acc_u += group_dot(a, wu, s, su, DOT)
            else:
                acc_g = tl.dot(a, wg, acc_g, input_precision=PRECISION)
                acc_u = tl.dot(a, wu, acc_u, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        out_ptrs = inter_ptr + offs_m[:, None].to(tl.int64) * I + n[None, :]
        tl.store(out_ptrs, act.to(inter_ptr.dtype.element_ty), mask=n_ok[None, :])

    @triton.jit(do_not_specialize=["N_PAIRS"])
    def _moe_down_kernel(inter_ptr, is_ptr, w_ptr, ws_ptr, buf_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                         route_w_ptr, N_PAIRS, H: tl.constexpr, I: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr, FP8: tl.constexpr, GROUP_N: tl.constexpr, DOT: tl.constexpr,
                         PDL: tl.constexpr):
        """FP8: `inter` is e4m3 with scales is [P_max, KB] (per row and group), w e4m3 with scales
        ws [E, HB, KB]."""
        wait_for_prior_kernels(PDL)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        e, offs_m, pair, valid = _block_rows(sorted_ptr, block_expert_ptr, pid_m, N_PAIRS, BLOCK_M)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < H
        k = tl.arange(0, BLOCK_K)
        a_ptrs = inter_ptr + offs_m[:, None].to(tl.int64) * I + k[None, :]
        w_ptrs = w_ptr + e * (H * I) + n[None, :].to(tl.int64) * I + k[:, None]  # [BLOCK_K, BLOCK_N]
        KB: tl.constexpr = (I + BLOCK_K - 1) // BLOCK_K
        HB: tl.constexpr = (H + GROUP_N - 1) // GROUP_N
        ws_ptrs = ws_ptr + e * (HB * KB) + (n // GROUP_N) * KB
        is_ptrs = is_ptr + offs_m.to(tl.int64) * KB
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(KB):
            if I % BLOCK_K == 0:
                a = tl.load(a_ptrs)
                w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = kb * BLOCK_K + k < I
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FP8:
                s = tl.load(is_ptrs + kb)
                sw = tl.load(ws_ptrs + kb, mask=n_ok, other=0.0)
                acc += group_dot(a, w, s, sw, DOT)
            else:
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        rw = tl.load(route_w_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
        out_ptrs = buf_ptr + pair[:, None].to(tl.int64) * H + n[None, :]
        tl.store(out_ptrs, acc.to(buf_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------------------------------- dispatch

def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool):
    return route_logits(F.linear(x, router_weight), top_k, renormalize)


def route_logits(logits: torch.Tensor, top_k: int, renormalize: bool, shared_logit: torch.Tensor | None = None,
                 ranked: bool | None = None):
    """Router logits [T, E] -> (weights [T, top_k] in the logits' dtype, experts int64): fp32 softmax, top-k,
    optional renormalisation. (The model's router GEMM is fused with the shared expert's, so it passes logits.)
    With `shared_logit` [T, 1]: one more pair per token, expert E (the shared expert, see `Experts.host`) with
    weight sigmoid(shared_logit), so both are [T, top_k + 1]. `ranked` given: a third result, each pair's rank
    among its expert's pairs (int32, same shape) when `ranked` and the kernel path counted them (up to
    ALIGN_CHUNK pairs), else None; ranks must go to `fused_experts` with these experts, which resets the
    counters they came from. Up to RANK_PAIRS pairs (one request's decode or verify step) the kernel path
    aligns them in the routing launch instead, and the third result is that layout (`Aligned`), for
    `fused_experts` in place of ranks, with the experts all on this rank (the shared expert as expert E)."""
    if use_triton(logits):
        return route_logits_triton(logits, top_k, renormalize, shared_logit, ranked)
    out = route_logits_torch(logits, top_k, renormalize, shared_logit)
    return out if ranked is None else (*out, None)


def fused_experts(x, gate_up, down, weights, experts, *, gate_up_scale=None, down_scale=None,
                  block=None, shared=None, shared_logit=None, summed=True, ranks=None) -> torch.Tensor:
    """x: [T, H]; weights, experts: [T, top_k] -> [T, H]. FP8 experts: e4m3 `gate_up` / `down` with their
    scales and block (see `Experts`); activations are quantised per token and group of block[1] channels.
    `shared` [T, H] and `shared_logit` [T, 1]: plus the gated shared expert, sigmoid(shared_logit) * shared
    (the kernel path adds it in the pass that sums the experts' outputs). `summed=False` (no `shared`): the
    kernel path may return the weighted per-pair outputs [T, top_k, H] unsummed, for the next residual add to
    sum (`add_rms_norm_1p` takes them): one launch fewer. `ranks`: from `route_logits(..., ranked=True)`."""
    fp8 = dict(gate_up_scale=gate_up_scale, down_scale=down_scale, block=block)
    if use_triton(x):
        return fused_experts_triton(x, gate_up, down, weights, experts, **fp8, shared=shared,
                                    shared_logit=shared_logit, summed=summed, ranks=ranks)
    out = _fused_experts_torch(x, gate_up, down, weights, experts, **fp8)
    return out if shared is None else out + torch.sigmoid(shared_logit) * shared


# ---------------------------------------------------------------------------------------------------- torch

def route_torch(x, router_weight, top_k, renormalize):
    return route_logits_torch(F.linear(x, router_weight), top_k, renormalize)


def route_logits_torch(logits, top_k, renormalize, shared_logit=None):
    weights, experts = logits.softmax(dim=-1, dtype=torch.float32).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights.to(logits.dtype)
    if shared_logit is None:
        return weights, experts
    shared = torch.full_like(experts[:, :1], logits.shape[1])
    shared_weight = torch.sigmoid(shared_logit.float()).to(logits.dtype)
    return torch.cat([weights, shared_weight], 1), torch.cat([experts, shared], 1)


def _expert_linear(x, w, scale, block):
    return F.linear(x, w) if scale is None else w8a8_linear_torch(x, w, scale, block)


def _fused_experts_torch(x, gate_up, down, weights, experts, gate_up_scale=None, down_scale=None, block=None):
    I, half = gate_up.shape[1] // 2, None if gate_up_scale is None else gate_up_scale.shape[1] // 2
    out = torch.zeros_like(x)
    flat = experts.flatten()
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    token_of = order // experts.shape[1]
    w_of = weights.flatten()[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = token_of[start : start + n]
        gs, us, ds = (None, None, None) if half is None else \
            (gate_up_scale[e, :half], gate_up_scale[e, half:], down_scale[e])
        gate, up = _expert_linear(x[tok], gate_up[e, :I], gs, block), _expert_linear(x[tok], gate_up[e, I:], us, block)
        y = _expert_linear(silu_mul_torch(gate, up), down[e], ds, block) * w_of[start : start + n, None]
        out.index_add_(0, tok, y.to(out.dtype))
        start += n
    return out


# ---------------------------------------------------------------------------------------------------- triton

def routing_counters(device, experts_p2: int) -> torch.Tensor:
    """The per-expert counters of ranked routing (every MoE layer's, `zeroed_counters`)."""
    return zeroed_counters("moe routing", device, experts_p2, 512)


def route_logits_triton(logits, top_k, renormalize, shared_logit=None, ranked=None):
    T, E = logits.shape
    width = top_k + (shared_logit is not None)
    weights = torch.empty(T, width, dtype=logits.dtype, device=logits.device)
    experts = torch.empty(T, width, dtype=torch.int64, device=logits.device)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    shared = logits if shared_logit is None else shared_logit
    if ranked and 0 < T * width <= RANK_PAIRS:
        return weights, experts, _route_and_align(logits, shared, shared_logit is not None, weights, experts, top_k,
                                                  renormalize)
    wanted, ranked = ranked is not None, bool(ranked) and 0 < T * width <= ALIGN_CHUNK  # more: sorting path
    ranks = torch.empty(T, width, dtype=torch.int32, device=logits.device) if ranked else None
    if T:
        counts = routing_counters(logits.device, triton.next_power_of_2(E + 1)) if ranked else experts
        # the router's columns of the fused MoE projection are read in place (row stride of the fused output)
        _route_kernel[(T,)](logits, shared, weights, experts, counts, ranks if ranked else experts, E,
                            logits.stride(0), shared.stride(0), TOP_K=top_k, K_P2=triton.next_power_of_2(width),
                            E_P2=triton.next_power_of_2(E), RENORM=renormalize, SHARED=shared_logit is not None,
                            RANKED=ranked, num_warps=1 if E <= 1024 else 4, **pdl(logits))
    return (weights, experts, ranks) if wanted else (weights, experts)


def _route_and_align(logits, shared, with_shared, weights, experts, top_k, renormalize) -> Aligned:
    """`_route_align_kernel` into `weights` and `experts`; the layout for the block rows `fused_experts` takes
    at this many pairs over these experts (the shared expert, when routed, as expert E)."""
    T, E = logits.shape
    n_experts = E + with_shared
    n = experts.numel()
    block_m = _configs(n, n_experts)[0]
    out = Aligned(*_align_buffers(n, n_experts, block_m, logits.device), block_m)
    _route_align_kernel[(1,)](
        logits, shared, weights, experts, out.sorted_ids, out.block_expert, out.total, T, E, logits.stride(0),
        shared.stride(0), TOP_K=top_k, K_P2=triton.next_power_of_2(weights.shape[1]), E_P2=triton.next_power_of_2(E),
        RENORM=renormalize, SHARED=with_shared, EX_P2=triton.next_power_of_2(n_experts),
        N_P2=max(16, triton.next_power_of_2(n)), BLOCK_M=block_m, B_CHUNK=16, num_warps=4, **pdl(logits))
    return out


def padded_size(n_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case padded pair count (a multiple of block_m): every non-empty expert wastes up to block_m - 1."""
    worst = n_pairs + min(num_experts, n_pairs) * (block_m - 1)
    return -(-worst // block_m) * block_m


def _align_buffers(n_pairs: int, num_experts: int, block_m: int, device):
    """Uninitialised (sorted_ids, block_expert, total) for an align of `n_pairs` pairs (see `moe_align`)."""
    p_max = padded_size(n_pairs, num_experts, block_m)
    return (torch.empty(p_max, dtype=torch.int32, device=device),
            torch.empty(p_max // block_m, dtype=torch.int32, device=device),
            torch.empty(1, dtype=torch.int32, device=device))


def moe_align(experts: torch.Tensor, num_experts: int, block_m: int, use_kernel: bool = True, *, out=None,
              ranks=None):
    """experts [T, top_k] -> (sorted_ids [P_max] int32, block_expert [P_max // block_m] int32, total [1] int32);
    see the module docstring. Nothing here waits for the device. The kernel leaves sorted_ids[total:] and
    block_expert[total // block_m:] unwritten (the GEMM kernels never read past total); only [0, total) and the
    first total // block_m blocks are the result. use_kernel=False: the torch reference. `out` (kernel only;
    tests): the three output buffers to fill in place instead of fresh torch.empty ones, so that a test can
    pre-fill them and see what is left unwritten. `ranks` (kernel only): the pairs' ranks of a ranked routing,
    whose counters the align reads (each expert's pairs then sit in the atomics' order, not in pair order)."""
    flat = experts.reshape(-1)
    n = flat.numel()
    p_max = padded_size(n, num_experts, block_m)
    if use_kernel:
        if out is None:
            sorted_ids, block_expert, total = _align_buffers(n, num_experts, block_m, flat.device)
        else:
            sorted_ids, block_expert, total = out
            assert sorted_ids.shape == (p_max,) and block_expert.shape == (p_max // block_m,)
            assert total.shape == (1,) and {t.dtype for t in out} == {torch.int32}
        e_p2 = triton.next_power_of_2(num_experts)
        assert ranks is None or 0 < n <= ALIGN_CHUNK
        if 0 < n <= ALIGN_CHUNK:
            n_p2 = max(16, triton.next_power_of_2(n))
            pairs = min(RANK_PAIRS, n_p2)
            counts = routing_counters(flat.device, e_p2) if ranks is not None else flat
            _moe_align_ranks_kernel[(triton.cdiv(n, pairs),)](
                flat.contiguous(), counts, flat if ranks is None else ranks.reshape(-1), sorted_ids, block_expert,
                total, n, E_P2=e_p2, N_P2=n_p2, PAIRS=pairs, J_TILE=min(128, n_p2), BLOCK_M=block_m, B_CHUNK=16,
                RANKED=ranks is not None, num_warps=4, **pdl(counts))
        elif n:
            chunk = ALIGN_CHUNK
            n_chunks = triton.cdiv(n, chunk)
            flat = flat.contiguous()
            counts = torch.empty(n_chunks, e_p2, dtype=torch.int32, device=flat.device)
            _moe_count_kernel[(n_chunks,)](flat, counts, n, E_P2=e_p2, CHUNK=chunk, num_warps=4, **pdl(counts))
            _moe_align_kernel[(n_chunks,)](flat, counts, sorted_ids, block_expert, total, n, n_chunks, E_P2=e_p2,
                                           CHUNK=chunk, BLOCK_M=block_m, B_CHUNK=16, num_warps=4, **pdl(counts))
        else:
            total.zero_()
        return sorted_ids, block_expert, total
    assert out is None, "out is for the kernel path"
    return _moe_align_torch(flat, num_experts, block_m, p_max)


def _moe_align_torch(flat, num_experts, block_m, p_max):
    """The same layout by a stable sort (gathers and scatters by index_select / scatter_: no host sync)."""
    n, dev = flat.numel(), flat.device
    flat = flat.long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat.index_select(0, order)
    first = counts.cumsum(0) - counts  # each expert's first position in the unpadded sorted order
    slot = (ends - padded - first).index_select(0, sorted_e) + torch.arange(n, device=dev)
    sorted_ids = torch.full((p_max,), n, dtype=torch.int32, device=dev).scatter_(0, slot, order.to(torch.int32))
    starts = torch.arange(0, p_max, block_m, device=dev)
    block_expert = torch.searchsorted(ends, starts, right=True).to(torch.int32)
    return sorted_ids, block_expert, ends[-1:].to(torch.int32)


def _configs(n_pairs: int, num_experts: int, fp8: bool = False):
    """(BLOCK_M, gate_up (BLOCK_N, BLOCK_K, warps, stages), down (...), `group_dot`'s DOT). Few tokens per expert
    (decode, verify): BLOCK_M 16 and narrow N tiles so the few touched experts still spread over every SM; many
    (prefill): 64, compute-bound (FP8: the fast DOT, and a narrower down tile: 13% faster on an H100). The
    narrowest tiles stop at ALIGN_CHUNK pairs too: past it the align is the chunked kernel, which with 16-row
    blocks only a window of a few pairs would reach (1025-1028 pairs over 257 experts: 114 tokens), too narrow
    for the warm-up to compile it before serving does."""
    if n_pairs <= min(4 * num_experts, ALIGN_CHUNK):  # on average up to 4 tokens per expert
        block_m, gate_up, down = 16, (32, 128, 4, 4), (64, 128, 4, 4)
    elif n_pairs <= 16 * num_experts:
        block_m, gate_up, down = 32, (64, 64, 4, 4), (64, 64, 4, 4)
    else:
        block_m, gate_up, down = 64, (64, 64, 4, 3), (64, 128, 4, 3) if fp8 else (128, 64, 8, 3)
    return block_m, gate_up, down, dot_mode(block_m)


def fused_experts_triton(x, gate_up, down, weights, experts, *, gate_up_scale=None, down_scale=None, block=None,
                         shared=None, shared_logit=None, summed=True, ranks=None, block_m=None, gate_up_cfg=None,
                         down_cfg=None, align_kernel=True, buf=None, dot=None):
    """The Triton path (see the module docstring). The keyword arguments after `summed` override tiling and the
    align method and give the [T*top_k, H] per-pair buffer (tests). FP8: BLOCK_K is the activation group."""
    T, H = x.shape
    E, two_i, _ = gate_up.shape
    inter_size = two_i // 2
    top_k = experts.shape[1]
    n_pairs = T * top_k
    if T == 0:
        return torch.zeros_like(x)
    fp8 = block is not None
    bm, gu, dn, size_dot = _configs(n_pairs, E, fp8)
    bm, gu, dn, dot = block_m or bm, gate_up_cfg or gu, down_cfg or dn, size_dot if dot is None else dot
    x = x.contiguous() if x.stride(1) != 1 else x
    gate_up, down = gate_up.contiguous(), down.contiguous()
    route_w = weights.reshape(-1).contiguous()
    if isinstance(ranks, Aligned):  # the routing launch aligned the pairs already
        assert ranks.block_m == bm, "aligned for other block rows than this tiling's"
        sorted_ids, block_expert, total, _ = ranks
        ranks = None  # no counters to reset
    else:
        sorted_ids, block_expert, total = moe_align(experts, E, bm, align_kernel, ranks=ranks)
    num_blocks = block_expert.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    group_n = block[0] if fp8 else 1
    # FP8: activations are quantised once per token (x) and per pair (SiLU(gate) * up, rows up to `total`), each
    # by a launch of its own (inside the GEMMs every N tile would redo the quantiser's divisions)
    xq, xs = activation_groups(x, block[1]) if fp8 else (x, x)
    inter = torch.empty(sorted_ids.shape[0], inter_size, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = gu
    e_p2 = triton.next_power_of_2(E)  # a ranked routing's counters, zeroed by the gate/up kernel once read
    counts = routing_counters(x.device, e_p2) if ranks is not None else total
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter_size, bn))](
        xq, xs, gate_up, gate_up_scale if fp8 else gate_up, inter, sorted_ids, block_expert, total, n_pairs, counts,
        xq.stride(0),
        TOP_K=top_k, H=H, I=inter_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block[1] if fp8 else bk,
        PRECISION=precision, FP8=fp8, GROUP_N=group_n, DOT=dot, ZERO_COUNTS=e_p2 if ranks is not None else 0,
        num_warps=warps, num_stages=stages, **pdl(xq))
    if buf is None:
        buf = torch.empty(n_pairs, H, dtype=x.dtype, device=x.device)
    inter_q, inter_s = quantize_activations_triton(inter, block[1], rows=total) if fp8 else (inter, inter)
    bn, bk, warps, stages = dn
    _moe_down_kernel[(num_blocks, triton.cdiv(H, bn))](
        inter_q, inter_s, down, down_scale if fp8 else down, buf, sorted_ids, block_expert, total, route_w, n_pairs,
        H=H, I=inter_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block[1] if fp8 else bk,
        PRECISION=precision, FP8=fp8, GROUP_N=group_n, DOT=dot, num_warps=warps, num_stages=stages, **pdl(buf))
    if shared is not None:
        return gated_sum(buf.view(T, top_k, H), shared, shared_logit)
    if top_k == 1:
        return buf.view(T, H)
    return buf.view(T, top_k, H).sum(1) if summed else buf.view(T, top_k, H)
