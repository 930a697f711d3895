"""CPU twins of the fused SwiGLU and tree-attention kernels against their PyTorch references
(``swiftspec.ops.reference``). Every SIMD variant compiled into the extension is exercised through
the ``_*_impl`` test hooks, so the scalar fallback used on CPUs without AVX-512 is tested too."""
from __future__ import annotations

import pytest
import torch

from swiftspec.ops import cpu, reference


@pytest.fixture(scope="module")
def ops():
    try:
        return cpu.load()
    except cpu.KernelBuildError as e:  # no compiler here: nothing to test
        pytest.skip(f"CPU kernels unavailable: {e}")


def _swiglu_impls(ops, dtype):
    return [i for i in ["auto", *ops._swiglu_impls()] if not (i == "avx512_bf16" and dtype != torch.bfloat16)]


# ---------------------------------------------------------------------------------------------
# SwiGLU

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 8, 16, 33])
@pytest.mark.parametrize("K,I", [(100, 37), (64, 48), (33, 5)])
def test_swiglu_matches_reference(ops, dtype, M, K, I):
    g = torch.Generator().manual_seed(M * 1000 + K + I)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(2 * I, K, generator=g) / K ** 0.5).to(dtype)
    # The oracle sees the same (rounded) inputs in fp32; the kernel accumulates in fp32 and rounds
    # once, so in bf16 it is within one output rounding (2^-8 relative) of it.
    want = reference.swiglu(x.float(), w.float())
    for impl in _swiglu_impls(ops, dtype):
        got = ops._swiglu_impl(x, w, impl)
        assert got.dtype == dtype and got.shape == (M, I), impl
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=impl)
        else:
            torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2, msg=impl)
    # The public entry point is the "auto" kernel, and agrees with the bf16/fp32 reference itself.
    got = ops.swiglu(x, w)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got.float(), reference.swiglu(x, w).float(), **tol)


def test_swiglu_noncontiguous_and_threads(ops):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 130, generator=g)[:, ::2]  # [6, 65], non-contiguous rows
    w = torch.randn(2 * 300, 65, generator=g) / 65 ** 0.5
    want = reference.swiglu(x, w)
    old = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            torch.testing.assert_close(ops.swiglu(x, w), want, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(old)


def test_swiglu_empty_and_k0(ops):
    assert ops.swiglu(torch.randn(0, 8), torch.randn(6, 8)).shape == (0, 3)
    out = ops.swiglu(torch.randn(2, 0), torch.randn(6, 0))
    assert out.shape == (2, 3) and bool((out == 0).all())


def test_swiglu_bad_input(ops):
    x, w = torch.randn(2, 8), torch.randn(6, 8)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.swiglu(x, w.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.swiglu(x.double(), w.double())
    with pytest.raises(RuntimeError, match="K mismatch"):
        ops.swiglu(x, torch.randn(6, 9))
    with pytest.raises(RuntimeError, match="even"):
        ops.swiglu(x, torch.randn(5, 8))
    with pytest.raises(RuntimeError, match=r"\[M, K\]"):
        ops.swiglu(torch.randn(2, 2, 8), w)
    with pytest.raises(RuntimeError, match="unknown impl"):
        ops._swiglu_impl(x, w, "nope")
    with pytest.raises(RuntimeError, match="needs bfloat16"):
        if "avx512_bf16" not in ops._swiglu_impls():
            raise RuntimeError("needs bfloat16 (not compiled here)")
        ops._swiglu_impl(x, w, "avx512_bf16")


# ---------------------------------------------------------------------------------------------
# Tree attention

def _rope_tables(d: int, p: int = 4096, theta: float = 10000.0):
    from swiftspec.model_executor.layers.rotary import RotaryEmbedding
    rope = RotaryEmbedding(d, p, theta)
    return rope.cos, rope.sin


def _tree_mask(n: int, S: int, prefix: int, g: torch.Generator) -> torch.Tensor:
    """Draft-expansion-like mask: the prefix visible to all, a random tree over the tail where each
    query sees its ancestors (parent index < own index) and itself at slot prefix + i."""
    tree = S - prefix
    parent = [-1] + [int(torch.randint(0, max(1, i), (1,), generator=g)) for i in range(1, tree)]
    m = torch.zeros(n, S, dtype=torch.bool)
    m[:, :prefix] = True
    for i in range(n):
        node = tree - n + i  # queries are the last n nodes of the tree
        while node >= 0:
            m[i, prefix + node] = True
            node = parent[node]
    return m


def _attn_case(n, hq, hk, d, S, C, dtype, mask, seed=0, drop_slots=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=g).to(dtype)
    k_new = torch.randn(n, hk, d, generator=g).to(dtype)
    v_new = torch.randn(n, hk, d, generator=g).to(dtype)
    k_cache = torch.randn(hk, C, d, generator=g).to(dtype)
    v_cache = torch.randn(hk, C, d, generator=g).to(dtype)
    # new tokens go to the last slots below S (they attend to themselves), some are padding (-1)
    slots = torch.arange(S - n, S) if S >= n else torch.randperm(C, generator=g)[:n]
    if drop_slots:
        slots = slots.clone()
        slots[torch.rand(n, generator=g) < 0.25] = -1
    positions = torch.randint(0, 4096, (n,), generator=g)
    cos, sin = _rope_tables(d)
    return [q, k_new, v_new, k_cache, v_cache, slots, positions, cos, sin, mask, d ** -0.5]


def _check_attention(ops, args, impls=None):
    q, k_new, v_new, k_cache, v_cache, *rest = args
    kr, vr = k_cache.clone(), v_cache.clone()
    want = reference.tree_attention(q, k_new, v_new, kr, vr, *rest)
    fp32 = q.dtype == torch.float32
    for impl in impls or ["auto", *ops._tree_attention_impls()]:
        kc, vc = k_cache.clone(), v_cache.clone()
        got = ops._tree_attention_impl(q, k_new, v_new, kc, vc, *rest, impl)
        assert got.dtype == q.dtype and got.shape == want.shape, impl
        assert not got.isnan().any(), impl
        # RoPE is computed with the reference's fp32 roundings: the caches match bit for bit.
        assert torch.equal(kc, kr) and torch.equal(vc, vr), f"{impl}: cache contents differ"
        if fp32:
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=impl)
        else:
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2, msg=impl)
    return want


SHAPES = [  # (n, Hq, Hk, D, S, C): GQA 1 and 6, D 64/128 and odd-sized heads, S over several splits
    (1, 12, 2, 128, 77, 100),
    (5, 12, 2, 64, 700, 720),
    (8, 14, 2, 64, 513, 513),
    (8, 4, 4, 128, 300, 333),
    (16, 6, 1, 6, 290, 300),
    (40, 12, 2, 34, 450, 460),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}_hq{}_hk{}_d{}_S{}".format(*s[:5]))
@pytest.mark.parametrize("kind", ["random", "tree"])
def test_tree_attention_matches_reference(ops, dtype, shape, kind):
    n, hq, hk, d, S, C = shape
    g = torch.Generator().manual_seed(n * 7 + S)
    if kind == "random":
        mask = torch.rand(n, S, generator=g) < 0.4
        mask[n // 2] = False  # a row that sees nothing returns zeros
    else:
        mask = _tree_mask(n, S, prefix=S - max(n, min(S, 60)), g=g)
    want = _check_attention(ops, _attn_case(n, hq, hk, d, S, C, dtype, mask, seed=S))
    if kind == "random":
        assert bool((want.view(n, -1)[n // 2] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_attention_split_fully_masked(ops, dtype):
    """Rows that see keys in only one split, one split seen by nobody, rows seeing a single key:
    the (m = -inf, l = 0) partials must contribute nothing."""
    n, S = 6, 900
    mask = torch.zeros(n, S, dtype=torch.bool)
    mask[0, :200] = True            # first split only
    mask[1, 700:] = True            # last split only
    mask[2, 123] = True             # one key
    mask[3] = True                  # everything
    mask[4, ::97] = True            # sparse across splits
    mask[:, 300:600] = False        # a middle split nobody sees ...
    mask[5, 450] = True             # ... except one key for one row
    args = _attn_case(n, 12, 2, 128, S, S, dtype, mask, seed=3)
    old = torch.get_num_threads()
    try:
        for t in (1, 2):  # the split count depends on the thread count
            torch.set_num_threads(t)
            _check_attention(ops, args)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix", [37, 300, 700])
def test_tree_attention_batch_invariant(ops, dtype, prefix):
    """A row's output is bit-identical alone or in batches of 2/4/8/16 (any order), whatever the
    mask width S and the thread count (every key at the position of its slot, as in decode steps;
    tree positions with compaction are the next test). Run for every inner kernel compiled in this
    build."""
    n, hq, hk, d = 16, 12, 2, 128
    C = prefix + n + 40
    g = torch.Generator().manual_seed(prefix)
    mask = _tree_mask(n, prefix + n, prefix, g)
    args = _attn_case(n, hq, hk, d, prefix + n, C, dtype, mask, seed=prefix, drop_slots=False)
    q, k_new, v_new, k_cache, v_cache, slots, _, cos, sin, _, scale = args
    positions = slots.clone()
    old = torch.get_num_threads()
    try:
        for impl in ["auto", *ops._tree_attention_impls()]:
            kc, vc = k_cache.clone(), v_cache.clone()
            full = ops._tree_attention_impl(q, k_new, v_new, kc, vc, slots, positions, cos, sin, mask, scale, impl)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for size in (1, 2, 4, 8):
                    rows = torch.randperm(n, generator=g)[:size]
                    # any S that covers the rows' keys (a lone decode step has S = its slot + 1)
                    S = int(torch.randint(int(slots[rows].max()) + 1, C + 1, (1,), generator=g))
                    m = torch.zeros(size, S, dtype=torch.bool)
                    m[:, : prefix + n] = mask[rows, : min(S, prefix + n)]
                    got = ops._tree_attention_impl(q[rows], k_new[rows], v_new[rows], kc, vc, slots[rows],
                                                   positions[rows], cos, sin, m, scale, impl)
                    assert torch.equal(got, full[rows]), f"{impl}: rows {rows.tolist()} S={S} threads={threads}"
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix", [250, 254, 509])
def test_tree_attention_node_equals_compacted_decode(ops, dtype, prefix):
    """The lossless-verification property: a tree node verified at slot L + i, position L + depth,
    is bit-identical to the same token decoded alone after its ancestors' keys are compacted to
    slots L .. L + depth - 1 (the target's re-root). Prefixes end just below a 256-key split
    boundary, so tree slots and compacted slots of one node fall on different sides of it."""
    from swiftspec.spec_decode.target_state import ancestor_mask

    n, hq, hk, d = 12, 12, 2, 64
    g = torch.Generator().manual_seed(prefix)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    C = prefix + 2 * n
    args = _attn_case(n, hq, hk, d, prefix + n, C, dtype, ancestor_mask(parents, prefix), seed=prefix,
                      drop_slots=False)
    q, k_new, v_new, k_cache, v_cache, _, _, cos, sin, mask, scale = args
    slots, positions = torch.arange(prefix, prefix + n), torch.tensor(depth) + prefix
    old = torch.get_num_threads()
    try:
        for impl in ["auto", *ops._tree_attention_impls()]:
            kc, vc = k_cache.clone(), v_cache.clone()
            tree = ops._tree_attention_impl(q, k_new, v_new, kc, vc, slots, positions, cos, sin, mask, scale, impl)
            for node in range(n):
                path = []
                a = parents[node]
                while a >= 0:
                    path.insert(0, a)
                    a = parents[a]
                k1, v1 = kc.clone(), vc.clone()
                k1[:, prefix:prefix + len(path)] = kc[:, [prefix + a for a in path]]
                v1[:, prefix:prefix + len(path)] = vc[:, [prefix + a for a in path]]
                t = prefix + depth[node]
                torch.set_num_threads(1 + node % 2)
                one = ops._tree_attention_impl(q[node:node + 1], k_new[node:node + 1], v_new[node:node + 1], k1, v1,
                                               torch.tensor([t]), torch.tensor([t]), cos, sin,
                                               torch.ones(1, t + 1, dtype=torch.bool), scale, impl)
                assert torch.equal(one[0], tree[node]), f"{impl}: node {node} (depth {depth[node]})"
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix", [250, 509])
def test_tree_attention_slot_positions(ops, dtype, prefix):
    """Keys written by *earlier* calls in tree slots (the pipeline modes: a node's ancestors sit
    in slots past their positions while their descendants run): with ``slot_positions`` a chain
    of tokens decoded one at a time at slots ``prefix + 40 + 3 i`` (gaps: pruned siblings) is
    bit-identical to the same chain at slots equal to its positions, across a split boundary;
    without, the keys are split by slot and the sums differ."""
    hq, hk, d, steps = 4, 2, 64, 12
    C = prefix + 40 + 3 * steps + 1
    g = torch.Generator().manual_seed(prefix)
    k0, v0 = (torch.randn(hk, C, d, generator=g).to(dtype) for _ in range(2))
    cos, sin = _rope_tables(d)
    q, kn, vn = (torch.randn(steps, n, d, generator=g).to(dtype) for n in (hq, hk, hk))
    outs = {}
    for impl in ["auto", *ops._tree_attention_impls()]:
        for layout in ("compact", "gaps", "gaps-unknown"):
            kc, vc = k0.clone(), v0.clone()
            slot_pos = torch.arange(C)
            seen = list(range(prefix))
            res = []
            for i in range(steps):
                pos = prefix + i
                slot = pos if layout == "compact" else prefix + 40 + 3 * i
                seen.append(slot)
                mask = torch.zeros(1, max(seen) + 1, dtype=torch.bool)
                mask[0, seen] = True
                res.append(ops._tree_attention_impl(
                    q[i:i + 1], kn[i:i + 1], vn[i:i + 1], kc, vc, torch.tensor([slot]), torch.tensor([pos]), cos, sin,
                    mask, d ** -0.5, impl, slot_pos if layout == "gaps" else None))
                slot_pos[slot] = pos
            outs[layout] = torch.cat(res)
        assert torch.equal(outs["gaps"], outs["compact"]), impl
        if dtype == torch.float32:  # the test can fail (bf16 outputs may round the difference away)
            assert not torch.equal(outs["gaps-unknown"], outs["compact"]), impl
    with pytest.raises(RuntimeError, match="slot_positions"):
        ops.tree_attention(q[:1], kn[:1], vn[:1], k0.clone(), v0.clone(), torch.tensor([0]), torch.tensor([0]), cos,
                           sin, torch.ones(1, 8, dtype=torch.bool), 1.0, torch.arange(4))


def test_tree_attention_all_masked_and_empty_prefix(ops):
    n, S = 4, 40
    args = _attn_case(n, 4, 2, 64, S, 48, torch.float32, torch.zeros(n, S, dtype=torch.bool))
    want = _check_attention(ops, args)
    assert bool((want == 0).all())
    # S = 0: nothing to attend to, the new keys are still rotated and written
    args = _attn_case(n, 4, 2, 64, 0, 8, torch.float32, torch.zeros(n, 0, dtype=torch.bool), drop_slots=False)
    assert bool((_check_attention(ops, args) == 0).all())


def test_tree_attention_noncontiguous_inputs(ops):
    n, hq, hk, d, S = 8, 12, 2, 64, 200
    mask = torch.rand(S, n) < 0.7  # transposed view below
    args = _attn_case(n, hq, hk, d, S, S, torch.float32, mask.t())
    args[0] = torch.randn(hq, n, d).transpose(0, 1)  # q as a view
    _check_attention(ops, args)


def test_tree_attention_bad_input(ops):
    n, hq, hk, d, S, C = 4, 4, 2, 64, 30, 32
    args = _attn_case(n, hq, hk, d, S, C, torch.float32, torch.ones(n, S, dtype=torch.bool), drop_slots=False)

    def call(**over):
        names = ["q", "k_new", "v_new", "k_cache", "v_cache", "slots", "positions", "cos", "sin", "mask", "scale"]
        a = dict(zip(names, args))
        a.update(over)
        return ops.tree_attention(*[a[k] for k in names])

    with pytest.raises(RuntimeError, match="dtype"):
        call(k_new=args[1].to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        call(q=args[0].double())
    with pytest.raises(RuntimeError, match="S = 40"):
        call(mask=torch.ones(n, 40, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="multiple of Hk"):
        call(q=torch.randn(n, 3, d))
    with pytest.raises(RuntimeError, match="k_new must be"):
        call(k_new=torch.randn(n + 1, hk, d))
    with pytest.raises(RuntimeError, match="v_new"):
        call(v_new=torch.randn(n, hk, d - 2))
    with pytest.raises(RuntimeError, match="k_cache must be"):
        call(k_cache=torch.randn(hk + 1, C, d))
    with pytest.raises(RuntimeError, match="contiguous"):
        call(k_cache=torch.randn(hk, d, C).transpose(1, 2))
    with pytest.raises(RuntimeError, match="mask must be bool"):
        call(mask=torch.ones(n, S))
    with pytest.raises(RuntimeError, match="slots must be int64"):
        call(slots=args[5].int())
    with pytest.raises(RuntimeError, match="cos_table"):
        call(cos=args[7][:, :d // 2])
    with pytest.raises(RuntimeError, match="positions"):
        call(positions=torch.full((n,), 10 ** 6))
    with pytest.raises(RuntimeError, match="slots"):
        call(slots=torch.full((n,), C))
    with pytest.raises(RuntimeError, match="even"):
        call(q=torch.randn(n, hq, 5), k_new=torch.randn(n, hk, 5), v_new=torch.randn(n, hk, 5),
             k_cache=torch.randn(hk, C, 5), v_cache=torch.randn(hk, C, 5), cos=torch.randn(10, 5),
             sin=torch.randn(10, 5))
    with pytest.raises(RuntimeError, match="unknown impl"):
        ops._tree_attention_impl(*args, "nope")


# ---------------------------------------------------------------------------------------------
# RMSNorm (fused residual add)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,H", [(1, 1536), (5, 896), (16, 13), (40, 2048)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_reference(ops, dtype, M, H, with_residual):
    g = torch.Generator().manual_seed(M * H)
    x = (torch.randn(M, H, generator=g) * 3).to(dtype)
    res = torch.randn(M, H, generator=g).to(dtype) if with_residual else None
    w = torch.randn(H, generator=g).to(dtype)
    want_y, want_r = reference.rms_norm(x, res, w, 1e-6)
    y, r = ops.rms_norm(x, res, w, 1e-6)
    assert y.dtype == dtype and r.dtype == dtype
    assert torch.equal(r, want_r)  # the residual sum is one rounding in both
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(y.float(), want_y.float(), **tol)
    # batch invariance: each row alone gives the same bits
    for i in (0, M - 1):
        yi, _ = ops.rms_norm(x[i:i + 1], None if res is None else res[i:i + 1], w, 1e-6)
        assert torch.equal(yi[0], y[i])


def test_rms_norm_bad_input(ops):
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(x, None, torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="residual must match"):
        ops.rms_norm(x, torch.randn(3, 8), w, 1e-6)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rms_norm(x.double(), None, w.double(), 1e-6)
    with pytest.raises(RuntimeError, match=r"\[M, H\]"):
        ops.rms_norm(torch.randn(8), None, w, 1e-6)


# ---------------------------------------------------------------------------------------------
# SiLU(gate) * up after the quantized GEMM

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,I", [(1, 8960), (3, 37), (16, 16), (40, 4864), (2, 1)])
def test_silu_mul_matches_reference(ops, dtype, M, I):
    g = torch.Generator().manual_seed(M * I)
    gu = torch.randn(M, 2 * I, generator=g) * 4
    gu[0, : min(I, 4)] = torch.tensor([0.0, -30.0, 30.0, -100.0])[: min(I, 4)]  # saturating gates
    want = reference.silu_and_mul(gu, dtype)  # fp32 SiLU * up, then one rounding to dtype
    impls = ops._silu_mul_impls()
    assert impls[0] == "scalar"
    for impl in ["auto", *impls]:
        got = ops._silu_mul_impl(gu, dtype, impl)
        assert got.dtype == dtype and got.shape == (M, I), impl
        tol = dict(rtol=2e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
        torch.testing.assert_close(got.float(), want.float(), **tol, msg=impl)
        # batch invariance: a row alone gives the same bits as in the batch
        for i in (0, M - 1):
            assert torch.equal(ops._silu_mul_impl(gu[i:i + 1], dtype, impl)[0], got[i]), impl
        if dtype == torch.bfloat16:  # one rounding of the fp32 result, by PyTorch's rule
            assert torch.equal(got, ops._silu_mul_impl(gu, torch.float32, impl).to(dtype)), impl
    assert torch.equal(ops.silu_mul(gu, dtype), ops._silu_mul_impl(gu, dtype, impls[-1]))


def test_silu_mul_propagates_nan_and_takes_strided_input(ops):
    gu = torch.randn(4, 34)
    gu[1, 3] = gu[2, 33] = float("nan")  # a gate in a full vector, an up in the tail
    for impl in ops._silu_mul_impls():
        for dtype in (torch.float32, torch.bfloat16):
            y = ops._silu_mul_impl(gu, dtype, impl)
            assert torch.isnan(y[1, 3]) and torch.isnan(y[2, 16]) and not torch.isnan(y[0]).any(), impl
    wide = torch.randn(3, 50)
    torch.testing.assert_close(ops.silu_mul(wide[:, 4:38], torch.float32),
                               reference.silu_and_mul(wide[:, 4:38]), rtol=2e-6, atol=1e-6)


def test_silu_mul_bad_input(ops):
    with pytest.raises(RuntimeError, match="float32"):
        ops.silu_mul(torch.randn(2, 8).to(torch.bfloat16), torch.float32)
    with pytest.raises(RuntimeError, match="even"):
        ops.silu_mul(torch.randn(2, 7), torch.float32)
    with pytest.raises(RuntimeError, match=r"\[M, 2\*I\]"):
        ops.silu_mul(torch.randn(8), torch.float32)
    with pytest.raises(RuntimeError, match="output dtype"):
        ops.silu_mul(torch.randn(2, 8), torch.float16)
    with pytest.raises(RuntimeError, match="unknown impl"):
        ops._silu_mul_impl(torch.randn(2, 8), torch.float32, "nope")
