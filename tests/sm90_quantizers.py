"""Compiles the FP8 quantizers' GPU launches for sm_90 without a GPU: ``python -m tests.sm90_quantizers DIR``
writes ``DIR/<name>.cubin`` for each (``tests/test_fp8.py`` reads their SASS). Run without
``TRITON_INTERPRET``: under it ``triton.jit`` gives interpreted functions, which do not compile."""

from __future__ import annotations

import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type

from kernels.fp8 import blockwise as Q
from kernels.fp8 import rowwise as R


def builds() -> dict:
    """name -> (kernel, example args, constexprs, warps): each quantizer at its GPU launch parameters,
    SOFT off (the hardware e4m3 cast, which the interpreter never runs)."""
    x, u8 = torch.empty(64, 256, dtype=torch.bfloat16), torch.empty(64, 256, dtype=torch.uint8)
    f32, i32, i8 = torch.empty(8), torch.empty(8, dtype=torch.int32), torch.empty(8, dtype=torch.int8)
    cols = dict(x_ptr=x, qt_ptr=u8, st_ptr=f32, sorted_slot_ptr=i32, offsets_ptr=i32, table_ptr=i32, num_tiles=3,
                LDQ=384, K=256, K_TOP=1)
    rows = dict(x_ptr=x, q_ptr=u8, s_ptr=f32, R=64, C=256, stride_r=256)
    out = {}
    for valid in (False, True):
        out[f"1x128_valid{valid}"] = (Q._quantize_1x128_kernel, dict(x_ptr=x, q_ptr=u8, s_ptr=f32, valid_ptr=i8, M=64,
                                      K=256), dict(SLOTS=1, BLOCK_M=16, POW2=True, SOFT=False, HAS_VALID=valid), 8)
    for gather in (False, True):
        out[f"cols_grouped_gather{gather}"] = (Q._cols_grouped_kernel, cols, dict(
            BLOCK_K=32, K_CHUNK=512, GATHER=gather, POW2=True, SOFT=False), 4)
    for br, bc in ((1, 1024), (4, 256)):
        out[f"rowwise_contiguous_{br}x{bc}"] = (R._quantize_contiguous_rows_kernel, rows, dict(
            SOFT=False, BLOCK_R=br, BLOCK_C=bc), 4)
    out["rowwise_strided"] = (R._quantize_rows_kernel, dict(rows, amax_ptr=x, stride_r=1, stride_c=64), dict(
        SOFT=False, BLOCK_R=32, BLOCK_C=128), 4)
    return out


def compile_to(folder: str) -> None:
    for name, (fn, args, consts, warps) in builds().items():
        names = list(fn.arg_names)
        signature = {n: "constexpr" if n in consts else mangle_type(args[n]) for n in names}
        src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        with open(os.path.join(folder, f"{name}.cubin"), "wb") as f:
            f.write(kernel.asm["cubin"])


if __name__ == "__main__":
    compile_to(sys.argv[1])
