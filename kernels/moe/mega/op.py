"""The mega-MoE op: routed-expert SwiGLU MLP as fused Triton grouped GEMMs, with its autograd.

    y_TD = mega_moe(x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF)
    y[t] = sum_k s[t,k] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])),  e = topk_ids[t,k]

Forward and backward are ``torch.library`` custom ops (``mega_moe::forward``,
``mega_moe::backward``) with fake implementations and a registered autograd formula, so
``torch.compile(fullgraph=True)`` sees the layer as one node each way and never breaks the graph.

Saved for backward: x (not gathered), the routing weights, the three expert weights, H = [gate | up]
(N x 2F, activation dtype) and the routing metadata (sorted slots, expert offsets): nothing of
N x D. See ``forward.py`` and ``backward.py`` for the kernels.
"""

import torch

from kernels.common.triton_utils import interpreting
from kernels.moe import register_moe_backend
from kernels.moe.mega.backward import moe_backward
from kernels.moe.mega.forward import moe_forward

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_Tensors4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_Tensors5 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _check_device(x_TD: torch.Tensor) -> None:
    if x_TD.device.type == "cuda":
        return
    if x_TD.device.type == "cpu" and interpreting():
        return
    raise RuntimeError(
        f"the 'mega' MoE backend runs Triton kernels and needs a CUDA device, but x_TD is on "
        f"{x_TD.device}; move the layer to CUDA, or on CPU use the 'grouped_mm' or 'torch' backend "
        f"(the kernel tests run it on CPU in Triton's interpreter, TRITON_INTERPRET=1, far too slow to train)"
    )


def _check_inputs(x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, match_weight_dtype: bool = True
                  ) -> None:
    """Shapes, dtypes and devices; ``match_weight_dtype=False`` (weights that only carry gradients,
    the FP8 op with cached e4m3 copies) asks the weights for a float dtype instead of x's."""
    if x_TD.dim() != 2:
        raise ValueError(f"mega_moe: x_TD must be 2-D (T, D), got shape {tuple(x_TD.shape)}")
    if x_TD.dtype not in _DTYPES:
        raise TypeError(f"mega_moe: x_TD has dtype {x_TD.dtype}; supported: bfloat16, float16, float32")
    T, D = x_TD.shape
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != T or topk_ids_TK.shape[1] < 1:
        raise ValueError(
            f"mega_moe: topk_ids_TK must have shape (T={T}, K>=1), got {tuple(topk_ids_TK.shape)}"
        )
    if topk_ids_TK.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"mega_moe: topk_ids_TK must be int32 or int64, got {topk_ids_TK.dtype}")
    if topk_weights_TK.shape != topk_ids_TK.shape:
        raise ValueError(
            f"mega_moe: topk_weights_TK must have the shape of topk_ids_TK {tuple(topk_ids_TK.shape)}, "
            f"got {tuple(topk_weights_TK.shape)}"
        )
    if not topk_weights_TK.dtype.is_floating_point:
        raise TypeError(f"mega_moe: topk_weights_TK must be a float tensor, got {topk_weights_TK.dtype}")
    if w1_EFD.dim() != 3 or w1_EFD.shape[2] != D:
        raise ValueError(f"mega_moe: w1_EFD must have shape (E, F, D={D}), got {tuple(w1_EFD.shape)}")
    E, F, _ = w1_EFD.shape
    if E < 1 or F < 1:
        raise ValueError(f"mega_moe: w1_EFD must have E >= 1 and F >= 1, got {tuple(w1_EFD.shape)}")
    if w3_EFD.shape != w1_EFD.shape:
        raise ValueError(
            f"mega_moe: w3_EFD must have the shape of w1_EFD {tuple(w1_EFD.shape)}, got {tuple(w3_EFD.shape)}"
        )
    if w2_EDF.shape != (E, D, F):
        raise ValueError(f"mega_moe: w2_EDF must have shape (E={E}, D={D}, F={F}), got {tuple(w2_EDF.shape)}")
    for name, w in (("w1_EFD", w1_EFD), ("w3_EFD", w3_EFD), ("w2_EDF", w2_EDF)):
        if not match_weight_dtype:
            if not w.dtype.is_floating_point:
                raise TypeError(f"mega_moe: {name} must be a float tensor, got {w.dtype}")
        elif w.dtype != x_TD.dtype:
            raise TypeError(f"mega_moe: {name} has dtype {w.dtype} but x_TD has {x_TD.dtype}; they must match")
    for name, t in (
        ("topk_ids_TK", topk_ids_TK),
        ("topk_weights_TK", topk_weights_TK),
        ("w1_EFD", w1_EFD),
        ("w3_EFD", w3_EFD),
        ("w2_EDF", w2_EDF),
    ):
        if t.device != x_TD.device:
            raise ValueError(f"mega_moe: {name} is on {t.device} but x_TD is on {x_TD.device}")
    _check_device(x_TD)


@torch.library.custom_op("mega_moe::forward", mutates_args=())
def _forward_op(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w1_EFD: torch.Tensor,
    w3_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    write_empty_rows: bool,
) -> _Tensors4:
    """Returns (y_TD, h_N2F, sorted_slot_N int32, offsets_E1 int32); topk_weights_TK is fp32. The
    tiles are ``get_configs``' defaults (a custom op's arguments are tensors and scalars only)."""
    _check_device(x_TD)
    return moe_forward(x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, write_empty_rows=write_empty_rows)


@_forward_op.register_fake
def _forward_fake(x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, write_empty_rows):
    T, D = x_TD.shape
    N = T * topk_ids_TK.shape[1]
    E, F, _ = w1_EFD.shape
    return (
        x_TD.new_empty((T, D)),
        x_TD.new_empty((N, 2 * F)),
        x_TD.new_empty((N,), dtype=torch.int32),
        x_TD.new_empty((E + 1,), dtype=torch.int32),
    )


@torch.library.custom_op("mega_moe::backward", mutates_args=())
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
    write_empty_rows: bool,
) -> _Tensors5:
    """Returns (dx_TD, dw1_EFD, dw3_EFD, dw2_EDF, dtopk_weights_TK fp32), with ``get_configs``' tiles."""
    _check_device(x_TD)
    return moe_backward(dy_TD, x_TD, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, h_N2F, sorted_slot_N, offsets_E1,
                        write_empty_rows=write_empty_rows)


@_backward_op.register_fake
def _backward_fake(dy_TD, x_TD, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, h_N2F, sorted_slot_N, offsets_E1,
                   write_empty_rows):
    return (
        torch.empty_like(x_TD),
        torch.empty_like(w1_EFD),
        torch.empty_like(w3_EFD),
        torch.empty_like(w2_EDF),
        torch.empty_like(topk_weights_TK),
    )


def _setup_context(ctx, inputs, output):
    x_TD, _, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, write_empty_rows = inputs
    _, h_N2F, sorted_slot_N, offsets_E1 = output
    ctx.save_for_backward(x_TD, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, h_N2F, sorted_slot_N, offsets_E1)
    ctx.write_empty_rows = write_empty_rows


def _autograd_backward(ctx, dy_TD, _dh, _dslot, _doffsets):
    # Only y carries a gradient: H and the routing metadata are returned for the backward alone.
    saved = ctx.saved_tensors
    x_TD = saved[0]
    dx, dw1, dw3, dw2, ds = torch.ops.mega_moe.backward(dy_TD.to(x_TD.dtype).contiguous(), *saved,
                                                        ctx.write_empty_rows)
    return dx, None, ds, dw1, dw3, dw2, None


_forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


@register_moe_backend("mega", routed_rows_only=True)
def mega_moe(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w1_EFD: torch.Tensor,
    w3_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    write_empty_rows: bool = True,
) -> torch.Tensor:
    """Routed-expert SwiGLU MLP with gather, grouped GEMMs and combine fused into Triton kernels.

    Args:
        x_TD: (T, D) bfloat16 (GPU training), float16 or float32 tokens.
        topk_ids_TK: (T, K) int32/int64 expert ids in [0, E), or -1 for an empty slot that
            contributes nothing (not range-checked: that would sync).
        topk_weights_TK: (T, K) float routing weights (any float dtype; computed in fp32).
        w1_EFD, w3_EFD: (E, F, D) gate and up projections, dtype of x.
        w2_EDF: (E, D, F) down projection, dtype of x.
        write_empty_rows: False leaves the rows of y and of x's gradient undefined (not zero) for
            tokens with no routed slot; only the rows of routed tokens of x and of y's gradient
            are read either way.

    Returns:
        y_TD: (T, D) in the dtype of x. Differentiable w.r.t. x, the three weights and
        topk_weights_TK. Deterministic (no float atomics).

    The tiles are :func:`~kernels.moe.mega.configs.get_configs`' defaults for the shape; to run
    other ones (benchmarks), call ``forward.moe_forward`` and ``backward.moe_backward`` with
    ``configs``.
    """
    _check_inputs(x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF)
    y_TD, _, _, _ = torch.ops.mega_moe.forward(
        x_TD.contiguous(),
        topk_ids_TK.contiguous(),
        topk_weights_TK.to(torch.float32).contiguous(),
        w1_EFD.contiguous(),
        w3_EFD.contiguous(),
        w2_EDF.contiguous(),
        write_empty_rows,
    )
    return y_TD
