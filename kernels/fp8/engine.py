"""Which engine runs the block-scaled FP8 GEMMs, and the one place that picks it per call: the
warp-specialized Gluon kernels (``kernels/fp8/hopper_*.py``, Hopper only) or the plain Triton ones
(``kernels/fp8/grouped_gemm.py``, any GPU that has FP8 and the CPU interpreter).

``auto`` takes Gluon where it can run: an sm_90 GPU, not under ``TRITON_INTERPRET=1`` (Gluon
kernels have no interpreter). :func:`resolve_engine` turns a requested engine into ``"gluon"`` or
``"triton"`` once per op call; the front functions below take that resolved name and run the Gluon
kernel where it takes the sizes (each kernel's ``*_supported``), else the Triton one:

- :func:`gate_up_swiglu`        gate/up GEMM + SwiGLU + A's 1 x 128 quantization, from x's token rows
- :func:`gathered_grouped_gemm` an M-grouped GEMM whose A rows are token rows (dA' = dy @ w2), on
                                x quantized by :func:`quantize_routed_rows`
- :func:`grouped_gemm`          an M-grouped GEMM over rows already in expert order (down, dX)
- :func:`wgrad`                 the K-grouped weight-gradient GEMM

The Gluon kernels load A by TMA, so they read its rows in expert order: token rows are quantized into
that order first (:func:`expert_order_rows`), while the Triton kernels gather token rows inside their
A load. Both engines compute the same sums in the same order.
Gluon modules are imported only where they run, so that every machine imports this one.
"""

from __future__ import annotations

import torch

from kernels.common.routing import gather_sorted_rows
from kernels.common.triton_utils import interpreting
from kernels.fp8.blockwise import quantize_1x128, quantize_1x128_sorted
from kernels.fp8.grouped_gemm import fp8_gate_up_swiglu, fp8_grouped_gemm, fp8_wgrad

ENGINES = ("auto", "gluon", "triton")


def gluon_unavailable(device: torch.device | str) -> str | None:
    """Why the Gluon engine cannot run on ``device``, or None when it can."""
    device = torch.device(device)
    if interpreting():
        return "the Triton interpreter runs (TRITON_INTERPRET=1) and Gluon kernels have none"
    if device.type != "cuda":
        return f"Gluon kernels need an sm_90 (Hopper) GPU and this runs on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"Gluon kernels need an sm_90 (Hopper) GPU and this GPU is sm_{major}{minor}"
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        return "this Triton has no Gluon (triton.experimental.gluon, Triton >= 3.6)"
    return None


def resolve_engine(requested: str, device: torch.device | str) -> str:
    """``"gluon"`` or ``"triton"`` for ``requested`` in :data:`ENGINES`; asking for Gluon where it
    cannot run is an error that says why."""
    if requested not in ENGINES:
        raise ValueError(f"FP8 GEMM engine must be one of {ENGINES}, got {requested!r}")
    reason = gluon_unavailable(device) if requested != "triton" else None
    if requested == "gluon" and reason:
        raise RuntimeError(f"FP8 GEMM engine \"gluon\" cannot run: {reason}. Use \"auto\" (Gluon where it runs, "
                           "else Triton) or \"triton\"")
    return "triton" if requested == "triton" or reason else "gluon"


def expert_order_rows(x_TD: torch.Tensor, valid_TK: torch.Tensor, sorted_slot_N: torch.Tensor,
                      offsets_E1: torch.Tensor, pow2_scales: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x's 1 x 128 quantization with its rows in expert order, the A operand of the Gluon GEMMs:
    (N, D) e4m3 and (N, ceil(D/128)) fp32, row r is token row ``sorted_slot_N[r] // K`` for
    r < offsets_E1[E], the later rows undefined. With one slot per row (expert parallelism's receive
    buffer) the quantizer writes the rows there directly (``quantize_1x128_sorted``: 3 bytes an
    element moved); with top-k > 1 x is quantized once (tokens with no slot in ``valid_TK`` (T, K)
    skipped) and its e4m3 rows gathered (each token row would otherwise be read k times)."""
    K = valid_TK.shape[1]
    if K == 1:
        return quantize_1x128_sorted(x_TD, sorted_slot_N, offsets_E1, 1, pow2_scales)
    x_q, x_s = quantize_1x128(x_TD, pow2_scales, valid_TK)
    return (gather_sorted_rows(x_q.view(torch.uint8), sorted_slot_N, offsets_E1, K).view(x_q.dtype),
            gather_sorted_rows(x_s, sorted_slot_N, offsets_E1, K))


def gate_up_swiglu(x_TD: torch.Tensor, valid_TK: torch.Tensor, w1_q: torch.Tensor, w1_s: torch.Tensor,
                   w3_q: torch.Tensor, w3_s: torch.Tensor, sorted_slot_N: torch.Tensor, offsets_E1: torch.Tensor,
                   *, engine: str, pow2_scales: bool, tiles: torch.Tensor, block_m: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gate/up GEMM with its SwiGLU + A-quantization epilogue on ``engine``, from x's token rows
    (T, D) bf16, quantized 1 x 128 here (rows of tokens with no valid slot in ``valid_TK`` (T, K)
    are never read). w1_q, w3_q (E, F, D) e4m3 with 128 x 128 block scales; ``tiles``: the tile
    table at ``block_m`` rows (the Gluon kernel's 128 wherever it runs).

    Returns (H_N2F bf16 [gate | up], A_q (N, F) e4m3, A_s (N, ceil(F/128)) fp32), expert-sorted rows.
    Gluon (``hopper_gate_up.py``) where D and F fit its tiles, else the Triton kernel
    (``fp8_gate_up_swiglu``), which gathers x's rows itself."""
    K = valid_TK.shape[1]
    D, F = x_TD.shape[1], w1_q.shape[1]
    if engine == "gluon":
        from kernels.fp8.hopper_gate_up import fp8_gate_up_swiglu_ws, gate_up_supported  # Gluon: where it runs

        if gate_up_supported(D, F, x_TD.dtype):
            a_in, s_in = expert_order_rows(x_TD, valid_TK, sorted_slot_N, offsets_E1, pow2_scales)
            h_N2F, (a_q, a_s) = fp8_gate_up_swiglu_ws(a_in, s_in, w1_q, w1_s, w3_q, w3_s, offsets_E1, x_TD.dtype,
                                                      tiles, pow2_scales)
            return h_N2F, a_q, a_s
    x_q, x_s = quantize_1x128(x_TD, pow2_scales, valid_TK)
    h_N2F, _, (a_q, a_s) = fp8_gate_up_swiglu(
        x_q, x_s, w1_q, w1_s, w3_q, w3_s, sorted_slot_N, offsets_E1, K, out_dtype=x_TD.dtype,
        quantize_a=True, store_a=False, pow2_scales=pow2_scales, tiles=tiles, block_m=block_m,
    )  # fmt: skip
    return h_N2F, a_q, a_s


def grouped_gemm(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor,
                 offsets_E1: torch.Tensor, out_dtype: torch.dtype, *, engine: str, tiles: torch.Tensor | None = None,
                 block_m: int | None = None, block_n: int | None = None, out_slot_N: torch.Tensor | None = None,
                 slot_weights_N: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`~kernels.fp8.grouped_gemm.fp8_grouped_gemm` over rows of A (Nr, K) e4m3 already in
    expert order, on ``engine``: the Gluon kernel (``hopper_grouped.py``, its own 128-row tile table)
    where it takes K, else the Triton kernel at ``block_m`` x ``block_n`` (``tiles``: its tile table
    for ``block_m``, or None to build it). Returns (Nr, N) ``out_dtype``, or scattered to
    ``out_slot_N`` and scaled by ``slot_weights_N`` as fp8_grouped_gemm does."""
    if engine == "gluon":
        from kernels.fp8.hopper_grouped import fp8_grouped_gemm_ws, grouped_supported  # Gluon: where it runs

        if grouped_supported(a_q.shape[1]):
            return fp8_grouped_gemm_ws(a_q, a_s, b_q, b_s, offsets_E1, out_dtype, out_slot_N=out_slot_N,
                                       slot_weights_N=slot_weights_N)
    return fp8_grouped_gemm(a_q, a_s, b_q, b_s, offsets_E1, out_dtype=out_dtype, tiles=tiles, block_m=block_m,
                            block_n=block_n, out_slot_N=out_slot_N, slot_weights_N=slot_weights_N)


def quantize_routed_rows(x_TD: torch.Tensor, valid_TK: torch.Tensor, sorted_slot_N: torch.Tensor,
                         offsets_E1: torch.Tensor, pow2_scales: bool, *, engine: str
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x's (T, D) 1 x 128 quantization in the layout :func:`gathered_grouped_gemm` reads on ``engine``:
    on Gluon the routed rows in expert order (:func:`expert_order_rows`, (N, D)), on Triton the token
    rows ((T, D), its kernel gathers them). Rows of tokens with no valid slot in ``valid_TK`` (T, K)
    are never read."""
    if engine == "gluon":
        return expert_order_rows(x_TD, valid_TK, sorted_slot_N, offsets_E1, pow2_scales)
    return quantize_1x128(x_TD, pow2_scales, valid_TK)


def gathered_grouped_gemm(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor,
                          sorted_slot_N: torch.Tensor, offsets_E1: torch.Tensor, top_k: int, out_dtype: torch.dtype,
                          *, engine: str, block_m: int, block_n: int) -> torch.Tensor:
    """out[r] = x[sorted_slot_N[r] // top_k] @ b[e(r)]^T for the expert-sorted rows r: (N, N_b)
    ``out_dtype``, rows from offsets_E1[E] on not written. (a_q, a_s) is x quantized by
    :func:`quantize_routed_rows` for ``engine``; b (E, N_b, D) e4m3 with 128 x 128 block scales.
    On Gluon the rows are already in expert order and :func:`grouped_gemm` runs; the Triton kernel
    gathers the token rows itself."""
    if engine == "gluon":
        return grouped_gemm(a_q, a_s, b_q, b_s, offsets_E1, out_dtype, engine=engine, block_m=block_m,
                            block_n=block_n)
    return fp8_grouped_gemm(a_q, a_s, b_q, b_s, offsets_E1, sorted_slot_N, top_k, out_dtype=out_dtype,
                            block_m=block_m, block_n=block_n)


def wgrad(at_q: torch.Tensor, at_s: torch.Tensor, bt_q: torch.Tensor, bt_s: torch.Tensor,
          offsets_E1: torch.Tensor, out_dtype: torch.dtype, *, engine: str, block_m: int | None = None,
          block_n: int | None = None) -> torch.Tensor:
    """:func:`~kernels.fp8.grouped_gemm.fp8_wgrad` (E, M, Ncol) ``out_dtype`` on ``engine``: the
    Gluon kernel (``hopper_wgrad.py``) where it takes the sizes, else the Triton kernel at
    ``block_m`` x ``block_n`` (None: its defaults)."""
    if engine == "gluon":
        from kernels.fp8.hopper_wgrad import fp8_wgrad_ws, wgrad_supported  # Gluon: where it runs

        if wgrad_supported(at_q.shape[0], bt_q.shape[0], out_dtype):
            return fp8_wgrad_ws(at_q, at_s, bt_q, bt_s, offsets_E1, out_dtype)
    return fp8_wgrad(at_q, at_s, bt_q, bt_s, offsets_E1, out_dtype, block_m, block_n)
