"""MoE expert-computation backends, behind one registry.

Every backend computes the routed-expert part of a MoE layer for the tokens on this rank:

    y_TD = backend(x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF)

    y[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])),  e = topk_ids[t, k]

Shapes: T tokens, K experts per token, E experts, D model dim, F expert hidden dim.
``topk_ids_TK`` is int64 (or int32) in [0, E), or -1 for an empty slot that contributes nothing
(expert parallelism pads its static-capacity receive buffers this way); ``topk_weights_TK`` is any float dtype (the router
produces float32); the output has the dtype of ``x_TD``. Gradients flow to x, the three expert
weights and the routing weights (hence to the router). Weight layout is TorchTitan's.

Backends register themselves with :func:`register_moe_backend`; :func:`get_moe_backend` looks one
up by the name written in ``[moe] backend``. A backend registered ``routed_rows_only`` reads only the
rows of x (and of y's gradient) whose token has a routed slot, so the others may hold anything, and
takes ``write_empty_rows=False`` to leave those tokens' rows of y and of x's gradient undefined:
expert parallelism's receive side, half of whose rows are empty, then neither fills nor zeroes them
(:func:`routed_rows_only`).
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable, Protocol

import torch


class MoEBackend(Protocol):
    def __call__(
        self,
        x_TD: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        topk_weights_TK: torch.Tensor,
        w1_EFD: torch.Tensor,
        w3_EFD: torch.Tensor,
        w2_EDF: torch.Tensor,
    ) -> torch.Tensor: ...


_BACKENDS: dict[str, MoEBackend] = {}
_ROUTED_ROWS_ONLY: set[MoEBackend] = set()

# Backends that live in their own module and register on import; imported lazily so that a
# backend's optional dependency (triton, torchtitan) is only needed when that backend is chosen.
_LAZY_MODULES: dict[str, str] = {
    "torch": "kernels.moe.reference",
    "grouped_mm": "kernels.moe.grouped_mm",
    "grouped_mm_fp8": "kernels.moe.grouped_mm_fp8",  # [moe] backend = "grouped_mm" with [quantize] moe = "fp8_rowwise"
    "mega": "kernels.moe.mega",
    "mega_fp8": "kernels.moe.mega_fp8",  # [moe] backend = "mega" with [quantize] moe = "fp8_blockwise"
    "torchtitan": "kernels.moe.torchtitan",  # upstream TorchTitan's own code: pip install ".[baseline]"
}


def register_moe_backend(name: str, routed_rows_only: bool = False) -> Callable[[MoEBackend], MoEBackend]:
    def wrap(fn: MoEBackend) -> MoEBackend:
        if name in _BACKENDS and _BACKENDS[name] is not fn:
            raise ValueError(f"MoE backend {name!r} is registered twice")
        _BACKENDS[name] = fn
        if routed_rows_only:
            _ROUTED_ROWS_ONLY.add(fn)
        return fn

    return wrap


def routed_rows_only(backend: MoEBackend) -> bool:
    """Whether ``backend`` (a registered function, or a ``functools.partial`` of one) was registered
    ``routed_rows_only`` (the module docstring)."""
    fn = backend
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn in _ROUTED_ROWS_ONLY


# ``[quantize] moe``: the registered backend that computes each (``[moe] backend``, precision) pair.
# Block-scaled FP8 (1 x 128 activation tiles, 128 x 128 weight blocks) is the mega kernels' method;
# rowwise FP8 through ``torch._scaled_grouped_mm`` is TorchTitan's method for its grouped GEMMs.
QUANTIZED_MOE_BACKENDS: dict[tuple[str, str], str] = {
    ("mega", "fp8_blockwise"): "mega_fp8",
    ("grouped_mm", "fp8_rowwise"): "grouped_mm_fp8",
}


def resolve_moe_backend(backend: str, quantize: str = "none") -> str:
    """Name of the registered backend for ``[moe] backend`` at precision ``[quantize] moe``."""
    if quantize == "none":
        return backend
    if (backend, quantize) not in QUANTIZED_MOE_BACKENDS:
        pairs = ", ".join(f"backend = {b!r} with moe = {q!r}" for b, q in QUANTIZED_MOE_BACKENDS)
        raise ValueError(f"[quantize] moe = {quantize!r} is not available for [moe] backend = {backend!r}; "
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
