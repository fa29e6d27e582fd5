"""MoE: the Triton routing, align and grouped-GEMM kernels against the torch references, with fresh random inputs.
On the CPU the kernels run under Triton's interpreter in fp32 at small sizes (H=64, I=32), over both align methods
(the Triton kernel and the sort-based torch reference) and over tilings that take several N tiles and K steps. The
per-pair output buffer starts as NaN, so an unwritten element shows. On the GPU (-m gpu) at the 35B-A3B sizes in
bf16 through the dispatch, and inside a CUDA graph replayed with new inputs (no host sync). Kernel times:
benchmarks/prefill_ops.py."""

import pytest
import torch

from tandem.ops import moe


def make_case(T, E, top_k, H, I, device="cpu", dtype=torch.float32, seed=0, pattern="random"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    gate_up = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    down = torch.randn(E, H, I, generator=g) / I**0.5
    router = torch.randn(E, H, generator=g)
    weights, experts = moe.route_torch(x, router, top_k, renormalize=True)
    if pattern == "one_expert":  # every token picks the same experts: expert 0 gets all T tokens, most get none
        experts = torch.arange(top_k).repeat(T, 1)
    elif pattern == "duplicates":  # every slot of every token on one expert
        experts = torch.full((T, top_k), E - 1, dtype=torch.long)
    to = dict(device=device)
    return (x.to(dtype=dtype, **to), gate_up.to(dtype=dtype, **to), down.to(dtype=dtype, **to),
            weights.to(dtype=dtype, **to), experts.to(**to), router.to(dtype=dtype, **to))


def reference(x, gate_up, down, weights, experts):
    return moe._fused_experts_torch(x.float(), gate_up.float(), down.float(), weights.float(), experts)


def run(x, gate_up, down, weights, experts, **kw):
    buf = torch.full((x.shape[0] * experts.shape[1], x.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    out = moe.fused_experts_triton(x, gate_up, down, weights, experts, buf=buf, **kw)
    assert not buf.isnan().any(), "an element of the per-pair buffer was not written"
    assert not out.isnan().any()
    return out


GARBAGE = -7  # what the kernel's output buffers hold before it runs, in check_align


def check_align(experts, E, block_m, use_kernel):
    """The layout's invariants over [0, total) and the first total / block_m blocks (the kernel leaves the rest
    unwritten: the GEMM kernels never read it). The kernel fills buffers pre-filled with GARBAGE, so a slot it
    should have written shows, and must match the torch path exactly where the result is read."""
    out = None
    if use_kernel:
        p_max = moe.padded_size(experts.numel(), E, block_m)
        out = tuple(torch.full((size,), GARBAGE, dtype=torch.int32, device=experts.device)
                    for size in (p_max, p_max // block_m, 1))
    sorted_ids, block_expert, total = moe.moe_align(experts, E, block_m, use_kernel, out=out)
    if out is not None:
        assert all(a is b for a, b in zip((sorted_ids, block_expert, total), out))
    flat = experts.reshape(-1).cpu()
    n, tot = flat.numel(), int(total)
    counts = torch.bincount(flat, minlength=E)
    assert tot == int(((counts + block_m - 1) // block_m * block_m).sum()) and tot <= sorted_ids.numel()
    ids, owners = sorted_ids[:tot].cpu().long(), block_expert[: tot // block_m].cpu().long()
    assert (ids != GARBAGE).all() and (owners != GARBAGE).all(), "a slot before total was not written"
    assert ((owners >= 0) & (owners < E)).all() and (owners.diff() >= 0).all()  # blocks in expert order
    if use_kernel:  # the same layout as the torch path where the GEMMs read it
        ref_ids, ref_owners, ref_total = moe.moe_align(experts, E, block_m, use_kernel=False)
        assert int(ref_total) == tot
        assert torch.equal(ids, ref_ids[:tot].cpu().long())
        assert torch.equal(owners, ref_owners[: tot // block_m].cpu().long())
    real = ids[ids < n]
    assert (ids[ids >= n] == n).all()
    assert sorted(real.tolist()) == list(range(n))  # every pair exactly once
    assert (flat[real] == owners.repeat_interleave(block_m)[ids < n]).all()  # each pair in a block of its expert
    for e in range(E):  # within an expert, pairs in pair order (deterministic layout)
        mine = real[flat[real] == e]
        assert (mine.diff() > 0).all()


# plus expert counts that are not powers of two, one with top_k 1 and fewer pairs than experts
CPU_CASES = [(T, E, k) for T in (1, 5, 37) for E in (8, 16) for k in (2, 4)] + [(9, 12, 3), (3, 40, 1)]


@pytest.mark.parametrize("T,E,top_k", CPU_CASES)
def test_fused_experts_kernel_cpu_interpreter(T, E, top_k):
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case runs where there is no GPU")
    case = make_case(T, E, top_k, 64, 32, seed=T * 100 + E * 10 + top_k)
    x, gate_up, down, weights, experts, _ = case
    ref = reference(x, gate_up, down, weights, experts)
    tol = 1e-5 * max(ref.abs().max().item(), 1.0)
    # default tiling (one N tile, one masked K step at these sizes) with the one-program align
    assert (run(x, gate_up, down, weights, experts, align_kernel=True) - ref).abs().max() <= tol
    # the torch align, 2 N tiles and 2 K steps in each GEMM
    out = run(x, gate_up, down, weights, experts, align_kernel=False, block_m=16,
              gate_up_cfg=(16, 32, 4, 1), down_cfg=(32, 16, 4, 1))
    assert (out - ref).abs().max() <= tol
    for use_kernel in (True, False):
        check_align(experts, E, 16, use_kernel)


@pytest.mark.parametrize("pattern", ["one_expert", "duplicates"])
def test_fused_experts_skewed_cpu_interpreter(pattern):
    """All tokens on one expert (three blocks of it) and experts with no tokens; odd sizes so K and N are masked."""
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case runs where there is no GPU")
    x, gate_up, down, weights, experts, _ = make_case(37, 8, 2, 48, 24, seed=7, pattern=pattern)
    ref = reference(x, gate_up, down, weights, experts)
    tol = 1e-5 * max(ref.abs().max().item(), 1.0)
    for use_kernel in (True, False):
        check_align(experts, 8, 16, use_kernel)
        out = run(x, gate_up, down, weights, experts, align_kernel=use_kernel, block_m=16,
                  gate_up_cfg=(16, 32, 4, 1), down_cfg=(32, 32, 4, 1))
        assert (out - ref).abs().max() <= tol


def test_align_many_chunks_cpu_interpreter():
    """A non-power-of-two expert count (40, E_P2 64) with 600 pairs (ten ranking programs, each counting over
    128-pair tiles) and one expert owning more blocks than one block chunk (16); then 2600 pairs, three chunks of
    1024 (the last one partial), so experts' segments collect pairs from several programs."""
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case runs where there is no GPU")
    g = torch.Generator().manual_seed(3)
    experts = torch.stack([torch.randperm(40, generator=g)[:8] for _ in range(75)])
    experts[:, :3] = 5  # 225 pairs on expert 5: 57 blocks of 4
    for bm in (4, 16):
        for use_kernel in (True, False):
            check_align(experts, 40, bm, use_kernel)
    experts = torch.stack([torch.randperm(40, generator=g)[:2] for _ in range(1300)])
    experts[700:1000, 0] = 7  # one expert with pairs in every chunk, more than a chunk's worth
    for bm in (16, 64):
        check_align(experts, 40, bm, True)
    check_align(torch.randint(0, 6, (2100, 1), generator=g), 6, 64, True)  # more chunks than experts


def align_case(pattern, E, seed=0):
    """experts [T, top_k] for the align tests; one_pair, fewer_pairs, one_expert and even_only leave experts empty."""
    g = torch.Generator().manual_seed(seed)
    if pattern == "random":  # 100 pairs, 4 distinct experts per token
        return torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(25)])
    if pattern == "spread":  # every expert gets pairs, unevenly
        return torch.cat([torch.arange(E), torch.randint(0, E, (2 * E,), generator=g)]).view(-1, 1)
    if pattern == "one_pair":  # N = 1, on the last expert
        return torch.tensor([[E - 1]])
    if pattern == "fewer_pairs":  # N = 4 < E
        return torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(2)])
    if pattern == "one_expert":  # all 90 pairs on one expert
        return torch.full((30, 3), E // 2)
    if pattern == "even_only":  # odd experts empty, repeats within a token
        return torch.randint(0, (E + 1) // 2, (20, 4), generator=g) * 2
    raise ValueError(pattern)


ALIGN_PATTERNS = ["random", "spread", "one_pair", "fewer_pairs", "one_expert", "even_only"]


@pytest.mark.parametrize("E", [6, 16, 40])
@pytest.mark.parametrize("pattern", ALIGN_PATTERNS)
def test_align_kernel_cpu_interpreter(pattern, E):
    """The ranking kernel (up to 1024 pairs) against the torch path over block_m 16, 32, 64: E not a power of two,
    fewer pairs than experts, a single pair, everything on one expert, experts with no pairs."""
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case runs where there is no GPU")
    experts = align_case(pattern, E, seed=E)
    for bm in (16, 32, 64):
        for use_kernel in (True, False):
            check_align(experts, E, bm, use_kernel)


def test_align_no_pairs_cpu_interpreter():
    sorted_ids, block_expert, total = moe.moe_align(torch.zeros(0, 2, dtype=torch.long), 6, 16, use_kernel=True)
    assert int(total) == 0 and sorted_ids.numel() == 0 and block_expert.numel() == 0


@pytest.mark.parametrize("E,top_k,renorm", [(8, 2, True), (16, 4, False), (12, 3, True)])
def test_route_kernel_cpu_interpreter(E, top_k, renorm):
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case runs where there is no GPU")
    g = torch.Generator().manual_seed(E)
    x, router = torch.randn(37, 64, generator=g), torch.randn(E, 64, generator=g)
    w_ref, e_ref = moe.route_torch(x, router, top_k, renorm)
    w, e = moe.route_logits_triton(torch.nn.functional.linear(x, router), top_k, renorm)
    assert torch.equal(e, e_ref)
    assert (w - w_ref).abs().max() <= 1e-6


@pytest.mark.parametrize("top_k", [2, 8])
def test_route_kernel_with_the_shared_expert_cpu_interpreter(top_k):
    """With a shared-expert logit every token gets one more pair: expert E, weight sigmoid(logit) (fp64 oracle),
    read like the router's columns from a fused projection's strided output."""
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case runs where there is no GPU")
    E = 16
    g = torch.Generator().manual_seed(top_k)
    fused = torch.randn(29, E + 5, generator=g)
    logits, shared = fused[:, :E], fused[:, E : E + 1]
    w, e = moe.route_logits_triton(logits, top_k, True, shared)
    p = logits.double().softmax(-1)
    w_ref, e_ref = p.topk(top_k, -1)
    assert torch.equal(e[:, :top_k], e_ref) and torch.equal(e[:, top_k], torch.full((29,), E))
    assert (w[:, :top_k].double() - w_ref / w_ref.sum(-1, keepdim=True)).abs().max() <= 1e-6
    assert (w[:, top_k].double() - torch.sigmoid(shared[:, 0].double())).abs().max() <= 1e-6
    w_t, e_t = moe.route_logits_torch(logits, top_k, True, shared)
    assert torch.equal(e_t, e) and (w_t - w).abs().max() <= 1e-6


@pytest.mark.parametrize("shared", [False, True])
def test_ranked_routing_cpu_interpreter(shared):
    """Ranked routing (the routing kernel counts each pair into its expert's counter by an atomic add): the same
    weights and experts as unranked routing, each expert's ranks 0..count-1 once each and its counter at its
    count; the align puts each pair at its expert's segment start plus its rank, with the unranked layout's total,
    padding and block owners; the experts' outputs equal the unranked ones; and the counters are back at zero
    afterwards, so a second layer in a row gets the same."""
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case runs where there is no GPU")
    T, E, top_k, H, I, bm = 37, 16, 4, 64, 32, 16
    E_all = E + shared
    g = torch.Generator().manual_seed(40 + shared)
    x, gate_up = torch.randn(T, H, generator=g), torch.randn(E_all, 2 * I, H, generator=g) / H**0.5
    down = torch.randn(E_all, H, I, generator=g) / I**0.5
    counters = moe.routing_counters(torch.device("cpu"), 32)
    for _ in range(2):  # a second layer: the counters must be back at zero
        logits, shared_logit = torch.randn(T, E, generator=g), torch.randn(T, 1, generator=g) if shared else None
        w, e = moe.route_logits_triton(logits, top_k, True, shared_logit)
        w_r, e_r, ranks = moe.route_logits_triton(logits, top_k, True, shared_logit, ranked=True)
        assert torch.equal(w_r, w) and torch.equal(e_r, e)
        counts = torch.bincount(e.reshape(-1), minlength=E_all)
        assert torch.equal(counters[:E_all].long(), counts) and not counters[E_all:].any()
        for ex in range(E_all):
            assert sorted(ranks[e == ex].tolist()) == list(range(int(counts[ex])))
        ids, owners, total = moe.moe_align(e, E_all, bm, ranks=ranks)
        ref_ids, ref_owners, ref_total = moe.moe_align(e, E_all, bm, use_kernel=False)
        tot, n = int(total), e.numel()
        assert tot == int(ref_total) and torch.equal(owners[: tot // bm], ref_owners[: tot // bm])
        padded = (counts + bm - 1) // bm * bm
        at = (padded.cumsum(0) - padded)[e.reshape(-1)] + ranks.reshape(-1).long()  # segment start + rank
        assert torch.equal(ids[at].long(), torch.arange(n))
        assert torch.equal(ids[:tot] == n, ref_ids[:tot] == n)  # the padding where the unranked layout has it
        got = run(x, gate_up, down, w_r, e_r, ranks=ranks)
        assert not counters.any(), "the gate/up kernel leaves the counters at zero"
        assert torch.equal(got, run(x, gate_up, down, w, e))


@pytest.mark.parametrize("T,E,top_k,shared", [(1, 16, 4, True), (3, 16, 4, True), (7, 12, 3, False), (2, 40, 8, True)])
def test_route_and_align_few_tokens_cpu_interpreter(T, E, top_k, shared):
    """Up to RANK_PAIRS pairs a ranked routing aligns its pairs in the same launch: the weights and experts of the
    torch routing, the torch align's layout exactly (pair order inside each expert's segment) over the experts
    and the shared one, the same experts' outputs as the unranked path, and the routing counters untouched."""
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case runs where there is no GPU")
    H, I = 64, 32
    E_all = E + shared
    g = torch.Generator().manual_seed(60 + T)
    x, gate_up = torch.randn(T, H, generator=g), torch.randn(E_all, 2 * I, H, generator=g) / H**0.5
    down = torch.randn(E_all, H, I, generator=g) / I**0.5
    logits, shared_logit = torch.randn(T, E, generator=g), torch.randn(T, 1, generator=g) if shared else None
    counters = moe.routing_counters(torch.device("cpu"), 64)
    w, e, aligned = moe.route_logits_triton(logits, top_k, True, shared_logit, ranked=True)
    assert isinstance(aligned, moe.Aligned) and not counters.any()
    w_t, e_t = moe.route_logits_torch(logits, top_k, True, shared_logit)
    assert torch.equal(e, e_t) and (w - w_t).abs().max() <= 1e-6
    ref_ids, ref_owners, ref_total = moe.moe_align(e, E_all, aligned.block_m, use_kernel=False)
    tot = int(ref_total)
    assert int(aligned.total) == tot
    assert torch.equal(aligned.sorted_ids[:tot], ref_ids[:tot])
    assert torch.equal(aligned.block_expert[: tot // aligned.block_m], ref_owners[: tot // aligned.block_m])
    assert torch.equal(run(x, gate_up, down, w, e, ranks=aligned), run(x, gate_up, down, w, e))


def test_dispatch_cpu_takes_reference():
    x, gate_up, down, weights, experts, router = make_case(5, 8, 2, 64, 32, seed=1)
    assert torch.equal(moe.fused_experts(x, gate_up, down, weights, experts),
                       moe._fused_experts_torch(x, gate_up, down, weights, experts))
    w, e = moe.route(x, router, 2, True)
    w_ref, e_ref = moe.route_torch(x, router, 2, True)
    assert torch.equal(w, w_ref) and torch.equal(e, e_ref)


# ---------------------------------------------------------------------------------------------------- GPU

REAL = dict(E=256, top_k=8, H=2048, I=512)


def bf16_check(out, ref):
    assert not out.isnan().any()
    err = (out.float() - ref).abs().max().item()
    assert err <= 2e-2 * max(ref.abs().max().item(), 1.0), err


def check_top_k(x, router, weights, experts):
    """A valid top-k of the fp32 softmax of the bf16 logits: every chosen expert's probability is at least every
    other's (bf16 logits tie often, and then either order is right), and the weights are the renormalised ones."""
    probs = torch.nn.functional.linear(x, router).float().softmax(-1)
    chosen = probs.gather(1, experts)
    others = probs.scatter(1, experts, -1.0)
    assert all(len(set(r)) == len(r) for r in experts.tolist())  # k distinct experts per token
    assert (chosen.min(1).values >= others.max(1).values - 1e-6).all()
    assert (weights.float() - chosen / chosen.sum(1, keepdim=True)).abs().max() <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 32, 2048])
def test_fused_experts_gpu(T):
    x, gate_up, down, weights, experts, router = make_case(T, REAL["E"], REAL["top_k"], REAL["H"], REAL["I"],
                                                           "cuda", torch.bfloat16, seed=T)
    weights, experts = moe.route(x, router, REAL["top_k"], True)  # the Triton routing
    check_top_k(x, router, weights, experts)
    ref = reference(x, gate_up, down, weights, experts)
    bf16_check(moe.fused_experts(x, gate_up, down, weights, experts), ref)
    bf16_check(run(x, gate_up, down, weights, experts), ref)
    for use_kernel in (True, False):
        check_align(experts, REAL["E"], 16, use_kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", ALIGN_PATTERNS)
def test_align_gpu(pattern):
    """The compiled align kernel against the torch path at the decode size (E 256, 768 pairs), at prefill sizes
    (1024 and 16384 tokens: 8 and 128 chunks) and a small E that is not a power of two, over block_m 16, 32, 64."""
    g = torch.Generator().manual_seed(5)
    cases = [(align_case(pattern, 40, seed=1), 40)]
    if pattern == "random":  # 96 tokens x 8 distinct experts: 768 pairs
        cases.append((torch.stack([torch.randperm(256, generator=g)[:8] for _ in range(96)]), 256))
        for T in (1024, 16384):
            cases.append((torch.rand(T, 256, generator=g).topk(8, dim=1).indices, 256))
    else:
        cases.append((align_case(pattern, 256, seed=2), 256))
    for experts, E in cases:
        experts = experts.cuda()
        for bm in (16, 32, 64):
            for use_kernel in (True, False):
                check_align(experts, E, bm, use_kernel)


@pytest.mark.gpu
def test_fused_experts_gpu_skewed():
    for pattern in ("one_expert", "duplicates"):
        x, gate_up, down, weights, experts, _ = make_case(300, 64, 8, 256, 128, "cuda", torch.bfloat16, 9, pattern)
        ref = reference(x, gate_up, down, weights, experts)
        for use_kernel in (True, False):
            bf16_check(run(x, gate_up, down, weights, experts, align_kernel=use_kernel), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("T,align_kernel,ranked", [(1, True, False), (32, True, False), (32, False, False),
                                                    (200, True, False), (1500, True, False), (1, True, True),
                                                    (96, True, True)])
def test_moe_cuda_graph_replay(T, align_kernel, ranked):
    """Route + experts captured once, replayed on new inputs: correct results prove nothing went through the host
    (a sync would fail the capture). align_kernel=False captures the sort-based torch align as well; `ranked`:
    ranked routing, whose counters every replay must leave at zero for the next."""
    E, k, H, I = REAL["E"], REAL["top_k"], REAL["H"], REAL["I"]
    _, gate_up, down, _, _, router = make_case(T, E, k, H, I, "cuda", torch.bfloat16, seed=11)
    static_x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def step():
        w, e, ranks = moe.route_logits(torch.nn.functional.linear(static_x, router), k, True, ranked=ranked)
        return moe.fused_experts_triton(static_x, gate_up, down, w, e, align_kernel=align_kernel, ranks=ranks), w, e

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_w, static_e = step()
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(100 + seed)
        static_x.copy_(torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_e, moe.route(static_x, router, k, True)[1])
        bf16_check(static_out, reference(static_x, gate_up, down, static_w, static_e))
        assert not moe.routing_counters(static_x.device, 512).any()
