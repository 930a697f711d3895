"""Our Llama / Qwen2 implementation against Hugging Face transformers on the same weights."""
import pytest
import torch

from swiftspec.model_executor.models import load_model


def _hf_logits(model_dir, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _our_logits(model_dir, ids, dtype=torch.float32):
    m = load_model(model_dir, dtype=dtype)
    kv = m.make_kv_cache(64)
    n = len(ids)
    pos = torch.arange(n)
    h = m(torch.tensor(ids), pos, pos, torch.ones(n, n, dtype=torch.bool).tril(), kv)
    return m.compute_logits(h), m, kv


@pytest.mark.parametrize("fixture", ["tiny_dir", "tiny_llama_dir"])
def test_logits_match_transformers(fixture, request):
    d = request.getfixturevalue(fixture)
    ids = [5, 17, 33, 2, 90, 41, 7, 7, 12, 60]
    ours, _, _ = _our_logits(d, ids)
    ref = _hf_logits(d, ids)
    assert (ours - ref).abs().max() < 1e-4


def test_incremental_decode_matches_full_forward(tiny_dir):
    """Static cache: running tokens one by one equals one causal forward."""
    ids = [5, 17, 33, 2, 90, 41]
    full, m, _ = _our_logits(tiny_dir, ids)
    kv = m.make_kv_cache(64)
    rows = []
    for i, t in enumerate(ids):
        mask = torch.ones(1, i + 1, dtype=torch.bool)
        h = m(torch.tensor([t]), torch.tensor([i]), torch.tensor([i]), mask, kv)
        rows.append(m.compute_logits(h))
    assert torch.allclose(torch.cat(rows), full, atol=1e-5)


def test_tree_mask_equals_separate_sequences(tiny_dir):
    """Two branches in one forward (tree mask) equal two separate causal forwards."""
    prefix = [5, 17, 33]
    a, b = [40, 41], [50]
    m = load_model(tiny_dir)
    kv = m.make_kv_cache(64)
    n = len(prefix)
    pos = torch.arange(n)
    m(torch.tensor(prefix), pos, pos, torch.ones(n, n, dtype=torch.bool).tril(), kv)
    # tree: a0 -> a1, and b0, all children of the prefix; slots 3,4,5
    toks = torch.tensor([a[0], a[1], b[0]])
    positions = torch.tensor([3, 4, 3])
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[:, :3] = True
    mask[0, 3] = mask[1, 3] = mask[1, 4] = mask[2, 5] = True
    tree_logits = m.compute_logits(m(toks, positions, torch.tensor([3, 4, 5]), mask, kv))
    ref_a, _, _ = _our_logits(tiny_dir, prefix + a)
    ref_b, _, _ = _our_logits(tiny_dir, prefix + b)
    assert torch.allclose(tree_logits[0], ref_a[3], atol=1e-5)
    assert torch.allclose(tree_logits[1], ref_a[4], atol=1e-5)
    assert torch.allclose(tree_logits[2], ref_b[3], atol=1e-5)


def test_bf16_close_to_fp32(tiny_dir):
    ids = [5, 17, 33, 2, 90]
    f32, _, _ = _our_logits(tiny_dir, ids)
    b16, _, _ = _our_logits(tiny_dir, ids, torch.bfloat16)
    assert (f32 - b16).abs().max() / f32.abs().max() < 0.05


def test_int8_linear_matches_reference():
    """ops.int8_linear at decode sizes (CPU twin) and prefill sizes (torch's kernel) vs the reference."""
    from swiftspec import ops
    from swiftspec.model_executor.layers.quant import quantize_int8
    from swiftspec.ops import reference

    torch.manual_seed(0)
    w = torch.randn(96, 80)
    odd = torch.randn(70, 34)  # input features not a multiple of 16: torch's kernel cannot take them
    qo, so = quantize_int8(odd)
    for rows in (1, 3, 40):
        xo = torch.randn(rows, 34, dtype=torch.bfloat16)
        assert torch.allclose(ops.int8_linear(xo, qo, so.bfloat16()).float(),
                              reference.int8_linear(xo, qo, so.bfloat16()).float(), rtol=2e-2, atol=2e-2)
    w[3] = 0  # an all-zero row must not divide by zero
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and (q.abs() <= 127).all()
    assert ((q.float() * s[:, None]) - w).abs().max() <= s.max() / 2 + 1e-6
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (2, 7, 40):
            x = torch.randn(rows, 80, dtype=dtype)
            ref = reference.int8_linear(x, q, s.to(dtype))
            out = ops.int8_linear(x, q, s.to(dtype))
            tol = 5e-2  # bf16 rounding of the dequantized table or of fp32 activations (torch's kernel)
            assert (out.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()


def test_int8_draft_and_vocab_limit(tiny_dir):
    """A quantized draft stays close to the float model; a vocab limit returns the first ids' logits."""
    ids = [5, 17, 33, 2, 90]
    full, m, _ = _our_logits(tiny_dir, ids)
    n = len(ids)
    pos = torch.arange(n)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    h = m(torch.tensor(ids), pos, pos, mask, m.make_kv_cache(64))
    assert torch.allclose(m.compute_logits(h, vocab_limit=50), m.compute_logits(h)[:, :50], atol=1e-5)
    mq = load_model(tiny_dir, dtype=torch.float32, int8=True)
    assert mq.layers[0].mlp.down_proj.weight is None and mq.layers[0].mlp.down_proj.int8 is not None
    assert mq.lm_head.int8 is not None and mq.embed_tokens.weight is not None  # the embedding stays float
    hq = mq(torch.tensor(ids), pos, pos, mask, mq.make_kv_cache(64))
    q = mq.compute_logits(hq)
    assert q.shape == full.shape
    assert (q - full).abs().max() / full.abs().max() < 0.05
    assert (q.argmax(-1) == full.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("tp_size", [1, 2, 3])
def test_int8_layers_hold_the_whole_rows_quantization(tiny_dir, tp_size):
    """int8 is a format chosen when the model is built: every linear layer and the (tied) LM head
    hold an Int8Weight and no float weight; each rank's values and scales are the TP = 1 layer's
    slices of the whole rows' quantization (rank's shard of columns, scales of whole rows)."""
    from swiftspec.distributed.parallel import TPContext
    from swiftspec.model_executor.layers.linear import LinearBase, RowParallelLinear
    from swiftspec.model_executor.layers.quant import quantize_int8

    for rank in range(tp_size):
        tp = TPContext(rank=rank, size=tp_size)  # loading a rank needs no collective
        f = load_model(tiny_dir, tp=tp, dtype=torch.float32)
        q = load_model(tiny_dir, tp=tp, dtype=torch.float32, int8=True)
        full = load_model(tiny_dir, dtype=torch.float32) if tp_size > 1 else f
        for (name, lf), lq in zip(((n, m) for n, m in f.named_modules() if isinstance(m, LinearBase)),
                                  (m for m in q.modules() if isinstance(m, LinearBase))):
            assert lq.weight is None and lq.int8 is not None, name
            if isinstance(lf, RowParallelLinear):  # whole rows quantized, then this rank's columns
                qw, s = quantize_int8(full.get_submodule(name).weight.data)
                want = torch.zeros_like(lq.int8.qweight)
                keep = (lf.in_index >= 0).nonzero().squeeze(1)
                want[:, keep] = qw[:, lf.in_index[keep]]
            else:  # rows are whole on every rank
                want, s = quantize_int8(lf.weight.data)
            real = lf.weight.data.abs().amax(1) > 0  # padded rows: zero values, any scale
            assert torch.equal(lq.int8.qweight, want) and torch.equal(lq.int8.scales[real], s[real]), name
        head_q, head_s = quantize_int8(f.embed_tokens.weight.data)  # tied: the head quantizes the embedding
        assert q.cfg.tie_word_embeddings and q.embed_tokens.weight is not None
        n = min(q.lm_head.shard, q.cfg.vocab_size - q.lm_head.start)
        assert torch.equal(q.lm_head.int8.qweight[:n], head_q[:n]) and torch.equal(q.lm_head.int8.scales[:n], head_s[:n])
