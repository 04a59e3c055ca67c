"""bench/attention_gqa.py's FlexAttention path computes the model's attention (causal, GQA)."""

import os

import pytest
import torch
import torch.nn.functional as F


def test_flex_causal_attention_matches_sdpa():
    """Forward on CPU (FlexAttention has no CPU backward); forward and backward on a GPU."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from bench.attention_gqa import flex_causal_attention

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs each run; the seed is in failures
    torch.manual_seed(seed)
    # L = 200: not a multiple of FlexAttention's 128-token blocks (a partial last block).
    q, k, v = (torch.randn(1, h, 200, 64, device=dev, requires_grad=cuda) for h in (8, 2, 2))
    attn = flex_causal_attention(compiled=cuda)
    got = attn(q, k, v)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"seed={seed}: {m}")
    if cuda:
        g_got = torch.autograd.grad(got.square().sum(), (q, k, v))
        g_want = torch.autograd.grad(want.square().sum(), (q, k, v))
        for a, b in zip(g_got, g_want):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3, msg=lambda m: f"seed={seed}: {m}")
    assert attn(q, k, v).shape == want.shape  # the cached block mask serves the second call
