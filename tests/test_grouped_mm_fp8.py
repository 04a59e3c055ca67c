"""The ``grouped_mm_fp8`` MoE backend (TorchTitan's rowwise FP8 expert GEMMs).

On CPU the backend's ``torch._scaled_grouped_mm`` is emulated (dequantize exactly, float32 grouped
GEMM); the quantization is the code the GPU runs. Two oracles:

- the same FP8 method written expert by expert with the dense rowwise FP8 linear
  (``kernels.fp8.rowwise``: ``torch._scaled_mm`` on CUDA, its exact emulation on CPU): each expert's tokens are one group, quantized
  along the same dims, so only accumulation order and bf16 roundings differ: checked per row, per
  expert and per weight-gradient row and column (``ORACLE_CPU``, ``ORACLE_GPU``);
- the float64 reference MoE: FP8 error. One FP8 GEMM is ~4% off (see test_float8_linear.py);
  an expert chains two (x -> SwiGLU hidden -> out), so outputs and gradients land at ~6-7%
  (9% seen for a single token, where few terms average): checked at < 12%.

(Measured on CPU: bit-identical to the first oracle, 5-9% from the second.)

The GPU tests (skipped without CUDA) run the real ``torch._scaled_grouped_mm`` against the
emulation, and the whole backend in bf16 against both oracles.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import kernels.moe
from kernels.fp8.rowwise import fp8_linear, quantize_rowwise
from kernels.moe.grouped_mm_fp8 import (emulated_scaled_grouped_mm, moe_grouped_mm_fp8, quantize_cols_grouped,
                                    route_by_expert_aligned, scaled_grouped_mm)
from kernels.moe.reference import moe_reference
from tests.bounds import MoEBounds, routing_grad_terms
from tests.utils import MOE_CASES, make_inputs, run_with_grads, short_run_losses
from tests.utils import rel_error as rel


def fp8_moe_oracle(x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF):
    """The FP8 MoE expert by expert with the dense FP8 linear (bf16 between the GEMMs, as the
    backend has it)."""
    y_TD = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
    for e in range(w1_EFD.shape[0]):
        token_idx, k_idx = torch.where(topk_ids_TK == e)
        if token_idx.numel() == 0:
            continue
        x_eD = x_TD[token_idx]
        h_eF = F.silu(fp8_linear(x_eD, w1_EFD[e], torch.bfloat16)) * fp8_linear(x_eD, w3_EFD[e], torch.bfloat16)
        out_eD = fp8_linear(h_eF, w2_EDF[e], torch.bfloat16)
        y_TD = y_TD.index_add(0, token_idx, out_eD.float() * topk_weights_TK[token_idx, k_idx].float().unsqueeze(-1))
    return y_TD.to(x_TD.dtype)


# Against the per-expert FP8 oracle, per piece (tests/bounds.py: rows of y and dx, each expert's weight
# gradients and their rows and columns, routing-weight gradients against their terms), so that one
# dropped slot or one token missing from an expert's weight gradient fails. On CPU the two agree up
# to fp32 accumulation order.
ORACLE_CPU = MoEBounds(rows=1e-5, expert=1e-5, lines=1e-5, terms=1e-5)
# On the GPU in bf16 they differ by bf16 summation order, the grouped kernels' fast accumulation and
# the rowwise requantization that a one-ulp difference can flip (a whole row or column of codes):
# ~3x or more of what that measures emulated on CPU (docs/testing.md, "Bounds that catch a dropped slot").
ORACLE_GPU = MoEBounds(rows=5e-2, expert=3e-2, lines=8e-2, terms=5e-2)


def assert_close_to_oracles(got, oracle, ref, oracle_bounds, terms, msg=""):
    """Output and gradients (y, dx, dtopk_weights, dw1, dw3, dw2): per piece against the FP8
    oracle, FP8-level (relative Frobenius) against float64. ``terms``: ``routing_grad_terms``."""
    oracle_bounds.assert_close(got[0], got[1:], oracle[0], oracle[1:], terms, f"from the per-expert FP8 oracle; {msg}")
    for name, g, r in zip(["y", "dx", "dtopk_weights", "dw1", "dw3", "dw2"], got, ref):
        assert rel(g, r) < 0.12, f"{name}: {rel(g, r):.3f} from the float64 reference; {msg}"


def inputs(T, D, F_, E, K, kind, seed):
    if kind == "all_on_one":  # every slot on expert 1: the others are empty
        x, _, w, w1, w3, w2 = make_inputs(T, D, F_, E, K, "random", seed=seed)
        return x, torch.ones(T, K, dtype=torch.long), w, w1, w3, w2
    return make_inputs(T, D, F_, E, K, kind, seed=seed)


# test_moe_backends' routings, with model and expert dims that FP8 GEMMs accept, and every slot on one expert.
CASES = [(T, 32, 48, E, K, kind) for T, _, _, E, K, kind in MOE_CASES] + [(40, 32, 48, 4, 1, "all_on_one")]


@pytest.mark.parametrize("T,D,F_,E,K,kind", CASES)
def test_route_by_expert_aligned(T, D, F_, E, K, kind):
    _, ids, *_ = inputs(T, D, F_, E, K, kind, seed=0)
    row_of_slot, token_of_row, offs = route_by_expert_aligned(ids, E)
    P = token_of_row.shape[0]
    assert offs.dtype == torch.int32 and int(offs[-1]) == P and P % 16 == 0
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    assert (sizes % 16 == 0).all() and (sizes >= 16).all(), sizes
    ids_N = ids.reshape(-1)
    valid = ids_N >= 0
    rows = row_of_slot[valid]
    assert rows.unique().numel() == rows.numel(), "two slots share a row"
    starts = offs.long() - sizes.long()
    e = ids_N[valid]
    assert ((rows >= starts[e]) & (rows < offs.long()[e])).all(), "a slot outside its expert's group"
    assert torch.equal(token_of_row[rows], torch.arange(T * K)[valid] // K)
    assert int((token_of_row < T).sum()) == int(valid.sum()), "padding rows must read the zero row"
    counts = torch.bincount(e, minlength=E)
    assert (sizes.long()[:-1] == ((counts[:-1] + 15) // 16).clamp(min=1) * 16).all()


@pytest.mark.parametrize("T,D,F_,E,K,kind", CASES)
def test_backend_matches_fp8_oracle_and_reference(T, D, F_, E, K, kind):
    x, ids, w, w1, w3, w2 = inputs(T, D, F_, E, K, kind, seed=1)
    dy = torch.randn(T, D, generator=torch.Generator().manual_seed(2))
    y, grads = run_with_grads(moe_grouped_mm_fp8, x, ids, w, w1, w3, w2, dy, torch.float32)
    oracle_y, oracle_grads = run_with_grads(fp8_moe_oracle, x, ids, w, w1, w3, w2, dy, torch.float32)
    ref_y, ref_grads = run_with_grads(moe_reference, x, ids, w, w1, w3, w2, dy, torch.float64)
    assert y.dtype == torch.float32
    assert_close_to_oracles([y, *grads], [oracle_y, *oracle_grads], [ref_y, *ref_grads], ORACLE_CPU,
                            routing_grad_terms(x, ids, w1, w3, w2, dy), f"T={T} K={K} E={E} {kind}")
    used = torch.zeros(E, dtype=torch.bool)
    used[ids[ids >= 0]] = True
    for g in grads[2:]:
        assert torch.count_nonzero(g[~used]) == 0, "an expert with no tokens must get zero gradient"
    if kind == "with_empty_slots":
        assert torch.count_nonzero(grads[1][ids < 0]) == 0, "an empty slot's routing weight gets no gradient"


def test_registered_and_resolved():
    assert kernels.moe.resolve_moe_backend("grouped_mm", "fp8_rowwise") == "grouped_mm_fp8"
    assert kernels.moe.get_moe_backend("grouped_mm_fp8").fn is moe_grouped_mm_fp8


def test_dims_not_multiple_of_16_are_rejected():
    x, ids, w, w1, w3, w2 = make_inputs(8, 16, 24, 4, 2, "random", seed=0)
    with pytest.raises(ValueError, match=r"expert hidden dim \(24\) must be multiples of 16"):
        moe_grouped_mm_fp8(x, ids, w, w1, w3, w2)


def test_compiles_fullgraph():
    x, ids, w, w1, w3, w2 = make_inputs(12, 32, 48, 4, 2, "with_empty_slots", seed=3)
    dy = torch.randn(12, 32)
    want_y, want_grads = run_with_grads(moe_grouped_mm_fp8, x, ids, w, w1, w3, w2, dy, torch.float32)
    torch._dynamo.reset()
    fn = torch.compile(moe_grouped_mm_fp8, backend="aot_eager", fullgraph=True)
    y, grads = run_with_grads(fn, x, ids, w, w1, w3, w2, dy, torch.float32)
    torch.testing.assert_close(y, want_y, rtol=0, atol=0)
    for g, want in zip(grads, want_grads):
        torch.testing.assert_close(g, want, rtol=0, atol=0)


def test_trains_like_bf16(tmp_path):
    ref = short_run_losses(tmp_path)
    got = short_run_losses(tmp_path, "--precision.moe", "fp8_rowwise")
    assert all(math.isfinite(v) for v in got)
    assert got == pytest.approx(ref, rel=1e-2)


needs_cuda = pytest.mark.gpu  # torch._scaled_grouped_mm needs a CUDA GPU (sm_90)


@needs_cuda
@pytest.mark.parametrize("kind", ["random", "one_expert_empty", "with_empty_slots"])
def test_scaled_grouped_mm_matches_emulation_cuda(kind):
    """The real kernel against the emulation on identical FP8 operands, in the forward layout
    (2D x 3D, as dgrad too) and the wgrad layout (2D x 2D, groups splitting the reduction)."""
    T, D, F_, E, K = 1000, 256, 384, 16, 4
    _, ids, *_ = make_inputs(T, D, F_, E, K, kind, seed=4)
    _, _, offs = route_by_expert_aligned(ids.cuda(), E)
    P = int(offs[-1])
    gen = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(P, D, device="cuda", generator=gen).bfloat16()
    w = torch.randn(E, F_, D, device="cuda", generator=gen).bfloat16()
    dout = torch.randn(P, F_, device="cuda", generator=gen).bfloat16()
    qa, sa = quantize_rowwise(a)
    qw, sw = quantize_rowwise(w)
    operands = (qa, qw.transpose(-2, -1), sa.view(-1), sw.squeeze(-1), offs)
    real, emulated = scaled_grouped_mm(*operands), emulated_scaled_grouped_mm(*operands)
    assert real.dtype == torch.bfloat16 and real.shape == (P, F_)
    assert rel(real, emulated) < 1e-2
    (qd, sd), (qa2, sa2) = quantize_cols_grouped(dout, offs), quantize_cols_grouped(a, offs)
    operands = (qd, qa2.t(), sd.reshape(-1), sa2.reshape(-1), offs)
    real, emulated = scaled_grouped_mm(*operands), emulated_scaled_grouped_mm(*operands)
    assert real.shape == (E, F_, D)
    assert rel(real, emulated) < 1e-2


@needs_cuda
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("T,D,F_,E,K,kind", [(1000, 256, 384, 16, 4, "random"), (513, 256, 384, 16, 8, "all_on_first"),
                                             (300, 256, 384, 16, 2, "one_expert_empty")])
def test_backend_bf16_cuda(T, D, F_, E, K, kind, compile):
    x, ids, w, w1, w3, w2 = [t.cuda() for t in make_inputs(T, D, F_, E, K, kind, seed=6)]
    dy = torch.randn(T, D, device="cuda")
    fn = moe_grouped_mm_fp8
    if compile:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    y, grads = run_with_grads(fn, x, ids, w, w1, w3, w2, dy, torch.bfloat16)
    oracle_y, oracle_grads = run_with_grads(fp8_moe_oracle, x, ids, w, w1, w3, w2, dy, torch.bfloat16)
    ref_y, ref_grads = run_with_grads(moe_reference, x, ids, w, w1, w3, w2, dy, torch.float64)
    assert y.dtype == torch.bfloat16
    assert_close_to_oracles([y, *grads], [oracle_y, *oracle_grads], [ref_y, *ref_grads], ORACLE_GPU,
                            routing_grad_terms(x, ids, w1, w3, w2, dy), f"T={T} K={K} E={E} {kind} compile={compile}")
