"""MoE expert-computation backends, behind one registry.

Every backend computes the routed-expert part of a MoE layer for the tokens on this rank:

    y_TD = backend(x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, args)

    y[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])),  e = topk_ids[t, k]

Shapes: T tokens, K experts per token, E experts, D model dim, F expert hidden dim.
``topk_ids_TK`` is int64 (or int32) in [0, E), or -1 for an empty slot that contributes nothing
(expert parallelism pads its static-capacity receive buffers this way); ``topk_weights_TK`` is any
float dtype (the router produces float32); the output has the dtype of ``x_TD``. Gradients flow to
x, the three expert weights and the routing weights (hence to the router). Weight layout is
TorchTitan's.

``args`` (:class:`BackendArgs`, frozen) is everything a backend takes beyond the six tensors; a
backend declares at registration which of its fields it reads, and :meth:`MoEBackend.check` refuses
the others before anything runs. :func:`get_moe_backend` looks a backend up by the name written in
``[moe] backend`` (at the precision of ``[precision] moe``: :func:`resolve_moe_backend`).

What runs where, for the two fast backends:

- ``mega`` (bf16 on Hopper): its fused Triton forward (gathered gate/up GEMM + SwiGLU, down GEMM
  with the routing-weight epilogue); its backward runs the cuBLAS grouped GEMMs
  (``torch._grouped_mm``) with the fused SwiGLU backward, where those kernels exist (bf16 on CUDA).
  The fused Triton backward kernels serve the other dtypes (fp32, fp16) and the CPU tests
  (``kernels/moe/mega/configs.py``, ``grouped_mm_backward``).
- ``mega_fp8``: every GEMM in block-scaled e4m3, forward and backward, on the Gluon kernels where
  they run (sm_90) and on Triton elsewhere (``kernels/fp8/engine.py``).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from kernels.moe.mega_fp8 import MegaFP8Options
    from kernels.moe.mega_fp8.weights import QuantizedExpertWeights


@dataclasses.dataclass(frozen=True)
class BackendArgs:
    """What a backend takes beyond its six tensors, fixed before the first call.

    write_empty_rows: False leaves the rows of y and of x's gradient undefined (not zero) for tokens
        with no routed slot: expert parallelism's receive side, half of whose rows are empty, then
        neither fills nor zeroes them. Only for backends registered ``routed_rows_only``, which read
        only the rows of routed tokens of x and of y's gradient.
    fp8_options: the ``mega_fp8`` options (scale rounding, GEMM engine); None: its defaults.
    quantized: ``mega_fp8``: the weights' e4m3 copies, made once per optimizer step by their owner
        (the compute copies, ``components/precision``); None: the op quantizes per call.
    """

    write_empty_rows: bool = True
    fp8_options: MegaFP8Options | None = None
    quantized: QuantizedExpertWeights | None = None


# The BackendArgs fields a backend may be given, by what it declares at registration.
_FIELD_KEYWORDS = {"write_empty_rows": "write_empty_rows", "fp8_options": "options", "quantized": "quantized"}


@dataclasses.dataclass(frozen=True)
class MoEBackend:
    """A registered backend: ``fn`` takes the six tensors and, as keywords, the :class:`BackendArgs`
    fields it declared (``write_empty_rows`` when ``routed_rows_only``)."""

    name: str
    fn: Callable[..., torch.Tensor]
    routed_rows_only: bool
    takes: tuple[str, ...]

    def check(self, args: BackendArgs) -> None:
        """Raise if ``args`` sets a field this backend does not read."""
        for f in dataclasses.fields(args):
            if getattr(args, f.name) != f.default and f.name not in self.takes:
                raise ValueError(f"MoE backend {self.name!r} does not take BackendArgs.{f.name} "
                                 f"(it takes: {', '.join(sorted(self.takes)) or 'nothing beyond its six tensors'})")

    def __call__(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                 w1_EFD: torch.Tensor, w3_EFD: torch.Tensor, w2_EDF: torch.Tensor,
                 args: BackendArgs = BackendArgs()) -> torch.Tensor:
        kwargs = {_FIELD_KEYWORDS[name]: getattr(args, name) for name in self.takes}
        return self.fn(x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, **kwargs)


_BACKENDS: dict[str, MoEBackend] = {}

# Backends that live in their own module and register on import; imported lazily so that a
# backend's optional dependency (triton, torchtitan) is only needed when that backend is chosen.
_LAZY_MODULES: dict[str, str] = {
    "torch": "kernels.moe.reference",
    "grouped_mm": "kernels.moe.grouped_mm",
    "grouped_mm_fp8": "kernels.moe.grouped_mm_fp8",  # [moe] backend = "grouped_mm" with [precision] moe = "fp8_rowwise"
    "mega": "kernels.moe.mega",
    "mega_fp8": "kernels.moe.mega_fp8",  # [moe] backend = "mega" with [precision] moe = "fp8_blockwise"
    "torchtitan": "kernels.moe.torchtitan",  # upstream TorchTitan's own code: pip install ".[baseline]"
}


def register_moe_backend(name: str, routed_rows_only: bool = False, takes: tuple[str, ...] = ()
                         ) -> Callable[[Callable], Callable]:
    """Register ``fn`` under ``name``. ``routed_rows_only``: it reads only the rows of routed tokens
    and takes ``write_empty_rows`` (:class:`BackendArgs`); ``takes``: the other BackendArgs fields it
    reads. Returns ``fn`` unchanged, so the op stays a plain function for direct callers."""
    unknown = set(takes) - set(_FIELD_KEYWORDS)
    if unknown:
        raise ValueError(f"MoE backend {name!r}: unknown BackendArgs fields {sorted(unknown)}")

    def wrap(fn: Callable) -> Callable:
        if name in _BACKENDS and _BACKENDS[name].fn is not fn:
            raise ValueError(f"MoE backend {name!r} is registered twice")
        fields = tuple(sorted(set(takes) | ({"write_empty_rows"} if routed_rows_only else set())))
        _BACKENDS[name] = MoEBackend(name, fn, routed_rows_only, fields)
        return fn

    return wrap


# ``[precision] moe``: the registered backend that computes each (``[moe] backend``, precision) pair.
# Block-scaled FP8 (1 x 128 activation tiles, 128 x 128 weight blocks) is the mega kernels' method;
# rowwise FP8 through ``torch._scaled_grouped_mm`` is TorchTitan's method for its grouped GEMMs.
QUANTIZED_MOE_BACKENDS: dict[tuple[str, str], str] = {
    ("mega", "fp8_blockwise"): "mega_fp8",
    ("grouped_mm", "fp8_rowwise"): "grouped_mm_fp8",
}


def resolve_moe_backend(backend: str, quantize: str = "none") -> str:
    """Name of the registered backend for ``[moe] backend`` at precision ``[precision] moe``."""
    if quantize == "none":
        return backend
    if (backend, quantize) not in QUANTIZED_MOE_BACKENDS:
        pairs = ", ".join(f"backend = {b!r} with moe = {q!r}" for b, q in QUANTIZED_MOE_BACKENDS)
        raise ValueError(f"[precision] moe = {quantize!r} is not available for [moe] backend = {backend!r}; "
                         f"supported: {pairs}")
    return QUANTIZED_MOE_BACKENDS[backend, quantize]


def available_moe_backends() -> list[str]:
    return sorted(set(_BACKENDS) | set(_LAZY_MODULES))


def get_moe_backend(name: str) -> MoEBackend:
    if name not in _BACKENDS and name in _LAZY_MODULES:
        importlib.import_module(_LAZY_MODULES[name])
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown MoE backend {name!r}; registered backends: {', '.join(available_moe_backends())}"
        )
    return _BACKENDS[name]
