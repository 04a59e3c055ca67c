"""Tests of the ``mega`` MoE backend (kernels/moe/mega) against the plain-PyTorch oracle.

Without a GPU the Triton kernels run on CPU tensors through the Triton interpreter, in float32 at
tiny shapes (D 32/40, F 48: partial tiles everywhere). With a GPU the same checks run in bfloat16 at
a medium shape. Inputs are fresh random draws each run; the seed is in every failure message
(TEST_SEED=<n> replays it).
"""

import dataclasses

import pytest
import torch

from kernels.moe import get_moe_backend
from kernels.moe.reference import moe_reference

triton = pytest.importorskip("triton")
from kernels.moe.mega import get_configs, mega_moe, moe_backward, moe_forward  # noqa: E402
from kernels.moe.mega import forward as _fwd_module  # noqa: E402
from kernels.moe.combine import one_slot_output  # noqa: E402
from kernels.common.routing import gather_sorted_rows, max_tiles, num_real_tiles, sort_by_expert, tile_table  # noqa: E402
from tests.triton_interpreter import DEVICE, skip_unless_runnable  # noqa: E402
from tests.triton_interpreter import HAS_CUDA as _HAS_CUDA  # noqa: E402
from tests.bounds import MoEBounds, routing_grad_terms  # noqa: E402
from tests.utils import (  # noqa: E402
    assert_unrouted_rows_unread, make_routing, random_seed, unrouted_routing,
)

skip_unless_runnable(_fwd_module._gate_up_kernel, "kernels.moe.mega")

# triton 3.6's interpreter converts 1-element arrays to scalars, which numpy deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _weights(E, D, F, dtype, device=DEVICE):
    w1 = torch.randn(E, F, D, device=device, dtype=dtype) / D**0.5
    w3 = torch.randn(E, F, D, device=device, dtype=dtype) / D**0.5
    w2 = torch.randn(E, D, F, device=device, dtype=dtype) / F**0.5
    return w1, w3, w2


def _mega_with_grads(x, ids, s, w1, w3, w2, dy, configs=None):
    """y and the gradients of (x, s, w1, w3, w2): through the public op's autograd, or, with
    ``configs``, through the forward and backward launchers that take them."""
    if configs is None:
        leaves = [t.clone().requires_grad_() for t in (x, s, w1, w3, w2)]
        y = mega_moe(leaves[0], ids, *leaves[1:])
        return y, torch.autograd.grad(y, leaves, dy)
    y, h, slots, offs = moe_forward(x, ids, s, w1, w3, w2, configs)
    dx, dw1, dw3, dw2, ds = moe_backward(dy, x, s, w1, w3, w2, h, slots, offs, configs)
    return y, (dx, ds, dw1, dw3, dw2)


# Bounds of the op against float64, per piece (tests/bounds.py): each token's row of y and dx, each
# expert's weight gradient and each of its rows and columns, each routing-weight gradient against its
# terms, so that one dropped slot or one token missing from an expert's weight gradient fails
# (docs/testing.md, "Bounds that catch a dropped slot", has what correct code and faults measure).
# fp32 rounds each result by 2^-24: correct code stays ~50x below, any fault far above.
FP32 = MoEBounds(rows=1e-5, expert=1e-5, lines=1e-5, terms=1e-5)
# bf16 on the GPU rounds H, A, dH, s * A, the slot rows and the outputs to nearest: ~3x its error.
BF16 = MoEBounds(rows=2.5e-2, expert=1.5e-2, lines=5e-2, terms=5e-2)
# bf16 in the interpreter, whose fp32 -> bf16 cast truncates (twice the error, and biased): ~3x that.
BF16_INTERPRETER = MoEBounds(rows=7e-2, expert=6e-2, lines=1e-1, terms=7e-2)


def _check_against_reference(T, K, E, D, F, kind, dtype, bounds, seed, configs=None):
    x = torch.randn(T, D, device=DEVICE, dtype=dtype)
    ids, s = make_routing(T, K, E, kind)
    w1, w3, w2 = _weights(E, D, F, dtype)
    dy = torch.randn(T, D, device=DEVICE, dtype=dtype)

    leaves = (x, s, w1, w3, w2)
    y, grads = _mega_with_grads(x, ids, s, w1, w3, w2, dy, configs)

    ref_leaves = [t.detach().double().requires_grad_() for t in (x, s, w1, w3, w2)]
    y_ref = moe_reference(ref_leaves[0], ids, *ref_leaves[1:])
    ref_grads = torch.autograd.grad(y_ref, ref_leaves, dy.double())

    assert y.dtype == dtype and y.shape == (T, D)
    msg = f"seed={seed} T={T} K={K} E={E} D={D} F={F} kind={kind} dtype={dtype}"
    for name, g, leaf in zip(("x", "topk_weights", "w1", "w3", "w2"), grads, leaves):
        assert g.dtype == leaf.dtype, f"d{name}: {g.dtype}; {msg}"
    # ds[t, k] = sum_f dA'[f] act[f] can cancel far below its terms (T = K = 1): its error is measured
    # against their root sum of squares.
    bounds.assert_close(y, grads, y_ref, ref_grads, routing_grad_terms(x, ids, w1, w3, w2, dy), msg)

    # Experts that receive no rows get exactly zero weight gradients.
    counts = torch.bincount(ids[ids >= 0].flatten(), minlength=E)
    for e in torch.nonzero(counts == 0).flatten().tolist():
        for name, g in zip(("w1", "w3", "w2"), grads[2:]):
            assert (g[e] == 0).all(), f"d{name}[{e}] of an empty expert is not zero; {msg}"


# (T, K, E, D, F, routing)
_INTERP_CASES = [
    pytest.param(1, 1, 4, 32, 48, "random", id="T1-top1"),
    pytest.param(7, 2, 4, 40, 48, "empty_expert", id="T7-top2-emptyexperts-D40"),
    pytest.param(33, 1, 4, 32, 48, "one_expert", id="T33-top1-all-to-one"),
    pytest.param(33, 2, 6, 40, 48, "random", id="T33-top2-D40"),
    pytest.param(17, 3, 5, 32, 48, "one_expert", id="T17-top3-all-to-one-repeated-ids"),
    pytest.param(33, 8, 8, 32, 48, "random", id="T33-top8"),
    # Expert parallelism's receive side: one slot per row, ~30% of them empty.
    pytest.param(29, 1, 4, 32, 48, "empty_slots", id="T29-top1-emptyslots"),
]


@pytest.mark.skipif(_HAS_CUDA, reason="interpreter cases run on CPU only; GPU cases below")
@pytest.mark.parametrize("T,K,E,D,F,kind", _INTERP_CASES)
def test_forward_backward_fp32_interpreter(T, K, E, D, F, kind):
    _check_against_reference(T, K, E, D, F, kind, torch.float32, FP32, random_seed())


@pytest.mark.skipif(_HAS_CUDA, reason="interpreter case")
def test_forward_backward_bf16_interpreter():
    """bf16 storage under the interpreter: exercises the fp32 upcast of dot operands (UPCAST)."""
    _check_against_reference(7, 2, 4, 32, 48, "random", torch.bfloat16, BF16_INTERPRETER, random_seed())


@pytest.mark.gpu
@pytest.mark.parametrize(
    "T,K,E,D,F,kind",
    [
        (512, 8, 16, 256, 384, "random"),
        (300, 4, 16, 256, 200, "empty_expert"),
        (257, 2, 8, 136, 256, "one_expert"),
        (1, 1, 4, 128, 64, "random"),
        (1000, 1, 16, 256, 384, "empty_slots"),
    ],
)
def test_forward_backward_bf16_gpu(T, K, E, D, F, kind):
    _check_against_reference(T, K, E, D, F, kind, torch.bfloat16, BF16, random_seed())


@pytest.mark.gpu
def test_forward_backward_fp32_gpu():
    _check_against_reference(100, 4, 8, 96, 80, "random", torch.float32, FP32, random_seed())


@pytest.mark.parametrize("split", [1, 2])
def test_dh_epilogue_split(split):
    """The dH kernel's epilogue done whole or one column half at a time."""
    T, K, E, D, F = (7, 2, 4, 32, 48) if not _HAS_CUDA else (300, 4, 16, 256, 200)
    dtype, bounds = (torch.float32, FP32) if not _HAS_CUDA else (torch.bfloat16, BF16)
    configs = get_configs(D, F, E, dtype)
    # grouped_mm_backward off: the bf16 GPU default would run dA' by cuBLAS, not the dH kernel.
    configs = dataclasses.replace(configs, dh=dataclasses.replace(configs.dh, epilogue_split=split),
                                  grouped_mm_backward=False)
    _check_against_reference(T, K, E, D, F, "random", dtype, bounds, random_seed(), configs)


def test_one_slot_output_zeroes_only_empty_slots():
    """Top-1's combine returns the GEMM's slot rows in place: the rows of empty slots, which no GEMM
    tile writes (here NaN), come back zero and every other row is untouched."""
    T, E, D = 37, 5, 80
    ids, _ = make_routing(T, 1, E, "empty_slots")
    slots, offs = sort_by_expert(ids.to(torch.int32), E)
    buf = torch.randn(T, D, device=DEVICE)
    empty = ids[:, 0] < 0
    assert empty.any() and not empty.all()
    buf[empty] = float("nan")
    expected = torch.where(empty[:, None], 0.0, buf)
    out = one_slot_output(buf, slots, offs)
    assert out.data_ptr() == buf.data_ptr()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("K,kind", [(1, "empty_slots"), (3, "empty_slots"), (8, "random")])
def test_gather_sorted_rows(K, kind, dtype):
    """The backward's expert-order operand copy equals index_select on the rows that belong to an
    expert and writes nothing past them (here NaN-filled bytes would show as changes)."""
    seed = random_seed()
    T, E, D = 37, 9, 72
    ids, _ = make_routing(T, K, E, kind)
    slots, offs = sort_by_expert(ids.to(torch.int32), E)
    src = (torch.randn(T, D, device=DEVICE) * 50).to(dtype)
    end = int(offs[-1])
    assert end < T * K or kind == "random"
    out = gather_sorted_rows(src, slots, offs, K)
    assert out.shape == (T * K, D) and out.dtype == dtype
    expected = src.index_select(0, (slots // K).long())
    assert torch.equal(out[:end], expected[:end]), f"seed={seed}"


@pytest.mark.parametrize("grouped_mm_backward", [False, True])
@pytest.mark.parametrize("kind", ["random", "empty_expert", "one_expert", "empty_slots"])
def test_backward_paths(kind, grouped_mm_backward):
    """The backward's two paths (MegaMoEConfigs.grouped_mm_backward): the fused Triton kernels, or
    dA', dX and the weight gradients through torch._grouped_mm on expert-sorted rows with the SwiGLU
    backward as its own kernel (on CPU grouped_mm's loop over the experts stands in)."""
    T, K, E, D, F = (33, 2, 4, 32, 48) if not _HAS_CUDA else (1000, 8, 16, 256, 384)
    dtype, bounds = (torch.float32, FP32) if not _HAS_CUDA else (torch.bfloat16, BF16)
    configs = dataclasses.replace(get_configs(D, F, E, dtype), grouped_mm_backward=grouped_mm_backward)
    _check_against_reference(T, K, E, D, F, kind, dtype, bounds, random_seed(), configs)


@pytest.mark.parametrize("path", ["op", "fused", "grouped_mm"])
@pytest.mark.parametrize("K", [1, 2])
def test_rows_of_unrouted_tokens_are_not_read(K, path):
    """``write_empty_rows=False`` (expert parallelism's receive side): the rows of x and dy of tokens
    with no routed slot hold NaN and are never read -- the routed tokens' y and dx, and every weight
    and routing gradient, equal bit for bit the default run's with those rows zero."""
    T, E, D, F = (29, 4, 32, 48) if not _HAS_CUDA else (1000, 16, 256, 384)
    dtype = torch.float32 if not _HAS_CUDA else torch.bfloat16
    seed = random_seed()
    ids, s, unrouted = unrouted_routing(T, K, E)
    x = torch.randn(T, D, device=DEVICE, dtype=dtype).masked_fill(unrouted[:, None], 0.0)
    dy = torch.randn(T, D, device=DEVICE, dtype=dtype).masked_fill(unrouted[:, None], 0.0)
    w1, w3, w2 = _weights(E, D, F, dtype)
    configs = dataclasses.replace(get_configs(D, F, E, dtype), grouped_mm_backward=path == "grouped_mm")

    def run(x, dy, write_empty_rows):
        if path == "op":
            leaves = [t.clone().requires_grad_() for t in (x, s, w1, w3, w2)]
            y = mega_moe(leaves[0], ids, *leaves[1:], write_empty_rows=write_empty_rows)
            return y, torch.autograd.grad(y, leaves, dy)
        y, h, slots, offs = moe_forward(x, ids, s, w1, w3, w2, configs, write_empty_rows=write_empty_rows)
        dx, dw1, dw3, dw2, ds = moe_backward(dy, x, s, w1, w3, w2, h, slots, offs, configs,
                                             write_empty_rows=write_empty_rows)
        return y, (dx, ds, dw1, dw3, dw2)

    assert_unrouted_rows_unread(run, x, dy, unrouted, seed)


@pytest.mark.parametrize("persistent", [0, 1])
def test_persistent_launch(persistent):
    """All four M-tiled kernels on a persistent grid (tile loop flattened) or one program per tile."""
    T, K, E, D, F = (33, 2, 4, 32, 48) if not _HAS_CUDA else (1000, 8, 16, 256, 384)
    dtype, bounds = (torch.float32, FP32) if not _HAS_CUDA else (torch.bfloat16, BF16)
    configs = get_configs(D, F, E, dtype)
    configs = dataclasses.replace(configs, grouped_mm_backward=False, **{
        name: dataclasses.replace(getattr(configs, name), persistent=persistent)
        for name in ("gate_up", "down", "dh", "dx")
    })  # fmt: skip
    _check_against_reference(T, K, E, D, F, "empty_expert", dtype, bounds, random_seed(), configs)


@pytest.mark.parametrize("T,K,E,kind", [(7, 2, 4, "empty_expert"), (33, 8, 8, "random"), (20, 1, 3, "one_expert")])
@pytest.mark.parametrize("block_m", [16, 64])
def test_routing_metadata(T, K, E, kind, block_m):
    seed = random_seed()
    ids, _ = make_routing(T, K, E, kind)
    N = T * K
    sorted_slot, offsets = sort_by_expert(ids, E)
    ids_N = ids.flatten().cpu()
    counts = torch.bincount(ids_N, minlength=E)
    # Stable order: by expert, then by slot.
    expected_order = sorted(range(N), key=lambda n: (ids_N[n].item(), n))
    assert sorted_slot.dtype == torch.int32 and offsets.dtype == torch.int32
    assert sorted_slot.cpu().tolist() == expected_order, f"seed={seed}"
    assert offsets.cpu().tolist() == [0] + counts.cumsum(0).tolist(), f"seed={seed}"

    table = tile_table(offsets, N, block_m).cpu()
    assert table.shape == (2, max_tiles(N, E, block_m)) == (2, N // block_m + E)
    expected = [(e, start) for e in range(E) for start in range(offsets[e].item(), offsets[e + 1].item(), block_m)]
    real = len(expected)
    expected += [(-1, 0)] * (table.shape[1] - len(expected))
    assert list(zip(table[0].tolist(), table[1].tolist())) == expected, f"seed={seed}"
    # The persistent loops run over exactly the real tiles, whose count follows the table.
    assert num_real_tiles(tile_table(offsets, N, block_m)).item() == real, f"seed={seed}"


def test_deterministic():
    seed = random_seed()
    T, K, E, D, F = (33, 4, 8, 32, 48) if not _HAS_CUDA else (2048, 8, 32, 512, 384)
    dtype = torch.float32 if not _HAS_CUDA else torch.bfloat16
    x = torch.randn(T, D, device=DEVICE, dtype=dtype)
    ids, s = make_routing(T, K, E, "random")
    ws = _weights(E, D, F, dtype)
    dy = torch.randn(T, D, device=DEVICE, dtype=dtype)
    outs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (x, s, *ws)]
        y = mega_moe(leaves[0], ids, *leaves[1:])
        outs.append([y, *torch.autograd.grad(y, leaves, dy)])
    for a, b in zip(*outs):
        assert torch.equal(a, b), f"seed={seed}"


def test_compile_fullgraph():
    """One node each way under torch.compile(fullgraph=True): no graph break, same numbers."""
    seed = random_seed()
    T, K, E, D, F = 9, 2, 4, 32, 48
    dtype = torch.float32 if not _HAS_CUDA else torch.bfloat16
    x = torch.randn(T, D, device=DEVICE, dtype=dtype)
    ids, s = make_routing(T, K, E, "random")
    ws = _weights(E, D, F, dtype)

    def layer(x, ids, s, w1, w3, w2):
        return get_moe_backend("mega")(x * 2.0, ids, s, w1, w3, w2).float().square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager" if not _HAS_CUDA else "inductor", fullgraph=True)
    results = []
    for fn in (layer, compiled):
        leaves = [t.clone().requires_grad_() for t in (x, s, *ws)]
        loss = fn(leaves[0], ids, *leaves[1:])
        results.append([loss, *torch.autograd.grad(loss, leaves)])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"seed={seed}: {m}")


def test_backend_registered():
    assert get_moe_backend("mega").fn is mega_moe


def _good_inputs(dtype=torch.float32, device=DEVICE):
    T, K, E, D, F = 3, 2, 4, 32, 48
    ids, s = make_routing(T, K, E, "random", device=device)
    return [torch.randn(T, D, device=device, dtype=dtype), ids, s, *_weights(E, D, F, dtype, device=device)]


@pytest.mark.parametrize(
    "change,error,pattern",
    [
        (lambda a: a.__setitem__(0, a[0].double()), TypeError, "x_TD has dtype torch.float64"),
        (lambda a: a.__setitem__(0, a[0][None]), ValueError, "x_TD must be 2-D"),
        (lambda a: a.__setitem__(1, a[1].float()), TypeError, "topk_ids_TK must be int32 or int64"),
        (lambda a: a.__setitem__(1, a[1][:2]), ValueError, "topk_ids_TK must have shape"),
        (lambda a: a.__setitem__(2, a[2][:, :1]), ValueError, "topk_weights_TK must have the shape"),
        (lambda a: a.__setitem__(3, a[3][:, :, :16]), ValueError, "w1_EFD must have shape"),
        (lambda a: a.__setitem__(4, a[4][:3]), ValueError, "w3_EFD must have the shape"),
        (lambda a: a.__setitem__(5, a[5].transpose(1, 2)), ValueError, "w2_EDF must have shape"),
        (lambda a: a.__setitem__(5, a[5].half()), TypeError, "w2_EDF has dtype torch.float16"),
    ],
)
def test_input_errors(change, error, pattern):
    args = _good_inputs()
    change(args)
    with pytest.raises(error, match=pattern):
        mega_moe(*args)


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs a CUDA device.*on CPU use the .grouped_mm. or .torch. backend.*TRITON_INTERPRET=1"):
        mega_moe(*_good_inputs(device="cpu"))
