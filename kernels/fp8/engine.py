"""Which engine runs the block-scaled FP8 GEMMs: the warp-specialized Gluon kernels
(``kernels/fp8/hopper_*.py``, Hopper only) or the plain Triton ones (``kernels/fp8/grouped_gemm.py``,
any GPU that has FP8 and the CPU interpreter).

``auto`` takes Gluon where it can run: an sm_90 GPU, not under ``TRITON_INTERPRET=1`` (Gluon
kernels have no interpreter). Within the Gluon engine a GEMM whose sizes its kernels do not take
runs the Triton kernel (each kernel's ``*_supported`` says which).
"""

from __future__ import annotations

import torch

from kernels.triton_utils import interpreting

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
