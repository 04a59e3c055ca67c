"""What the compiler makes of the Triton kernels on Hopper, without a GPU: each kernel's GPU launch is
compiled for sm_90 here (Triton ships ptxas and cuobjdump) and its SASS read back.

    python -m bench.sass_report                        # every kernel below, one line each
    python -m bench.sass_report --only quantizers --json out.json --cubins DIR
    python -m bench.sass_report --only gluon           # the warp-specialized Gluon FP8 GEMMs

Per kernel: registers per thread, spill stack (bytes per thread) and local loads/stores in the SASS,
shared memory, the K loop's pipeline depth (buffers of its async copies), the tensor-core
instruction, whether the e4m3 cast is the hardware's, and the order of the warpgroup MMA issues
(``Q``) and waits (``W<n>``: wait until at most n groups are in flight). Arguments are specialized
as the JIT would for aligned tensors (pointers 16-byte aligned, sizes that are multiples of 16).
Run without ``TRITON_INTERPRET``: under it ``triton.jit`` gives interpreted functions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import tempfile
from typing import Callable

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


@dataclasses.dataclass
class Build:
    fn: Callable
    args: dict  # example arguments: tensors give pointer types, ints give i32
    consts: dict
    num_warps: int
    num_stages: int = 3
    # Gluon kernels: the arguments specialized as multiples of 16 (named, not inferred) and the
    # register cap the launch passes.
    gluon_divisible: tuple[str, ...] | None = None
    maxnreg: int | None = None


def compile_sm90(b: Build):
    """The compiled kernel of ``b`` for sm_90 without a GPU: a Triton kernel specialized as the JIT
    specializes aligned arguments (every tensor and every int that is a multiple of 16 divisible by
    16), a Gluon one as its ``gluon_divisible`` names."""
    names = list(b.fn.arg_names)
    if b.gluon_divisible is not None:
        from triton.experimental.gluon._runtime import GluonASTSource

        source, divisible, options = GluonASTSource, b.gluon_divisible, {"maxnreg": b.maxnreg}
    else:
        source, options = ASTSource, {"num_stages": b.num_stages}
        divisible = [n for n in names if n not in b.consts and (isinstance(b.args[n], torch.Tensor) or (
            isinstance(b.args[n], int) and b.args[n] % 16 == 0))]
    signature = {n: "constexpr" if n in b.consts else mangle_type(b.args[n]) for n in names}
    src = source(fn=b.fn, signature=signature, constexprs={(names.index(n),): v for n, v in b.consts.items()},
                 attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": b.num_warps, **options})


def _cuobjdump(flag: str, cubin: str) -> str:
    return subprocess.run([os.path.join(BIN, "cuobjdump"), flag, cubin], capture_output=True, text=True,
                          check=True).stdout


def sass_stats(kernel, cubin_path: str) -> dict:
    with open(cubin_path, "wb") as f:
        f.write(kernel.asm["cubin"])
    res, sass = _cuobjdump("-res-usage", cubin_path), _cuobjdump("-sass", cubin_path)
    ttgir = kernel.asm["ttgir"]
    mma = sorted(set(re.findall(r"[QH]GMMA\.[0-9x]+\.[A-Z0-9.]+", sass)))
    events = []
    for line in sass.splitlines():
        if "GMMA." in line:
            events.append("Q")
        elif "WARPGROUP.DEPBAR" in line:
            events.append("W" + str(int(re.search(r"gsb0, (0x[0-9a-f]+)", line).group(1), 16)))
    return dict(
        regs=int(re.search(r"REG:(\d+)", res).group(1)),
        stack=int(re.search(r"STACK:(\d+)", res).group(1)),
        spills=len(re.findall(r"\b(?:LDL|STL)\b", sass)),
        shared=kernel.metadata.shared,
        stages=max([int(s) for s in re.findall(r"memdesc<(\d+)x\d+x\d+x", ttgir)] or [1]),
        mma=mma,
        hw_e4m3_cast="F2FP.SATFINITE.E4M3" in sass,
        mma_order=re.sub(r"(Q)(?: Q)+", lambda m: f"Q*{m.group(0).count('Q')}", " ".join(events)),
    )


def _t(dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(16, dtype=dtype)


def quantizers() -> dict[str, Build]:
    """The FP8 quantizers at their GPU launch parameters, SOFT off (the hardware e4m3 cast, which
    the CPU tests' interpreter never runs)."""
    from kernels.fp8 import blockwise as Q
    from kernels.fp8 import rowwise as R

    bf, u8, f32, i32, i8 = (_t(d) for d in (torch.bfloat16, torch.uint8, torch.float32, torch.int32, torch.int8))
    cols = dict(x_ptr=bf, qt_ptr=u8, st_ptr=f32, sorted_slot_ptr=i32, offsets_ptr=i32, table_ptr=i32, num_tiles=3,
                LDQ=384, K=4096, K_TOP=1)
    rows = dict(x_ptr=bf, q_ptr=u8, s_ptr=f32, R=16384, C=4096, stride_r=4096)
    out = {}
    for valid in (False, True):
        out[f"quantize_1x128 valid={valid}"] = Build(Q._quantize_1x128_kernel, dict(
            x_ptr=bf, q_ptr=u8, s_ptr=f32, valid_ptr=i8, slot_ptr=i32, count_ptr=i32, M=16384, K=4096), dict(
            SLOTS=1, BLOCK_M=16, POW2=True, SOFT=False, HAS_VALID=valid, GATHER=False, TOP_K=1), 8)
    out["quantize_1x128_sorted"] = Build(Q._quantize_1x128_kernel, dict(
        x_ptr=bf, q_ptr=u8, s_ptr=f32, valid_ptr=f32, slot_ptr=i32, count_ptr=i32, M=16384, K=4096), dict(
        SLOTS=1, BLOCK_M=16, POW2=False, SOFT=False, HAS_VALID=False, GATHER=True, TOP_K=1), 8)
    for gather in (False, True):
        out[f"quantize_cols_grouped gather={gather}"] = Build(Q._cols_grouped_kernel, cols, dict(
            BLOCK_K=32, K_CHUNK=512, GATHER=gather, POW2=True, SOFT=False, STAGES=1), 4)
    out["quantize_cols_grouped gather=True stages=3"] = Build(Q._cols_grouped_kernel, cols, dict(
        BLOCK_K=32, K_CHUNK=512, GATHER=True, POW2=True, SOFT=False, STAGES=3), 4)
    for br, bc in ((1, 1024), (4, 256)):
        out[f"rowwise contiguous {br}x{bc}"] = Build(R._quantize_contiguous_rows_kernel, rows, dict(
            SOFT=False, BLOCK_R=br, BLOCK_C=bc), 4)
    out["rowwise strided"] = Build(R._quantize_rows_kernel, dict(rows, amax_ptr=bf, stride_r=1, stride_c=16384),
                                   dict(SOFT=False, BLOCK_R=32, BLOCK_C=128), 4)
    return out


def gemms() -> dict[str, Build]:
    """The gate/up GEMMs (bf16 and FP8) at the shipped tiles, Qwen3-235B-A22B's expert shape."""
    from kernels.fp8 import grouped_gemm as G
    from kernels.moe.mega import forward as MF
    from kernels.moe.mega.configs import get_configs
    from kernels.moe.mega_fp8.forward import gate_up_block_m

    bf, u8, f32, i32, e4 = (_t(d) for d in (torch.bfloat16, torch.uint8, torch.float32, torch.int32,
                                            torch.float8_e4m3fn))
    D, F = 4096, 1536
    gu = get_configs(D, F, 128).gate_up
    routing = dict(sorted_slot_ptr=i32, offsets_ptr=i32, table_ptr=i32, num_tiles=3, K_TOP=1, D=D, F=F)
    return {
        "bf16 gate_up": Build(MF._gate_up_kernel, dict(x_ptr=bf, w1_ptr=bf, w3_ptr=bf, h_ptr=bf, a_ptr=bf,
                                                       NUM_PROGS=132, **routing), dict(
            BLOCK_M=gu.block_m, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k, EVEN_K=True, PERSISTENT=False, UPCAST=False,
            IEEE=False), gu.num_warps, gu.num_stages),
        "fp8 gate_up + quantized A": Build(G._fp8_gate_up_kernel, dict(
            x_ptr=e4, xs_ptr=f32, w1_ptr=e4, w1s_ptr=f32, w3_ptr=e4, w3s_ptr=f32, h_ptr=bf, a_ptr=bf, aq_ptr=u8,
            as_out_ptr=f32, **routing), dict(BLOCK_M=gate_up_block_m(), BLOCK_N=128, EVEN_K=True, STORE_A=False,
                                             QUANT_A=True, POW2=True, SOFT=False), 8, 3),
    }


def gluon() -> dict[str, Build]:
    """The warp-specialized Gluon FP8 GEMMs (``kernels/fp8/hopper_*.py`` and the dense benchmark
    kernel ``bench/hopper_dense_gemm.py``) at their launch settings; host tensors stand in for the
    TMA descriptors' bases."""
    from triton.experimental.gluon import language as gl

    from bench import hopper_dense_gemm as H
    from kernels.fp8 import gluon_base as base
    from kernels.fp8 import hopper_gate_up as GU
    from kernels.fp8 import hopper_grouped as G
    from kernels.fp8 import hopper_wgrad as W

    fp8, i32 = torch.float8_e4m3fn, torch.int32

    def descs(rows_a: int, rows_b: int, K: int, out_dtype: torch.dtype) -> dict:
        gl_out = gl.bfloat16 if out_dtype == torch.bfloat16 else gl.float32
        return dict(a_desc=base.descriptor(torch.empty(rows_a, K, dtype=fp8), [128, 128], gl.float8e4nv),
                    b_desc=base.descriptor(torch.empty(rows_b, K, dtype=fp8), [128, 128], gl.float8e4nv),
                    c_desc=base.descriptor(torch.empty(rows_a, rows_b, dtype=out_dtype), [64, 128], gl_out))

    def build(fn, args, consts, divisible):
        return Build(fn, args, consts, 4, gluon_divisible=divisible, maxnreg=base.MAXNREG)

    def gemm(stages: int):
        M = N = K = 1024
        args = dict(descs(M, N, K, torch.bfloat16), as_ptr=torch.empty(8, M), bs_ptr=torch.empty(8, 8), M=M, N=N, K=K)
        return build(H._fp8_gemm_kernel, args, dict(STAGES=stages, GROUP_M=8), ("as_ptr", "bs_ptr", "M", "N", "K"))

    def wgrad(stages: int, out_dtype: torch.dtype):
        M = NCOL = LD = 1024
        # Scales tile-major as quantize_cols_grouped stores them: unit stride along the rows.
        args = dict(descs(M, NCOL, LD, out_dtype), as_ptr=torch.empty(M, 8), bs_ptr=torch.empty(NCOL, 8),
                    tile_offs_ptr=torch.empty(9, dtype=i32), E=8, M=M, NCOL=NCOL, SA_R=1, SA_T=M, SB_R=1, SB_T=NCOL)
        return build(W._fp8_wgrad_kernel, args, dict(STAGES=stages, GROUP_M=8, SA_R=1, SB_R=1),
                     ("as_ptr", "bs_ptr", "tile_offs_ptr", "M", "NCOL", "SA_T", "SB_T"))

    def grouped(out_dtype: torch.dtype, scatter: bool, weighted: bool):
        NR, N, K = 4096, 2048, 768
        d = descs(NR, N, K, out_dtype)
        args = dict(a_desc=d["a_desc"], b_desc=d["b_desc"], out_ptr=torch.empty(NR, N, dtype=out_dtype),
                    as_ptr=torch.empty(NR, 6), bs_ptr=torch.empty(8, 16, 6), slot_ptr=torch.empty(NR, dtype=i32),
                    w_ptr=torch.empty(NR), offsets_ptr=torch.empty(9, dtype=i32), table_ptr=torch.empty(81, dtype=i32),
                    num_tiles=40, NR=NR, N=N, K=K, LDO=N, SA_R=6, SA_K=1)
        return build(G._fp8_grouped_kernel, args, dict(STAGES=4, SCATTER=scatter, WEIGHTED=weighted, SA_K=1),
                     ("as_ptr", "bs_ptr", "slot_ptr", "w_ptr", "offsets_ptr", "table_ptr", "out_ptr", "N", "K", "LDO"))

    def gate_up():
        NR, F, D, E = 4096, 1536, 4096, 8
        desc = lambda rows: base.descriptor(torch.empty(rows, D, dtype=fp8), [128, 128], gl.float8e4nv)  # noqa: E731
        args = dict(a_desc=desc(NR), b1_desc=desc(E * F), b3_desc=desc(E * F), h_ptr=torch.empty(8, dtype=torch.bfloat16),
                    aq_ptr=torch.empty(8, dtype=fp8), as_out_ptr=torch.empty(8), as_ptr=torch.empty(8),
                    w1s_ptr=torch.empty(8), w3s_ptr=torch.empty(8), offsets_ptr=torch.empty(8, dtype=i32),
                    table_ptr=torch.empty(8, dtype=i32), num_tiles=40, NR=NR, F=F, K=D, SA_R=32, SA_K=1)
        # Power-of-two scales (POW2) change three integer ops of the epilogue: built at the op's setting.
        return build(GU._fp8_gate_up_ws_kernel, args, dict(STAGES=GU.STAGES, POW2=False, SA_K=1),
                     ("h_ptr", "aq_ptr", "as_out_ptr", "as_ptr", "w1s_ptr", "w3s_ptr", "offsets_ptr", "table_ptr", "F",
                      "K", "SA_R"))

    return {"gemm_st4": gemm(4), "gemm_st5": gemm(5), "wgrad_st4_fp32": wgrad(4, torch.float32),
            "wgrad_st4_bf16": wgrad(4, torch.bfloat16), "grouped_down": grouped(torch.bfloat16, True, True),
            "grouped_dx": grouped(torch.bfloat16, True, False), "grouped_da": grouped(torch.float32, False, False),
            "gate_up": gate_up()}


FAMILIES = {"quantizers": quantizers, "gemms": gemms, "gluon": gluon}


def report(families=tuple(FAMILIES), cubins: str | None = None) -> dict[str, dict]:
    out = {}
    if cubins:
        os.makedirs(cubins, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            for name, build in FAMILIES[family]().items():
                path = os.path.join(cubins or tmp, re.sub(r"[^A-Za-z0-9]+", "_", name) + ".cubin")
                out[name] = sass_stats(compile_sm90(build), path)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=list(FAMILIES), action="append", help="a family of kernels (repeatable)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--cubins", help="keep the compiled cubins in this folder")
    cli = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET"):
        parser.error("run without TRITON_INTERPRET: the interpreter's functions do not compile")
    stats = report(tuple(cli.only or FAMILIES), cli.cubins)
    print("| kernel | regs | spill stack B | LDL/STL | shared KiB | stages | MMA | hw e4m3 | MMA issues and waits |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |")
    for name, s in stats.items():
        print(f"| {name} | {s['regs']} | {s['stack']} | {s['spills']} | {s['shared'] / 1024:.0f} | {s['stages']} | "
              f"{' '.join(s['mma']) or '-'} | {'yes' if s['hw_e4m3_cast'] else '-'} | {s['mma_order'] or '-'} |")
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump(stats, f, indent=1)
