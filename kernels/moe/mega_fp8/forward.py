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

On the Gluon engine (Hopper) gate/up and down run the warp-specialized kernels
(``kernels/fp8/hopper_gate_up.py``, ``hopper_grouped.py``), which load A by TMA: x's e4m3 rows and
scales are put in expert order first (:func:`expert_order_rows`), the same bytes the Triton kernel
gathers itself.

The weights are quantized on every call, here and again in the backward (which also makes the
transposed copies dgrad reads), unless the caller passes ``quantized``: the copies made once per
optimizer step by ``components/compute_weights.py`` (``weights.py``). Per call that is 2 reads of the
bf16 weights and ~4 bytes written/read per weight element, about 3.6 GB (counted) at the 30B
shape (E 128, F 768, D 2048), paid three times per step under full activation checkpointing
(forward, recomputation, backward).
"""

from __future__ import annotations

import torch

from kernels.fp8.grouped_gemm import fp8_gate_up_swiglu, fp8_grouped_gemm
from kernels.fp8.blockwise import quantize_1x128, quantize_1x128_sorted, quantize_weight
from kernels.triton_utils import interpreting
from kernels.moe.combine import combine_slots
from kernels.moe.routing import gather_sorted_rows, sort_by_expert, tile_table
from kernels.moe.mega_fp8.weights import QuantizedExpertWeights


def gemm_blocks() -> tuple[int, int]:
    """(block_m, block_n) of the M-tiled FP8 GEMMs (gate/up, down, dX); one tile table serves all.
    On the GPU 64 x 128, the building blocks' defaults (faster than 128 x 128 at the 30B shape).
    Under the interpreter, whose cost is per program, 16-row tiles (the tests' experts end in
    partial tiles) and 128 columns."""
    return (16, 128) if interpreting() else (64, 128)


def grouped_gemm(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    b_q: torch.Tensor,
    b_s: torch.Tensor,
    offsets_E1: torch.Tensor,
    out_dtype: torch.dtype,
    engine: str,
    tiles: torch.Tensor | None = None,
    out_slot_N: torch.Tensor | None = None,
    slot_weights_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`fp8_grouped_gemm` over rows of A already in expert-sorted order, on ``engine``
    ("gluon" or "triton"): the warp-specialized kernel (``kernels/fp8/hopper_grouped.py``) where it
    takes K, else the Triton kernel at :func:`gemm_blocks` (``tiles``: its tile table, or None to
    build it)."""
    K = a_q.shape[1]
    if engine == "gluon":
        from kernels.fp8.hopper_grouped import fp8_grouped_gemm_ws, grouped_supported  # Gluon: where it runs

        if grouped_supported(K):
            return fp8_grouped_gemm_ws(a_q, a_s, b_q, b_s, offsets_E1, out_dtype, out_slot_N=out_slot_N,
                                       slot_weights_N=slot_weights_N)
    bm, bn = gemm_blocks()
    return fp8_grouped_gemm(a_q, a_s, b_q, b_s, offsets_E1, out_dtype=out_dtype, tiles=tiles, block_m=bm,
                            block_n=bn, out_slot_N=out_slot_N, slot_weights_N=slot_weights_N)


def gate_up_block_m() -> int:
    """block_m of the gate/up GEMM (two accumulators): 128 on the GPU, faster than 64 rows at the
    30B shape once the scales are prefetched and promoted with one FMA; its own tile table then.
    16 under the interpreter."""
    return 16 if interpreting() else 128


def expert_order_rows(x_TD: torch.Tensor, valid_TK: torch.Tensor, sorted_slot_N: torch.Tensor,
                      offsets_E1: torch.Tensor, pow2_scales: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x's 1 x 128 quantization with its rows in expert order, the A operand of the Gluon GEMMs
    (they load it by TMA): row r is token row ``sorted_slot_N[r] // K`` for r < offsets_E1[E], the
    later rows undefined. With one slot per row (expert parallelism's receive buffer) the quantizer
    writes the rows there directly (``quantize_1x128_sorted``: 3 bytes an element moved); with
    top-k > 1 x is quantized once (tokens with no slot in ``valid_TK`` skipped) and its e4m3 rows
    gathered (each token row would otherwise be read k times)."""
    K = valid_TK.shape[1]
    if K == 1:
        return quantize_1x128_sorted(x_TD, sorted_slot_N, offsets_E1, 1, pow2_scales)
    x_q, x_s = quantize_1x128(x_TD, pow2_scales, valid_TK)
    return (gather_sorted_rows(x_q.view(torch.uint8), sorted_slot_N, offsets_E1, K).view(x_q.dtype),
            gather_sorted_rows(x_s, sorted_slot_N, offsets_E1, K))


def gate_up(x_TD, topk_ids_TK, w1_q, w1_s, w3_q, w3_s, sorted_slot_N, offsets_E1, pow2_scales, engine, tiles):
    """(H_N2F, A_q, A_s) of the gate/up GEMM with its SwiGLU + quantization epilogue, on ``engine``,
    from x's 1 x 128 quantization (rows of tokens with no routed slot are never read).
    ``tiles``: the tile table at :func:`gate_up_block_m` rows (128 wherever Gluon runs). The Gluon
    kernel takes x's rows in expert order (:func:`expert_order_rows`); the Triton kernel gathers
    them itself."""
    K = topk_ids_TK.shape[1]
    D, F = x_TD.shape[1], w1_q.shape[1]
    if engine == "gluon":
        from kernels.fp8.hopper_gate_up import fp8_gate_up_swiglu_ws, gate_up_supported  # Gluon: where it runs

        if gate_up_supported(D, F, x_TD.dtype):
            a_in, s_in = expert_order_rows(x_TD, topk_ids_TK >= 0, sorted_slot_N, offsets_E1, pow2_scales)
            h_N2F, (a_q, a_s) = fp8_gate_up_swiglu_ws(a_in, s_in, w1_q, w1_s, w3_q, w3_s, offsets_E1, x_TD.dtype,
                                                      tiles, pow2_scales)
            return h_N2F, a_q, a_s
    x_q, x_s = quantize_1x128(x_TD, pow2_scales, topk_ids_TK >= 0)
    h_N2F, _, (a_q, a_s) = fp8_gate_up_swiglu(
        x_q, x_s, w1_q, w1_s, w3_q, w3_s, sorted_slot_N, offsets_E1, K, out_dtype=x_TD.dtype,
        quantize_a=True, store_a=False, pow2_scales=pow2_scales, tiles=tiles, block_m=gate_up_block_m(),
    )  # fmt: skip
    return h_N2F, a_q, a_s


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
    ``engine`` ("gluon" or "triton", resolved by the caller: ``kernels/fp8/engine.py``) runs the
    gate/up GEMM (:func:`gate_up`) and the down GEMM (:func:`grouped_gemm`). Only rows of x with a
    routed slot are read; ``write_empty_rows`` False leaves y's rows of tokens with none undefined.

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
    h_N2F, a_q, a_s = gate_up(x_TD, topk_ids_TK, w1_q, w1_s, w3_q, w3_s, sorted_slot_N, offsets_E1, pow2_scales,
                              engine, tiles_gu)
    del w1_q, w1_s, w3_q, w3_s
    w2_q, w2_s = quantize_weight(w2_EDF, pow2_scales) if quantized is None else (quantized.w2_q, quantized.w2_s)
    # The down GEMM's own tile table is built only where its Triton kernel runs at other rows per tile.
    ybuf_ND = grouped_gemm(a_q, a_s, w2_q, w2_s, offsets_E1, x_TD.dtype, engine,
                           tiles_gu if bm_gu == gemm_blocks()[0] else None, out_slot_N=sorted_slot_N,
                           slot_weights_N=topk_weights_TK.view(-1))
    y_TD = combine_slots(ybuf_ND, T, K, sorted_slot_N, offsets_E1, write_empty_rows=write_empty_rows)
    return y_TD, h_N2F, sorted_slot_N, offsets_E1

