"""The portable spec's core attention against plain float64 torch math: causal, GQA, masks, packed (thd)."""

import math

import pytest
import torch

H, G, D = 4, 2, 8  # query heads, key/value groups (GQA), head dim


def make_attention(causal=True, dropout=0.0):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from entr_megatron.learner.attention import SDPACoreAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=H * D, num_attention_heads=H, num_query_groups=G,
                            kv_channels=D, attention_dropout=dropout)
    mask_type = AttnMaskType.causal if causal else AttnMaskType.no_mask
    return SDPACoreAttention(cfg, layer_number=1, attn_mask_type=mask_type, attention_type="self")


def reference_f64(q_SHD, k_SGD, v_SGD, allowed_SS):
    """softmax(q k^T / sqrt(D) + mask) v for one sequence, in float64; query head h uses group h // (H/G)."""
    q, k, v = (t.double() for t in (q_SHD, k_SGD, v_SGD))
    k = k.repeat_interleave(H // G, dim=1)
    v = v.repeat_interleave(H // G, dim=1)
    scores = torch.einsum("shd,thd->hst", q, k) / math.sqrt(D)
    scores = scores.masked_fill(~allowed_SS, float("-inf"))
    return torch.einsum("hst,thd->shd", scores.softmax(-1), v).reshape(q.shape[0], H * D)


def qkv(total, seed, batch=None):
    g = torch.Generator().manual_seed(seed)
    lead = (total,) if batch is None else (total, batch)
    return [torch.randn(*lead, n, D, generator=g).requires_grad_() for n in (H, G, G)]


def grads_f64(fn, tensors, g_out):
    """d <fn(tensors), g_out> / d tensors in float64."""
    xs = [t.detach().double().requires_grad_() for t in tensors]
    (fn(*xs) * g_out.double()).sum().backward()
    return [x.grad for x in xs]


def assert_f64_close(got, want):
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


def test_causal_gqa_matches_float64():
    attn = make_attention()
    s, b = 7, 3
    q, k, v = qkv(s, 0, batch=b)
    out = attn(q, k, v, None)
    assert out.shape == (s, b, H * D)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    g_out = torch.randn_like(out)
    out.backward(g_out)
    for i in range(b):
        want = reference_f64(q[:, i], k[:, i], v[:, i], causal)
        assert_f64_close(out[:, i], want)
        ref_grads = grads_f64(lambda a, b_, c: reference_f64(a, b_, c, causal), (q[:, i], k[:, i], v[:, i]), g_out[:, i])
        for t, want_g in zip((q, k, v), ref_grads):
            assert_f64_close(t.grad[:, i], want_g)


def test_megatron_mask_combines_with_causal():
    """attention_mask True = masked out (Megatron's convention), on top of causality."""
    attn = make_attention()
    s, b = 6, 2
    q, k, v = qkv(s, 1, batch=b)
    mask = torch.zeros(b, 1, s, s, dtype=torch.bool)
    mask[0, :, :, 0] = True  # sequence 0 may not look at token 0 ...
    mask[0, :, 0, 0] = False  # ... except token 0 itself (else its row is empty)
    out = attn(q, k, v, mask)
    for i in range(b):
        allowed = torch.ones(s, s, dtype=torch.bool).tril() & ~mask[i, 0]
        assert_f64_close(out[:, i], reference_f64(q[:, i], k[:, i], v[:, i], allowed))


def test_no_mask_is_bidirectional():
    attn = make_attention(causal=False)
    q, k, v = qkv(5, 2, batch=1)
    want = reference_f64(q[:, 0], k[:, 0], v[:, 0], torch.ones(5, 5, dtype=torch.bool))
    assert_f64_close(attn(q, k, v, None)[:, 0], want)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("short_len,chunk_scores", [(128, 1 << 24), (3, 1 << 24), (0, 1 << 24), (128, H * 40)],
                         ids=["padded-chunk", "mixed", "one-by-one", "many-chunks"])
def test_packed_sequences_never_attend_across_boundaries(padded, short_len, chunk_scores, monkeypatch):
    """Short sequences attend in padded chunks, long ones one by one (attention.SHORT_SEQ_LEN): every
    split (all in one chunk; lengths 1 and 3 chunked, 4 and 6 alone; all alone; a scores budget that
    puts 1 and 3 in one chunk, 4 and 6 in chunks of their own) gives the float64 reference."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from entr_megatron.learner import attention

    monkeypatch.setattr(attention, "SHORT_SEQ_LEN", short_len)
    monkeypatch.setattr(attention, "_CHUNK_SCORES", chunk_scores)
    attn = make_attention()
    lens = [3, 1, 6, 4]
    slots = [4, 2, 6, 6] if padded else lens  # padded: each sequence sits in a bigger slot
    cu = torch.tensor([0] + lens).cumsum(0).int()
    cu_pad = torch.tensor([0] + slots).cumsum(0).int()
    total = int(cu_pad[-1])
    q, k, v = qkv(total, 3)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(slots), max_seqlen_kv=max(slots),
        cu_seqlens_q_padded=cu_pad if padded else None, cu_seqlens_kv_padded=cu_pad if padded else None,
    )
    out = attn(q, k, v, None, packed_seq_params=params)
    assert out.shape == (total, H * D)
    g_out = torch.randn_like(out)
    out.backward(g_out)
    covered = torch.zeros(total, dtype=torch.bool)
    for start, n in zip(cu_pad.tolist(), lens):
        s = slice(start, start + n)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        assert_f64_close(out[s], reference_f64(q[s], k[s], v[s], causal))
        ref_grads = grads_f64(lambda a, b, c: reference_f64(a, b, c, causal), (q[s], k[s], v[s]), g_out[s])
        for t, want_g in zip((q, k, v), ref_grads):
            assert_f64_close(t.grad[s], want_g)
        covered[s] = True
    # Padding slots: zero output, and nothing flows back into them.
    assert (out[~covered] == 0).all()
    for t in (q, k, v):
        assert (t.grad[~covered] == 0).all()


def test_unsupported_options_are_refused_by_name():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from entr_megatron.learner.attention import SDPACoreAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, window_size=(8, 0))
    with pytest.raises(ValueError, match="window_size"):
        SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self")
    attn = make_attention()
    q, k, v = qkv(4, 0, batch=1)
    with pytest.raises(ValueError, match="attention_bias"):
        attn(q, k, v, None, attention_bias=torch.zeros(1))
