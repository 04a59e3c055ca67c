"""Forward of the FP8 mega-MoE op: the bf16 op's data path (``kernels/moe/mega/forward.py``) with
every GEMM operand in block-scaled e4m3, composed from the building blocks of ``kernels/fp8``.

    x_q, x_s    = quantize_1x128(x)                                 1 x 128 tiles along D, once
    w*_q, w*_s  = quantize_weight(w*)                                 128 x 128 blocks, every call
    H_N2F[r]    = [x[tok(r)] @ w1[e]^T | x[tok(r)] @ w3[e]^T]          fp8_gate_up_swiglu: x rows
    A_q, A_s    = quantize_1x128(silu(H gate) * H up)                gathered by token; A is only
                                                                       written quantized (epilogue)
    Ybuf[slot]  = s[slot] * A[r] @ w2[e]^T                            fp8_grouped_gemm, combine
                                                                       epilogue (slot = sorted_slot[r])
    y[t]        = sum_k Ybuf[t*K + k]                                  sum_over_k (fp32, fixed order)

Each GEMM runs on the engine the caller resolved (``kernels/fp8/engine.py``, which picks the
warp-specialized Gluon kernel where it runs and takes the sizes, else the Triton one).

The weights are quantized on every call, here and again in the backward (which also makes the
transposed copies dgrad reads), unless the caller passes ``quantized``: the copies made once per
optimizer step by ``components/precision/copies.py`` (``weights.py``). Per call that is 2 reads of the
bf16 weights and ~4 bytes written/read per weight element, about 3.6 GB (counted) at the 30B
shape (E 128, F 768, D 2048), paid three times per step under full activation checkpointing
(forward, recomputation, backward).
"""

from __future__ import annotations

import torch

from kernels.common.routing import sort_by_expert, tile_table
from kernels.common.triton_utils import interpreting
from kernels.fp8 import engine as fp8_engine
from kernels.fp8.blockwise import quantize_weight
from kernels.moe.combine import combine_slots
from kernels.moe.mega_fp8.weights import QuantizedExpertWeights


def gemm_blocks() -> tuple[int, int]:
    """(block_m, block_n) of the M-tiled FP8 GEMMs (gate/up, down, dX); one tile table serves all.
    On the GPU 64 x 128, the building blocks' defaults (faster than 128 x 128 at the 30B shape).
    Under the interpreter, whose cost is per program, 16-row tiles (the tests' experts end in
    partial tiles) and 128 columns."""
    return (16, 128) if interpreting() else (64, 128)


def gate_up_block_m() -> int:
    """block_m of the gate/up GEMM (two accumulators): 128 on the GPU, faster than 64 rows at the
    30B shape once the scales are prefetched and promoted with one FMA; its own tile table then.
    16 under the interpreter."""
    return 16 if interpreting() else 128


def moe_fp8_forward(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w1_EFD: torch.Tensor,
    w3_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    pow2_scales: bool = False,
    quantized: QuantizedExpertWeights | None = None,
    engine: str = "triton",
    write_empty_rows: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the FP8 forward. x and the weights bf16, contiguous; routing weights fp32. With
    ``quantized`` (the weights' e4m3 copies) the weights are not read and may have any dtype.
    ``engine`` ("gluon" or "triton", resolved by the caller) runs the gate/up and down GEMMs
    (``kernels/fp8/engine.py``). Only rows of x with a routed slot are read; ``write_empty_rows``
    False leaves y's rows of tokens with none undefined.

    Returns:
        y_TD: (T, D) bf16.
        h_N2F: (N, 2F) bf16 [gate | up] pre-activations, expert-sorted rows (saved for backward).
        sorted_slot_N: (N,) int32, offsets_E1: (E+1,) int32 (see ``routing.sort_by_expert``).
    """
    T, K = topk_ids_TK.shape
    E = w1_EFD.shape[0]
    sorted_slot_N, offsets_E1 = sort_by_expert(topk_ids_TK, E)
    bm_gu = gate_up_block_m()
    tiles_gu = tile_table(offsets_E1, T * K, bm_gu)
    if quantized is None:
        w1_q, w1_s = quantize_weight(w1_EFD, pow2_scales)
        w3_q, w3_s = quantize_weight(w3_EFD, pow2_scales)
    else:
        w1_q, w1_s, w3_q, w3_s = quantized.w1_q, quantized.w1_s, quantized.w3_q, quantized.w3_s
    h_N2F, a_q, a_s = fp8_engine.gate_up_swiglu(x_TD, topk_ids_TK >= 0, w1_q, w1_s, w3_q, w3_s, sorted_slot_N,
                                                offsets_E1, engine=engine, pow2_scales=pow2_scales, tiles=tiles_gu,
                                                block_m=bm_gu)
    del w1_q, w1_s, w3_q, w3_s
    w2_q, w2_s = quantize_weight(w2_EDF, pow2_scales) if quantized is None else (quantized.w2_q, quantized.w2_s)
    # The down GEMM's own tile table is built only where its Triton kernel runs at other rows per tile.
    bm, bn = gemm_blocks()
    ybuf_ND = fp8_engine.grouped_gemm(a_q, a_s, w2_q, w2_s, offsets_E1, x_TD.dtype, engine=engine,
                                      tiles=tiles_gu if bm_gu == bm else None, block_m=bm, block_n=bn,
                                      out_slot_N=sorted_slot_N, slot_weights_N=topk_weights_TK.view(-1))
    y_TD = combine_slots(ybuf_ND, T, K, sorted_slot_N, offsets_E1, write_empty_rows=write_empty_rows)
    return y_TD, h_N2F, sorted_slot_N, offsets_E1

