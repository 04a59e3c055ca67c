"""Every CPU-capable MoE backend against the float64 reference, on outputs and all gradients."""

import pytest
import torch

import kernels.moe
from kernels.moe.reference import moe_reference
from tests.bounds import MoEBounds, routing_grad_terms
from tests.utils import MOE_CASES, make_inputs, run_with_grads


@pytest.mark.parametrize("backend", ["torch", "grouped_mm", "mega"])
@pytest.mark.parametrize("T,D,F,E,K,kind", MOE_CASES)
def test_backend_matches_reference(backend, T, D, F, E, K, kind):
    x, ids, w, w1, w3, w2 = make_inputs(T, D, F, E, K, kind)
    dy = torch.randn(T, D)
    if backend == "mega" and torch.cuda.is_available():  # Triton runs on the GPU there, not interpreted
        x, ids, w, w1, w3, w2, dy = (t.cuda() for t in (x, ids, w, w1, w3, w2, dy))
    ref_y, ref_grads = run_with_grads(moe_reference, x, ids, w, w1, w3, w2, dy, torch.float64)
    y, grads = run_with_grads(kernels.moe.get_moe_backend(backend), x, ids, w, w1, w3, w2, dy, torch.float32)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref_y, rtol=1e-4, atol=1e-5)
    assert y.device == x.device
    for name, g, rg in zip(["x", "topk_weights", "w1", "w3", "w2"], grads, ref_grads):
        torch.testing.assert_close(g.double(), rg, rtol=1e-4, atol=1e-5, msg=lambda m: f"d{name}: {m}")
    if kind == "one_expert_empty":
        for g in grads[2:]:
            assert torch.count_nonzero(g[0]) == 0, "an expert with no tokens must get zero gradient"


def test_reference_matches_dense_formula():
    """The oracle itself, against the formula written per (token, k) with no grouping at all."""
    x, ids, w, w1, w3, w2 = make_inputs(7, 8, 12, 4, 2, "random", dtype=torch.float64)
    expected = torch.zeros_like(x)
    for t in range(7):
        for k in range(2):
            e = ids[t, k]
            h = torch.nn.functional.silu(w1[e] @ x[t]) * (w3[e] @ x[t])
            expected[t] += w[t, k].double() * (w2[e] @ h)
    torch.testing.assert_close(moe_reference(x, ids, w, w1, w3, w2), expected)


def test_grouped_mm_cpu_fallback_loop(monkeypatch):
    """The per-expert loop that stands in where torch has no CPU _grouped_mm kernel."""
    import kernels.moe.grouped_mm as gm

    monkeypatch.setattr(gm, "_CPU_HAS_GROUPED_MM", False)
    x, ids, w, w1, w3, w2 = make_inputs(20, 16, 24, 6, 2, "one_expert_empty")
    dy = torch.randn(20, 16)
    ref_y, ref_grads = run_with_grads(moe_reference, x, ids, w, w1, w3, w2, dy, torch.float64)
    y, grads = run_with_grads(gm.moe_grouped_mm, x, ids, w, w1, w3, w2, dy, torch.float32)
    torch.testing.assert_close(y.double(), ref_y, rtol=1e-4, atol=1e-5)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), rg, rtol=1e-4, atol=1e-5)


def test_grouped_mm_compiles_fullgraph():
    x, ids, w, w1, w3, w2 = make_inputs(12, 16, 24, 4, 2, "random")
    fn = torch.compile(kernels.moe.get_moe_backend("grouped_mm"), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(fn(x, ids, w, w1, w3, w2), moe_reference(x, ids, w, w1, w3, w2), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["random", "one_expert_empty", "all_on_first"])
def test_grouped_mm_float32_compiles_with_inductor(kind):
    """float32 (the debug config) under inductor: the fallback's traced form (a dense masked product,
    no host read of the offsets) lowers, forward and backward, and matches the float64 reference.
    The loop form did not: inductor could not lower its backward (data-dependent slice sizes)."""
    x, ids, w, w1, w3, w2 = make_inputs(20, 16, 24, 6, 2, kind)
    dy = torch.randn(20, 16)
    fn = torch.compile(kernels.moe.get_moe_backend("grouped_mm"), fullgraph=True)
    ref_y, ref_grads = run_with_grads(moe_reference, x, ids, w, w1, w3, w2, dy, torch.float64)
    y, grads = run_with_grads(fn, x, ids, w, w1, w3, w2, dy, torch.float32)
    torch.testing.assert_close(y.double(), ref_y, rtol=1e-4, atol=1e-5)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), rg, rtol=1e-4, atol=1e-5)


def test_unknown_backend_lists_registered():
    with pytest.raises(ValueError, match="unknown MoE backend 'nope'.*grouped_mm.*torch"):
        kernels.moe.get_moe_backend("nope")


def gpu_backend(name: str):
    """The backend, or a skip when its optional package is missing (the gpu marker skips without CUDA)."""
    try:
        return kernels.moe.get_moe_backend(name)
    except ImportError as e:
        pytest.skip(str(e))


# Per piece against float64 (tests/bounds.py): rows of y and dx, each expert's weight gradients and
# their rows and columns, routing-weight gradients against their terms. bf16 rounds every stored
# intermediate to nearest; each bound is ~3x what correct code measures and at most ~1/3 of what a
# dropped slot or a token missing from an expert's weight gradient typically measures
# (docs/testing.md, "Bounds that catch a dropped slot").
BF16_BOUNDS = MoEBounds(rows=2.5e-2, expert=1.5e-2, lines=5e-2, terms=6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["grouped_mm", "mega", "torchtitan"])
@pytest.mark.parametrize("T,D,F,E,K,kind", [(1000, 256, 384, 16, 4, "random"), (513, 256, 384, 16, 8, "all_on_first"),
                                            (300, 256, 384, 16, 2, "one_expert_empty")])
def test_backend_bf16_cuda(backend, T, D, F, E, K, kind):
    fn = gpu_backend(backend)
    x, ids, w, w1, w3, w2 = [t.cuda() for t in make_inputs(T, D, F, E, K, kind)]
    dy = torch.randn(T, D, device="cuda")
    # The reference takes the bf16 values the backend computes from, so only the backend's own
    # roundings are measured.
    x, w1, w3, w2, dy = (t.bfloat16() for t in (x, w1, w3, w2, dy))
    ref_y, ref_grads = run_with_grads(moe_reference, x, ids, w, w1, w3, w2, dy, torch.float64)
    y, grads = run_with_grads(fn, x, ids, w, w1, w3, w2, dy, torch.bfloat16)
    assert y.dtype == torch.bfloat16
    BF16_BOUNDS.assert_close(y, grads, ref_y, ref_grads, routing_grad_terms(x, ids, w1, w3, w2, dy),
                             f"{backend} T={T} K={K} E={E} {kind}")


@pytest.mark.gpu
def test_grouped_mm_float32_on_cuda_falls_back_to_the_loop():
    """_grouped_mm has no float32 CUDA kernel: the per-expert loop must give the reference result."""
    x, ids, w, w1, w3, w2 = [t.cuda() for t in make_inputs(40, 16, 24, 6, 2, "one_expert_empty")]
    dy = torch.randn(40, 16, device="cuda")
    ref_y, ref_grads = run_with_grads(moe_reference, x, ids, w, w1, w3, w2, dy, torch.float64)
    y, grads = run_with_grads(kernels.moe.get_moe_backend("grouped_mm"), x, ids, w, w1, w3, w2, dy, torch.float32)
    torch.testing.assert_close(y.double(), ref_y, rtol=1e-4, atol=1e-4)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), rg, rtol=1e-4, atol=1e-4)


def test_reference_stays_connected_without_rows():
    """Every slot empty (a rank that receives no rows under EP): the reference's output still depends
    on x and the weights, so its backward runs (zero gradients) and the EP ranks run the same
    backward all-to-alls."""
    x = torch.randn(3, 8, requires_grad=True)
    w1, w3 = (torch.randn(2, 4, 8, requires_grad=True) for _ in range(2))
    w2 = torch.randn(2, 8, 4, requires_grad=True)
    ids = torch.full((3, 1), -1)
    y = moe_reference(x, ids, torch.ones(3, 1), w1, w3, w2)
    assert y.requires_grad and (y == 0).all()
    grads = torch.autograd.grad(y.sum(), (x, w1, w3, w2))
    assert all((g == 0).all() for g in grads)
