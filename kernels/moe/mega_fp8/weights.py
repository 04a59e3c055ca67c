"""The e4m3 copies of one layer's expert weights, in every layout the FP8 mega op reads.

Made by :meth:`QuantizedExpertWeights.quantize` once per optimizer step (``components/precision/copies.py``
keeps them and refreshes them when the parameters change) and handed to ``mega_moe_fp8(...,
quantized=...)``, so that the forward, its recomputation under activation checkpointing and the
backward stop re-quantizing the bf16 weights on every call. Without it the op makes the same
tensors itself, per call: the layouts and values are identical (the tests compare bit for bit).

    w1, w3 (E, F, D) -> w1_q, w3_q (E, F, D) e4m3 + (E, FB, DB) scales    forward gate/up (B operand rows)
    w2 (E, D, F)     -> w2_q (E, D, F) e4m3 + (E, DB, FB) scales          forward down GEMM
                     -> w2t_q (E, F, D): w2_q's bytes transposed           backward dH GEMM
    [w1; w3]         -> w13t_q (E, D, 2 FP) e4m3 + (E, DB, 2 FB) scales   backward dX GEMM

At the Qwen3-30B-A3B expert shape (E 128, F 768, D 2048) that is 2 x 604 MB of e4m3 per layer,
as much as one bf16 copy of the weights.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from kernels.fp8.blockwise import FP8, TILE, quantize_weight_into

# The weights quantized, in the op's argument order.
WEIGHTS = ("w1", "w3", "w2")
# The tensor fields, in the order of tensors() (the custom ops take them as one list).
TENSOR_FIELDS = ("w1_q", "w1_s", "w3_q", "w3_s", "w2_q", "w2_s", "w2t_q", "w2t_s", "w13t_q", "w13t_s")


@dataclasses.dataclass
class QuantizedExpertWeights:
    w1_q: torch.Tensor
    w1_s: torch.Tensor
    w3_q: torch.Tensor
    w3_s: torch.Tensor
    w2_q: torch.Tensor
    w2_s: torch.Tensor
    w2t_q: torch.Tensor
    w2t_s: torch.Tensor
    w13t_q: torch.Tensor
    w13t_s: torch.Tensor
    pow2_scales: bool = False

    @classmethod
    def quantize(cls, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor, w2_EDF: torch.Tensor,
                 pow2_scales: bool = False, out: "QuantizedExpertWeights | None" = None,
                 round_bf16: bool = False) -> "QuantizedExpertWeights":
        """Quantize the three weights (any float dtype; the op's inputs are bf16, so pass bf16 to
        get exactly the per-call quantization).

        One pass per weight writes both of its layouts (``quant.quantize_weight_into``): the
        forward's, and the transposed one of the backward (w2t; w1 and w3 into the two halves of
        w13t). ``out``: write into these tensors (the compute copies' buffers) instead of new ones.
        ``round_bf16``: quantize the weights' values rounded to bf16 (float32 masters give the bytes
        of their bf16 copies, without the casts' passes).
        """
        w1_EFD, w3_EFD, w2_EDF = (w.contiguous() for w in (w1_EFD, w3_EFD, w2_EDF))
        E, F, D = w1_EFD.shape
        if out is None:
            out = cls.empty(E, F, D, w1_EFD.device, pow2_scales)
        else:
            out.check_matches(w1_EFD, w3_EFD, w2_EDF, pow2_scales)
        outputs = out.outputs()
        for name, w in zip(WEIGHTS, (w1_EFD, w3_EFD, w2_EDF)):
            quantize_weight_into(w, **outputs[name], pow2_scales=pow2_scales, round_bf16=round_bf16)
        return out

    def outputs(self) -> dict[str, dict]:
        """Per weight ("w1", "w3", "w2"), where its quantization writes: the output arguments of
        ``quantize_weight_into`` (q, s, qt, st, qt_col0, qt_cols, st_col0). w1 and w3 fill the two
        halves of w13t, each half F rounded up to 128 columns wide."""
        FB = self.w1_s.shape[1]
        FP = FB * TILE
        return {
            "w1": dict(q=self.w1_q, s=self.w1_s, qt=self.w13t_q, st=self.w13t_s, qt_col0=0, qt_cols=FP, st_col0=0),
            "w3": dict(q=self.w3_q, s=self.w3_s, qt=self.w13t_q, st=self.w13t_s, qt_col0=FP, qt_cols=FP, st_col0=FB),
            "w2": dict(q=self.w2_q, s=self.w2_s, qt=self.w2t_q, st=self.w2t_s),
        }

    @classmethod
    def empty(cls, E: int, F: int, D: int, device, pow2_scales: bool = False) -> "QuantizedExpertWeights":
        """Uninitialised tensors of the layouts (w13t's padding columns, when F % 128 != 0, zeroed:
        the quantization writes them too, but a buffer must never hold garbage there)."""
        FB, DB = triton.cdiv(F, TILE), triton.cdiv(D, TILE)
        fp8, f32 = FP8, torch.float32

        def new(shape, dtype):
            return torch.empty(shape, device=device, dtype=dtype)

        return cls(new((E, F, D), fp8), new((E, FB, DB), f32), new((E, F, D), fp8), new((E, FB, DB), f32),
                   new((E, D, F), fp8), new((E, DB, FB), f32), new((E, F, D), fp8), new((E, FB, DB), f32),
                   torch.zeros((E, D, 2 * FB * TILE), device=device, dtype=torch.uint8).view(fp8),
                   new((E, DB, 2 * FB), f32), pow2_scales)

    def tensors(self) -> list[torch.Tensor]:
        """The ten tensors in a fixed order (the custom ops take them as one list)."""
        return [getattr(self, f) for f in TENSOR_FIELDS]

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor], pow2_scales: bool) -> "QuantizedExpertWeights":
        if len(tensors) != len(TENSOR_FIELDS):
            raise ValueError(f"QuantizedExpertWeights takes {len(TENSOR_FIELDS)} tensors, got {len(tensors)}")
        return cls(*tensors, pow2_scales=pow2_scales)

    def check_matches(self, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor, w2_EDF: torch.Tensor,
                      pow2_scales: bool) -> None:
        """Raise if these copies cannot stand for weights of these shapes and this scale rounding."""
        for name, q, w in (("w1", self.w1_q, w1_EFD), ("w3", self.w3_q, w3_EFD), ("w2", self.w2_q, w2_EDF)):
            if q.shape != w.shape:
                raise ValueError(f"mega_fp8: the quantized {name} has shape {tuple(q.shape)} but the weight passed "
                                 f"with it has {tuple(w.shape)}; quantize the weights this call uses")
            if q.device != w.device:
                raise ValueError(f"mega_fp8: the quantized {name} is on {q.device}, the weight on {w.device}")
        if self.pow2_scales != pow2_scales:
            raise ValueError(f"mega_fp8: the weights were quantized with pow2_scales={self.pow2_scales} but the "
                             f"op runs with pow2_scales={pow2_scales}; requantize after changing the option")
