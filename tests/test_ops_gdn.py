"""GDN kernels (causal conv1d, gated delta rule) against their torch references: outputs, every written state slot
and pending buffer, untouched ones unchanged, every output element written; and the pending rows' contract (kept
rows replayed later give what committing them would have). CPU: the Triton kernels under the interpreter at small
sizes; GPU: the dispatch at Qwen3.5 sizes (fla's chunked prefill when fla is importable)."""

import pytest
import torch

from tandem.batch import ForwardBatch
from tandem.ops import gdn

# requests' row counts: decode (1), verify (k+1 = W), fewer than W, short and long prefill chunks
LENS = {1: [1, 1, 4, 37, 1], 3: [3, 1, 3, 2, 19, 3]}


def batch_of(lens, slots, replay, pending, device):
    qsl = torch.tensor([0] + lens).cumsum(0)
    T, B = int(qsl[-1]), len(lens)
    return ForwardBatch(
        input_ids=torch.zeros(T, dtype=torch.long, device=device),
        positions=torch.zeros(T, dtype=torch.long, device=device),
        query_start_loc=qsl.to(torch.int32).to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros(B, 1, dtype=torch.int32, device=device),
        slot_mapping=torch.zeros(T, dtype=torch.long, device=device),
        state_slots=torch.tensor(slots, device=device),
        state_replay=torch.tensor(replay, device=device),
        state_pending=torch.tensor(pending, device=device).view(B, 2),
        logits_indices=(qsl[1:] - 1).to(device),
        query_start_loc_cpu=qsl.tolist(),
        seq_lens_cpu=lens,
    )


def make_batch(lens, W, device, g, spare=3):
    """Each request owns one state slot (shuffled over the pool) and its two pending buffers; `spare` slots belong
    to no request and must stay untouched. Requests of at most FLA_MIN_ROWS rows replay 0..W rows from one of their
    buffers (by turns), and requests of at most W rows (verify rows) keep theirs in the other, all but every third;
    longer requests are prompt chunks, which do neither. Returns (batch, number of slots)."""
    slots = (torch.randperm(1 + len(lens) + spare, generator=g)[: len(lens)]).tolist()
    half = torch.randint(0, 2, (len(lens),), generator=g).tolist()
    replay = [i % (W + 1) if n <= gdn.FLA_MIN_ROWS else 0 for i, n in enumerate(lens)]
    pending = [(2 * s + h, 2 * s + 1 - h if n <= W and i % 3 != 2 else -1)
               for i, (s, h, n) in enumerate(zip(slots, half, lens))]
    return batch_of(lens, slots, replay, pending, device), 1 + len(lens) + spare


def gdn_inputs(T, nk, nv, dk, dv, slots, dtype, device, g):
    def r(*shape):
        return torch.randn(*shape, generator=g)

    # q, k, v as the model makes them: views into one [T, conv_dim] tensor
    qkv = r(T, 2 * nk * dk + nv * dv).to(device, dtype)
    q, k, v = qkv.split([nk * dk, nk * dk, nv * dv], dim=-1)
    # a and b as views into the fused projection's output (after z), A_log and dt_bias as the model holds them
    ba = r(T, 3 * nv).to(device, dtype)
    gates = gdn.Gates(ba[:, nv : 2 * nv], ba[:, 2 * nv :], (torch.rand(nv, generator=g) * 2 - 3).to(device),
                      (torch.rand(nv, generator=g) + 0.5).to(device, dtype))
    state = (r(slots, nv, dk, dv) * 0.3).to(device)  # fp32
    return q.view(T, nk, dk), k.view(T, nk, dk), v.view(T, nv, dv), gates, state


def pending_inputs(slots, W, width, dtype, device, g):
    """Every slot's two buffers of W kept rows, random (a replay reads them as a previous step left them)."""
    return torch.randn(2 * slots, W, width, generator=g).to(device, dtype)


def reference(q, k, v, gates, state, pending, batch):
    """The torch recurrence from the torch gates (each pinned to fp64 maths in its own test)."""
    return gdn._gated_delta_rule_torch(q, k, v, gates, state, pending, batch)


def conv_inputs(T, C, K, slots, dtype, device, g):
    x = torch.randn(T, C, generator=g).to(device, dtype)
    conv_state = torch.randn(slots, C, K - 1, generator=g).to(device, dtype)
    weight = (torch.randn(C, 1, K, generator=g) * 0.5).to(device, dtype)[:, 0, :]  # a view, as the model passes
    return x, conv_state, weight


def written(batch, skipped=()):
    """(The slots a step writes, the pending buffers and rows it writes) for the requests not skipped."""
    lens = [b - a for a, b in zip(batch.query_start_loc_cpu, batch.query_start_loc_cpu[1:])]
    reqs = [i for i in range(len(lens)) if i not in skipped]
    slots = {int(batch.state_slots[i]) for i in reqs}
    kept = {(int(batch.state_pending[i, 1]), lens[i]) for i in reqs if batch.state_pending[i, 1] >= 0}
    return slots, kept


def check_written(got_state, ref_state, before, got_pend, ref_pend, pend_before, batch, tol, skipped=()):
    """Written slots close to the reference's, the rest untouched; kept rows exactly the reference's copies, every
    other pending row untouched."""
    slots, kept = written(batch, skipped)
    for s in range(got_state.shape[0]):
        if s in slots:
            check_close(got_state[s], ref_state[s], tol)
        else:
            assert torch.equal(got_state[s], before[s]), s
    untouched = torch.ones(got_pend.shape[:2], dtype=torch.bool)
    for buf, n in kept:
        assert torch.equal(got_pend[buf, :n], ref_pend[buf, :n]), buf
        untouched[buf, :n] = False
    assert torch.equal(got_pend[untouched.to(got_pend.device)], pend_before[untouched.to(got_pend.device)])


def check_close(a, b, tol):
    if a.dtype == torch.bfloat16 or b.dtype == torch.bfloat16:
        a, b = a.float(), b.float()
        rel = (a - b).norm() / b.norm().clamp_min(1e-12)
        assert rel <= tol["rel"], rel
        torch.testing.assert_close(a, b, rtol=tol["elem"], atol=tol["elem"])
    else:
        torch.testing.assert_close(a, b, rtol=tol["elem"], atol=tol["elem"])


FP32 = {"elem": 2e-5, "rel": 1e-6}
BF16 = {"elem": 6e-2, "rel": 1.5e-2}
FLA_BF16 = {"elem": 1e-1, "rel": 3e-2}  # fla's chunked form also rounds its intermediates (normalised q/k, WY) to bf16


def run_gdn(fn, W, lens, nk, nv, dk, dv, dtype, device, tol, seed, **kw):
    g = torch.Generator().manual_seed(seed)
    batch, slots = make_batch(lens, W, device, g)
    q, k, v, gates, state = gdn_inputs(sum(lens), nk, nv, dk, dv, slots, dtype, device, g)
    pending = pending_inputs(slots, W, nk * dk + nv * dv + 2 * nv, dtype, device, g)
    ref_state, got_state, before = state.clone(), state.clone(), state.clone()
    ref_pend, got_pend = pending.clone(), pending.clone()
    ref = reference(q, k, v, gates, ref_state, ref_pend, batch)
    out = torch.full(v.shape, float("nan"), dtype=v.dtype, device=device)
    got = fn(q, k, v, gates, got_state, got_pend, batch, out=out, **kw)
    assert got is out and not got.isnan().any()
    check_close(got, ref, tol)
    check_written(got_state, ref_state, before, got_pend, ref_pend, pending, batch, tol)


def run_conv(fn, W, lens, C, K, dtype, device, tol, seed, splits=None, fills_out=True, **kw):
    """With `splits`, fn returns the parts of the output, each contiguous (the planar layout fla reads); a kernel
    call (`fills_out`) writes them into the `out` it is given, one after another."""
    g = torch.Generator().manual_seed(seed)
    batch, slots = make_batch(lens, W, device, g)
    x, conv_state, weight = conv_inputs(sum(lens), C, K, slots, dtype, device, g)
    pending = pending_inputs(slots, W, C, dtype, device, g)
    ref_state, got_state, before = conv_state.clone(), conv_state.clone(), conv_state.clone()
    ref_pend, got_pend = pending.clone(), pending.clone()
    ref = gdn._causal_conv1d_torch(x, ref_state, ref_pend, weight, batch)
    out = torch.full_like(x, float("nan"))
    got = fn(x, got_state, got_pend, weight, batch, splits=splits, out=out, **kw)
    if splits is None:
        assert got is out or not fills_out
    else:
        assert [p.shape for p in got] == [(x.shape[0], w) for w in splits] and all(p.is_contiguous() for p in got)
        if fills_out:  # the parts tile out's storage in order
            assert got[0].data_ptr() == out.data_ptr() and torch.equal(torch.cat([p.reshape(-1) for p in got]),
                                                                        out.reshape(-1))
        got = torch.cat(got, dim=1)
    assert not got.isnan().any()
    check_close(got, ref, tol)
    check_written(got_state, ref_state, before, got_pend, ref_pend, pending, batch, tol)


cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter cases run where there is no GPU")


@cpu_only
@pytest.mark.parametrize("W", [1, 3])
def test_gdn_recurrent_kernel_cpu_interpreter(W):
    # nv=4 over nk=2 key heads; block_v=8 splits dv=16 into two blocks
    run_gdn(gdn.gated_delta_rule_triton, W, LENS[W], 2, 4, 16, 16, torch.float32, "cpu", FP32, seed=W, block_v=8)


@cpu_only
def test_gdn_recurrent_kernel_cpu_interpreter_bf16_and_skip():
    # bf16 inputs (the interpreter truncates on bf16 casts: bf16 bounds hold); decode + verify only
    run_gdn(gdn.gated_delta_rule_triton, 3, [1, 3, 3, 2], 1, 4, 16, 16, torch.bfloat16, "cpu", BF16, seed=5)
    run_gdn(gdn.gated_delta_rule_triton, 1, [1, 1, 1], 2, 4, 16, 16, torch.float32, "cpu", FP32, seed=7)  # decode
    # max_rows skips the longer requests (fla's share on the GPU): their rows, slots and buffers stay untouched
    g = torch.Generator().manual_seed(6)
    lens, W = [1, 9, 3], 3
    batch, slots = make_batch(lens, W, "cpu", g)
    q, k, v, gates, state = gdn_inputs(sum(lens), 1, 2, 16, 16, slots, torch.float32, "cpu", g)
    pending = pending_inputs(slots, W, 16 + 32 + 4, torch.float32, "cpu", g)
    ref_state, got_state, ref_pend, got_pend = state.clone(), state.clone(), pending.clone(), pending.clone()
    ref = reference(q, k, v, gates, ref_state, ref_pend, batch)
    out = torch.full(v.shape, float("nan"))
    gdn.gated_delta_rule_triton(q, k, v, gates, got_state, got_pend, batch, out=out, max_rows=3)
    assert out[1:10].isnan().all() and not out[:1].isnan().any() and not out[10:].isnan().any()
    check_close(out[10:], ref[10:], FP32)
    ref_state[batch.state_slots[1]] = state[batch.state_slots[1]]  # the skipped request's slot: as it was
    check_written(got_state, ref_state, state, got_pend, ref_pend, pending, batch, FP32, skipped=(1,))


@cpu_only
@pytest.mark.parametrize("W", [1, 3])
def test_conv1d_kernel_cpu_interpreter(W):
    # C=48 is not a multiple of the 32-wide channel block; 37 and 19 rows make several 8-row tiles, spread over
    # programs (the default split) or over both programs and loop iterations (split=2)
    run_conv(gdn.causal_conv1d_triton, W, LENS[W], 48, 4, torch.float32, "cpu", FP32, seed=10 + W, block_c=32)
    run_conv(gdn.causal_conv1d_triton, W, LENS[W], 48, 4, torch.float32, "cpu", FP32, seed=12 + W, split=2)
    # q | k | v parts, narrower than a channel block and not aligned to one
    run_conv(gdn.causal_conv1d_triton, W, LENS[W], 48, 4, torch.float32, "cpu", FP32, seed=14 + W, block_c=32,
             splits=[12, 12, 24])
    run_conv(gdn.causal_conv1d_triton, W, LENS[W], 48, 4, torch.float32, "cpu", FP32, seed=16 + W, splits=[40, 8])


@cpu_only
def test_conv1d_kernel_cpu_interpreter_bf16_k2():
    run_conv(gdn.causal_conv1d_triton, 3, [1, 3, 2, 5], 32, 4, torch.bfloat16, "cpu", BF16, seed=20)
    run_conv(gdn.causal_conv1d_triton, 3, [1, 3, 2, 5], 32, 2, torch.float32, "cpu", FP32, seed=21)  # K-1 = 1
    run_conv(gdn.causal_conv1d_triton, 1, [1, 1, 1], 32, 4, torch.float32, "cpu", FP32, seed=22)  # decode: 1-row tiles


def check_l2_normalized(fn, rows, heads, D, dtype, device, seed):
    """fn(q, k) against fp64 maths: each row of D values over sqrt(its sum of squares + 1e-6), rounded once to the
    dtype (bf16: within one rounding of it); a zero row stays zero."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(rows, heads, D, generator=g, device=device) * 3
    k = torch.randn(rows, heads, D, generator=g, device=device) / 7
    q[rows // 2, 0] = 0
    q, k = q.to(dtype), k.to(dtype)
    for got, x in zip(fn(q, k), (q, k)):
        assert got.shape == x.shape and got.dtype == dtype
        want = x.double() / (x.double().square().sum(-1, keepdim=True) + 1e-6).sqrt()
        tol = 2e-6 if dtype == torch.float32 else 2**-8
        assert ((got.double() - want).abs() <= tol * want.abs() + 1e-7).all()
    assert not fn(q, k)[0][rows // 2, 0].any()


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_normalize_qk_kernel_cpu_interpreter(dtype):
    # 37 x 3 rows: not a multiple of the 16-row tile; D = 24: masked columns past it in the 32-wide tile
    check_l2_normalized(gdn.l2_normalize_qk_triton, 37, 3, 24, dtype, "cpu", seed=40)
    check_l2_normalized(gdn.l2_normalize_qk, 5, 2, 16, dtype, "cpu", seed=41)  # the dispatch: the reference


def test_dispatch_cpu_takes_reference():
    g = torch.Generator().manual_seed(30)
    batch, slots = make_batch([1, 2], 2, "cpu", g)
    q, k, v, gates, state = gdn_inputs(3, 1, 2, 8, 8, slots, torch.float32, "cpu", g)
    pending = pending_inputs(slots, 2, 8 + 16 + 4, torch.float32, "cpu", g)
    s2, p2 = state.clone(), pending.clone()
    assert torch.equal(gdn.gated_delta_rule(q, k, v, gates, state, pending, batch),
                       reference(q, k, v, gates, s2, p2, batch))
    assert torch.equal(state, s2) and torch.equal(pending, p2)


@pytest.mark.parametrize("kernel", [False, True])
def test_kept_rows_replayed_equal_rows_committed(kernel):
    """The pending rows' contract, against plain committed steps: a verify step that keeps its W rows outputs
    what committing them would, and a next step that replays r of them (then runs rows of its own) ends where
    committing those r rows and then its rows ends -- outputs and both states (conv and recurrent). Two requests
    (one accepting 2 of 3 rows, one 0) in one batch; the torch references, or the Triton kernels (interpreter)."""
    if kernel and torch.cuda.is_available():
        pytest.skip("the interpreter case runs where there is no GPU")
    g = torch.Generator().manual_seed(33)
    nk, nv, dk, dv, C, K, W = 1, 2, 8, 8, 2 * 8 + 16, 4, 3
    conv = gdn.causal_conv1d_triton if kernel else gdn._causal_conv1d_torch
    rule = gdn.gated_delta_rule_triton if kernel else gdn._gated_delta_rule_torch
    slots, replay = [1, 2], [2, 1]  # rows accepted: the last token's row and 1 draft; the last token's row only
    width = gdn.pending_width(C, nk, dk, nv, dv)

    def step(lens, state, x, gates, replay_rows, keep, buffer=0):
        """One step of both ops over two requests at slots 1 and 2, which own buffers 2, 3 and 4, 5: rows are
        replayed from `buffer` (0: 2 and 4, 1: 3 and 5) and kept in the other."""
        conv_state, rec, pend = state
        batch = batch_of(lens, slots, replay_rows, [(2 * s + buffer, 2 * s + 1 - buffer if keep else -1)
                                                    for s in slots], "cpu")
        xs = conv(x, conv_state, pend[..., :C], weight, batch)
        T = x.shape[0]
        q, k, v = xs.split([nk * dk, nk * dk, nv * dv], dim=-1)
        o = rule(q.reshape(T, nk, dk), k.reshape(T, nk, dk), v.reshape(T, nv, dv), gates, rec, pend[..., C:], batch)
        return o

    def fresh():
        return [torch.randn(3, C, K - 1, generator=torch.Generator().manual_seed(1)),
                torch.randn(3, nv, dk, dv, generator=torch.Generator().manual_seed(2)) * 0.3,
                torch.zeros(6, W, width)]

    weight = torch.randn(C, K, generator=g) * 0.5
    a_log, dt_bias = torch.rand(nv, generator=g) * 2 - 3, torch.rand(nv, generator=g) + 0.5
    verify_x, next_x = torch.randn(2 * W, C, generator=g), torch.randn(2 * 2, C, generator=g)
    verify_ab, next_ab = torch.randn(2 * W, 2 * nv, generator=g), torch.randn(2 * 2, 2 * nv, generator=g)

    def gates(ab):
        return gdn.Gates(ab[:, :nv], ab[:, nv:], a_log, dt_bias)

    kept = fresh()  # verify keeps its rows, the next step replays the accepted ones
    kept_verify = step([W, W], kept, verify_x, gates(verify_ab), [0, 0], keep=True)
    kept_next = step([2, 2], kept, next_x, gates(next_ab), replay, keep=False, buffer=1)
    committed = fresh()  # the same rows committed as they come
    committed_verify = step([W, W], [t.clone() for t in committed], verify_x, gates(verify_ab), [0, 0], keep=False)
    rows = [i * W + j for i, r in enumerate(replay) for j in range(r)]  # the accepted rows, request by request
    step(replay, committed, verify_x[rows], gates(verify_ab[rows]), [0, 0], keep=False)
    committed_next = step([2, 2], committed, next_x, gates(next_ab), [0, 0], keep=False)
    torch.testing.assert_close(kept_verify, committed_verify, rtol=0, atol=0)
    torch.testing.assert_close(kept_next, committed_next, rtol=1e-6, atol=1e-6)
    for got, want in zip(kept[:2], committed[:2]):
        torch.testing.assert_close(got[1:], want[1:], rtol=1e-6, atol=1e-6)


# --- GPU: Qwen3.5 sizes (nk=16, nv=32, dk=dv=128, conv_dim 8192, K=4) through the dispatch ------------------------

QWEN = dict(nk=16, nv=32, dk=128, dv=128)
GPU_LENS = {1: [1] * 6 + [5, 40], 3: [3] * 5 + [1, 2, 50]}  # all within FLA_MIN_ROWS: the recurrent kernel


def _dispatch_gdn(q, k, v, gates, state, pending, batch, out):
    o = gdn.gated_delta_rule(q, k, v, gates, state, pending, batch)
    out.copy_(o)
    return out


def _dispatch_conv(x, conv_state, pending, weight, batch, splits, out):  # the dispatch allocates its own output
    return gdn.causal_conv1d(x, conv_state, pending, weight, batch, splits)


@pytest.mark.gpu
@pytest.mark.parametrize("W", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_gpu_decode_verify(W, dtype):
    tol = FP32 if dtype == torch.float32 else BF16
    run_gdn(_dispatch_gdn, W, GPU_LENS[W], **QWEN, dtype=dtype, device="cuda", tol=tol, seed=40 + W)
    # the kernel itself writes every element (the dispatch allocates with empty)
    run_gdn(gdn.gated_delta_rule_triton, W, GPU_LENS[W], **QWEN, dtype=dtype, device="cuda", tol=tol, seed=50 + W)


@pytest.mark.gpu
@pytest.mark.parametrize("W", [1, 3])
def test_gdn_gpu_recurrent_long_prefill(W, monkeypatch):
    monkeypatch.setattr(gdn, "HAS_FLA", False)  # the fallback when fla is missing: recurrent for every length
    run_gdn(gdn.gated_delta_rule_gpu, W, [1, W, 300, 129], **QWEN, dtype=torch.bfloat16, device="cuda", tol=BF16,
            seed=60 + W)


@pytest.mark.gpu
@pytest.mark.parametrize("W", [1, 3])
def test_gdn_gpu_fla_prefill(W):
    if not gdn.HAS_FLA:
        pytest.skip("fla-core is not importable")
    run_gdn(gdn.gated_delta_rule_gpu, W, [1, W, 2, 300, 65, 1000], **QWEN, dtype=torch.bfloat16, device="cuda",
            tol=FLA_BF16, seed=70 + W)
    # only long requests, through the dispatch: fla's output is returned as it is
    run_gdn(_dispatch_gdn, W, [300, 129], **QWEN, dtype=torch.bfloat16, device="cuda", tol=FLA_BF16, seed=75 + W)
    # non-contiguous long requests (a decode between them)
    run_gdn(gdn.gated_delta_rule_gpu, W, [300, 1, 200, W], **QWEN, dtype=torch.bfloat16, device="cuda", tol=FLA_BF16,
            seed=80 + W)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_normalize_qk_gpu(dtype):
    check_l2_normalized(gdn.l2_normalize_qk, 1000, QWEN["nk"], QWEN["dk"], dtype, "cuda", seed=45)


@pytest.mark.gpu
@pytest.mark.parametrize("W", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv1d_gpu(W, dtype, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # an fp32 reference, not TF32
    tol = FP32 if dtype == torch.float32 else BF16
    lens = GPU_LENS[W] + [2048, 700]
    run_conv(_dispatch_conv, W, lens, 8192, 4, dtype, "cuda", tol, seed=90 + W, fills_out=False)
    run_conv(_dispatch_conv, W, lens, 8192, 4, dtype, "cuda", tol, seed=92 + W, splits=[2048, 2048, 4096],
             fills_out=False)
    run_conv(gdn.causal_conv1d_triton, W, [1] * 32, 8192, 4, dtype, "cuda", tol, seed=95 + W)
