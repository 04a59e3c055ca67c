"""The warp-specialized Gluon FP8 GEMM (kernels/fp8/hopper_gemm.py) against cuBLAS's block-scaled
FP8 (`torch._scaled_mm` with 1 x 128 and 128 x 128 scales), on the GPU.

    python -m bench.hopper_gemm [--shapes 8192x8192x8192,131072x1536x2048] [--iters 50]

Checks every variant against a float64 reference on fresh random inputs at awkward shapes (rows
not a multiple of the tile, K not a multiple of 128), then times each variant (median of CUDA-event
timings after warm-up) at the given shapes and prints a TFLOP/s table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from bench.timing import time_ms
from kernels.fp8.hopper_gemm import fp8_gemm, fp8_gemm_ref

E4M3 = torch.float8_e4m3fn


def make_inputs(M: int, N: int, K: int, device="cuda", generator: torch.Generator | None = None):
    """e4m3 operands with random positive scales, a few rows of A scaled 100x; drawn on the CPU
    (from ``generator``, so a seed replays them) and moved to ``device``."""
    kb, nb = -(-K // 128), -(-N // 128)
    a_q = (torch.randn(M, K, generator=generator) * 3).to(E4M3)
    b_q = (torch.randn(N, K, generator=generator) * 3).to(E4M3)
    a_s = torch.rand(M, kb, generator=generator) + 0.25
    b_s = torch.rand(nb, kb, generator=generator) + 0.25
    a_s[torch.randint(0, M, (max(1, M // 50), ), generator=generator)] *= 100
    return [t.to(device) for t in (a_q, a_s, b_q, b_s)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def scaled_mm(a_q, a_s, b_q, b_s):
    # cuBLAS blockwise: scale_a (M, K/128) column-major, scale_b (K/128, N/128) column-major.
    return torch._scaled_mm(a_q, b_q.t(), scale_a=a_s.t().contiguous().t(), scale_b=b_s.t(),
                            out_dtype=torch.bfloat16)


VARIANTS = {"st4_g8": dict(stages=4, group_m=8), "st5_g8": dict(stages=5, group_m=8),
            "st4_g16": dict(stages=4, group_m=16), "st5_g16": dict(stages=5, group_m=16),
            "st4_g8_unscaled": dict(stages=4, group_m=8, scaled=False)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8192x8192x8192,131072x1536x2048,131072x2048x768,131072x3072x4096,131072x4096x1536")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    names = args.variants.split(",")
    torch.manual_seed(0)

    print("correctness (relative error against float64):", flush=True)
    bad = []
    for M, N, K in ((300, 384, 640), (129, 256, 208), (1024, 1536, 2048)):
        a_q, a_s, b_q, b_s = make_inputs(M, N, K)
        ref = fp8_gemm_ref(a_q, a_s, b_q, b_s)
        for name in names:
            out = fp8_gemm(a_q, a_s.t().contiguous(), b_q, b_s, **VARIANTS[name])
            err = rel_err(out, ref)
            print(f"  {M}x{N}x{K} {name}: {err:.2e}", flush=True)
            if not err < 1e-2 and VARIANTS[name].get("scaled", True):
                bad.append((M, N, K, name, err))
        if K % 128 == 0 and N % 128 == 0:
            print(f"  {M}x{N}x{K} torch._scaled_mm: {rel_err(scaled_mm(a_q, a_s, b_q, b_s), ref):.2e}")

    rows = []
    for shape in args.shapes.split(","):
        M, N, K = map(int, shape.split("x"))
        a_q, a_s, b_q, b_s = make_inputs(M, N, K)
        a_st = a_s.t().contiguous()
        flop = 2 * M * N * K
        ref32 = fp8_gemm_ref(a_q, a_s, b_q, b_s, torch.float32)
        res = {"shape": shape}
        ms = time_ms(lambda: scaled_mm(a_q, a_s, b_q, b_s), args.iters)
        res["cublas"] = flop / ms / 1e9
        res["cublas_err"] = rel_err(scaled_mm(a_q, a_s, b_q, b_s), ref32.double())
        for name in names:
            kw = VARIANTS[name]
            out = fp8_gemm(a_q, a_st, b_q, b_s, **kw)
            res[name + "_err"] = rel_err(out, ref32.double())
            ms = time_ms(lambda: fp8_gemm(a_q, a_st, b_q, b_s, **kw), args.iters)
            res[name] = flop / ms / 1e9
            print(f"{shape} {name}: {res[name]:.0f} TFLOP/s (err {res[name + '_err']:.1e})", flush=True)
        rows.append(res)
        del a_q, b_q, ref32
        torch.cuda.empty_cache()

    with open(os.path.join(args.out, "hopper_gemm.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'TFLOP/s':<28}" + "".join(f"{r['shape']:>18}" for r in rows))
    for name in ["cublas"] + names:
        print(f"{name:<28}" + "".join(f"{r[name]:>18.0f}" for r in rows))
    if bad:
        raise SystemExit(f"FAILED correctness: {bad}")


if __name__ == "__main__":
    main()
