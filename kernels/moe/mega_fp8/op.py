"""The FP8 mega-MoE op: the routed-expert SwiGLU MLP with every GEMM in block-scaled e4m3.

    y_TD = mega_moe_fp8(x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF)
    y[t] = sum_k s[t,k] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])),  e = topk_ids[t,k]

The bf16 ``mega`` op (``kernels/moe/mega/op.py``) with its operands quantized DeepSeek-V3 style:
activations and gradients in 1 x 128 tiles along the reduction dim, weights in 128 x 128 blocks,
weight-gradient operands in 128 x 1 tiles along the tokens of one expert; fp32 accumulation with
the scales applied per 128-long K step. Forward and backward are ``torch.library`` custom ops
(``mega_moe_fp8::forward``, ``mega_moe_fp8::backward``) with fake implementations and a registered
autograd formula, so ``torch.compile(fullgraph=True)`` sees the layer as one node each way.

Saved for backward, as in the bf16 op: x, the routing weights, the three weights, H = [gate | up]
(N x 2F bf16) and the routing metadata. The weights' e4m3 copies are made per call (forward and
again in the backward), or once per optimizer step by the caller and passed as ``quantized``
(:class:`~kernels.moe.mega_fp8.weights.QuantizedExpertWeights`; ``components/precision/copies.py``
does this in training), in which case the weights themselves are only gradient carriers: they may
be the float32 master weights, whose gradients the kernels then write in float32 directly.

Options (:class:`MegaFP8Options`, passed per call as ``options=``; the defaults when None):
``pow2_scales`` to round every scale up to a power of two, ``engine`` the FP8 GEMM engine
(``kernels/fp8/engine.py``). The custom ops take them as plain arguments, and the autograd formula
hands the forward's to the backward.
"""

from __future__ import annotations

import dataclasses

import torch

from kernels.fp8.engine import ENGINES, resolve_engine
from kernels.moe import register_moe_backend
from kernels.moe.mega.op import _backward_fake as _bf16_backward_fake
from kernels.moe.mega.op import _check_device, _check_inputs
from kernels.moe.mega.op import _forward_fake as _bf16_forward_fake
from kernels.moe.mega_fp8.backward import moe_fp8_backward
from kernels.moe.mega_fp8.forward import moe_fp8_forward
from kernels.moe.mega_fp8.weights import QuantizedExpertWeights

_Tensors4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_Tensors5 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class MegaFP8Options:
    """Knobs of the ``mega_fp8`` backend.

    pow2_scales: round every scale up to a power of two (rescaling is exact; a tile's largest
        value then maps into [224, 448] instead of to 448).
    engine: "auto" (default), "gluon" or "triton": the kernels of the FP8 GEMMs, all of which have
        a warp-specialized Gluon version (``kernels/fp8/engine.py``): gate/up, down, dX, dA' and the
        weight gradients.
    """

    pow2_scales: bool = False
    engine: str = "auto"

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"MegaFP8Options.engine must be one of {ENGINES}, got {self.engine!r}")


@torch.library.custom_op("mega_moe_fp8::forward", mutates_args=())
def _forward_op(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w1_EFD: torch.Tensor,
    w3_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    pow2_scales: bool,
    engine: str,
    write_empty_rows: bool,
    wq: list[torch.Tensor],
) -> _Tensors4:
    """Returns (y_TD, h_N2F, sorted_slot_N int32, offsets_E1 int32); ``wq`` the weights' e4m3 copies
    (``QuantizedExpertWeights.tensors()``) or empty."""
    _check_device(x_TD)
    return moe_fp8_forward(x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, pow2_scales,
                           _quantized(wq, pow2_scales), resolve_engine(engine, x_TD.device), write_empty_rows)


def _quantized(wq: list[torch.Tensor], pow2_scales: bool) -> QuantizedExpertWeights | None:
    return QuantizedExpertWeights.from_tensors(wq, pow2_scales) if wq else None


@_forward_op.register_fake
def _forward_fake(x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, pow2_scales, engine, write_empty_rows,
                  wq):
    # Outputs of the bf16 op's shapes and dtypes.
    return _bf16_forward_fake(x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, write_empty_rows)


@torch.library.custom_op("mega_moe_fp8::backward", mutates_args=())
def _backward_op(
    dy_TD: torch.Tensor,
    x_TD: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w1_EFD: torch.Tensor,
    w3_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    h_N2F: torch.Tensor,
    sorted_slot_N: torch.Tensor,
    offsets_E1: torch.Tensor,
    pow2_scales: bool,
    engine: str,
    write_empty_rows: bool,
    wq: list[torch.Tensor],
) -> _Tensors5:
    """Returns (dx_TD, dw1_EFD, dw3_EFD, dw2_EDF in the weights' dtypes, dtopk_weights_TK fp32)."""
    _check_device(x_TD)
    return moe_fp8_backward(
        dy_TD, x_TD, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, h_N2F, sorted_slot_N, offsets_E1, pow2_scales,
        _quantized(wq, pow2_scales), resolve_engine(engine, x_TD.device), write_empty_rows,
    )


@_backward_op.register_fake
def _backward_fake(dy_TD, x_TD, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, h_N2F, sorted_slot_N, offsets_E1,
                   pow2_scales, engine, write_empty_rows, wq):
    return _bf16_backward_fake(dy_TD, x_TD, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, h_N2F, sorted_slot_N,
                               offsets_E1, write_empty_rows)


_N_SAVED = 8


def _setup_context(ctx, inputs, output):
    x_TD, _, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, pow2_scales, engine, write_empty_rows, wq = inputs
    _, h_N2F, sorted_slot_N, offsets_E1 = output
    # The cached e4m3 copies are saved by reference (they live until the next optimizer step anyway).
    ctx.save_for_backward(x_TD, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, h_N2F, sorted_slot_N, offsets_E1, *wq)
    ctx.pow2_scales, ctx.engine, ctx.write_empty_rows = pow2_scales, engine, write_empty_rows


def _autograd_backward(ctx, dy_TD, _dh, _dslot, _doffsets):
    # Only y carries a gradient: H and the routing metadata are returned for the backward alone.
    saved = ctx.saved_tensors
    dy_TD = dy_TD.to(saved[0].dtype).contiguous()
    dx, dw1, dw3, dw2, ds = torch.ops.mega_moe_fp8.backward(
        dy_TD, *saved[:_N_SAVED], ctx.pow2_scales, ctx.engine, ctx.write_empty_rows, list(saved[_N_SAVED:]))
    # The custom op's autograd wants the inputs' structure back: one None per tensor of wq.
    return dx, None, ds, dw1, dw3, dw2, None, None, None, [None] * (len(saved) - _N_SAVED)


_forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def _check_bf16(x_TD, w1_EFD=None, w3_EFD=None, w2_EDF=None) -> None:
    for name, t in (("x_TD", x_TD), ("w1_EFD", w1_EFD), ("w3_EFD", w3_EFD), ("w2_EDF", w2_EDF)):
        if t is not None and t.dtype != torch.bfloat16:
            raise TypeError(
                f"mega_fp8: {name} has dtype {t.dtype}; the FP8 MoE quantizes bfloat16 activations and "
                f"weights only (train with [training] mixed_precision_param = \"bfloat16\", or set "
                f"[precision] moe = \"none\" for the {t.dtype} mega kernels)"
            )


@register_moe_backend("mega_fp8", routed_rows_only=True, takes=("fp8_options", "quantized"))
def mega_moe_fp8(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w1_EFD: torch.Tensor,
    w3_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    quantized: QuantizedExpertWeights | None = None,
    options: MegaFP8Options | None = None,
    write_empty_rows: bool = True,
) -> torch.Tensor:
    """Routed-expert SwiGLU MLP, block-scaled FP8 GEMMs in fused Triton kernels.

    Args:
        x_TD: (T, D) bfloat16 tokens.
        topk_ids_TK: (T, K) int32/int64 expert ids in [0, E), or -1 for an empty slot that
            contributes nothing and gets zero gradients (not range-checked: that would sync).
        topk_weights_TK: (T, K) float routing weights (computed in fp32).
        w1_EFD, w3_EFD: (E, F, D) bfloat16 gate and up projections.
        w2_EDF: (E, D, F) bfloat16 down projection.
        D and F need not be multiples of 128 (partial scale tiles are masked), but the GEMMs run
        at full speed only when they are.
        quantized: the three weights' e4m3 copies, made with
            ``QuantizedExpertWeights.quantize(w1, w3, w2, pow2_scales)`` since the weights last
            changed (the op cannot tell if they are stale). The weights are then read only for
            their shapes and gradients, and may be any float dtype (e.g. the float32 master
            weights: their gradients are written in float32). Quantized with the options'
            ``pow2_scales`` (checked).
        options: :class:`MegaFP8Options` (None: the defaults).
        write_empty_rows: False leaves the rows of y and of x's gradient undefined (not zero) for
            tokens with no routed slot; only the rows of routed tokens of x and of y's gradient
            are read either way.

    Returns:
        y_TD: (T, D) bfloat16. Differentiable w.r.t. x, the three weights (grads in their dtypes)
        and topk_weights_TK (fp32 grad). Deterministic.
    """
    opts = options if options is not None else MegaFP8Options()
    if not isinstance(opts, MegaFP8Options):
        raise TypeError(f"mega_fp8: options must be a MegaFP8Options, got {type(opts).__name__}")
    if quantized is None:
        _check_bf16(x_TD, w1_EFD, w3_EFD, w2_EDF)
        _check_inputs(x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF)
    else:
        _check_bf16(x_TD)
        _check_inputs(x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, match_weight_dtype=False)
        quantized.check_matches(w1_EFD, w3_EFD, w2_EDF, opts.pow2_scales)
    y_TD, _, _, _ = torch.ops.mega_moe_fp8.forward(
        x_TD.contiguous(),
        topk_ids_TK.contiguous(),
        topk_weights_TK.to(torch.float32).contiguous(),
        # With the e4m3 copies the weights are read for their shapes and dtypes only: a gradient
        # carrier without storage (stride 0) must not be made contiguous, which would fill it.
        *((w1_EFD, w3_EFD, w2_EDF) if quantized is not None else (w1_EFD.contiguous(), w3_EFD.contiguous(),
                                                                   w2_EDF.contiguous())),
        opts.pow2_scales,
        opts.engine,
        write_empty_rows,
        quantized.tensors() if quantized is not None else [],
    )
    return y_TD
