"""Chunked output projection + cross-entropy (models/loss.py) against the plain path, and the
trainer's compiled cross-entropy (components/loss.py)."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from models.loss import linear_cross_entropy


def linear_cross_entropy_reference(h_ND, w_VD, labels_N):
    """Mean cross-entropy of ``h @ w.T`` against ``labels``, the plain path, in float32 or better."""
    logits = h_ND @ w_VD.t()
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels_N)


@pytest.mark.parametrize("N,D,V,chunk", [(37, 16, 50, 8), (64, 32, 301, 64), (5, 8, 7, 100)])
def test_matches_plain_cross_entropy_and_gradients(N, D, V, chunk):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    h = torch.randn(N, D, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, D, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (N,), generator=gen)
    ref = linear_cross_entropy_reference(h, w, labels)
    ref.backward()
    ref_dh, ref_dw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    got = linear_cross_entropy(h32, w32, labels, chunk)
    (2.0 * got).backward()  # a non-unit upstream gradient must scale both gradients
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h32.grad.double(), 2 * ref_dh, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w32.grad.double(), 2 * ref_dw, rtol=1e-4, atol=1e-6)


def test_bad_chunk():
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        linear_cross_entropy(torch.zeros(2, 2), torch.zeros(3, 2), torch.zeros(2, dtype=torch.long), 0)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    not torch.cuda.is_available() and not (shutil.which("c++") or shutil.which("g++")),
    reason="inductor on CPU compiles C++"))])
def test_compiled_cross_entropy_matches_eager(backend):
    """The trainer's loss, compiled as with [compile] enable: same loss and logits gradient (bf16
    logits, float32 loss) as the eager function."""
    from components.loss import build_loss_fn, cross_entropy_loss

    assert build_loss_fn(False, backend) is cross_entropy_loss
    torch._dynamo.reset()
    compiled = build_loss_fn(True, backend)
    logits = (torch.randn(2, 24, 1000) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 1000, (2, 24))
    results = []
    for fn in (cross_entropy_loss, compiled):
        leaf = logits.clone().requires_grad_()
        loss = fn(leaf, labels)
        loss.backward()
        assert loss.dtype == torch.float32 and leaf.grad.dtype == torch.bfloat16
        results.append((loss.detach(), leaf.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-2, atol=1e-5)
