"""The warp-specialized Gluon dense FP8 GEMM (bench/hopper_dense_gemm.py) against cuBLAS's
block-scaled FP8 (`torch._scaled_mm` with 1 x 128 and 128 x 128 scales), on the GPU; its K-grouped
(wgrad), M-grouped (down, dX, dA') and gate/up siblings (kernels/fp8/hopper_*.py) against the
plain-Triton kernels of the MoE op.

    python -m bench.hopper_gemm [--shapes 8192x8192x8192,131072x1536x2048] [--iters 50]
    python -m bench.hopper_gemm --shapes '' --wgrad-shapes '' --grouped-shapes 2048x768,2048x1536,768x2048
    python -m bench.hopper_gemm --shapes '' --wgrad-shapes '' --grouped-shapes '' --gate-up-shapes 4096x1536

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

from bench.hopper_dense_gemm import fp8_gemm, fp8_gemm_ref
from bench.timing import time_ms

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


def make_wgrad_inputs(counts: list[int], M: int, NCOL: int, device="cuda", generator: torch.Generator | None = None):
    """The wgrad's token-dim-quantized operands (``quantize_cols_grouped``) for experts with ``counts``
    rows each: dY (rows, M) and X (rows, NCOL) drawn on the CPU from ``generator``, a few rows 100x
    larger. Returns (at_q, at_s, bt_q, bt_s, offsets_E1) on ``device``."""
    from kernels.fp8.blockwise import quantize_cols_grouped

    rows = sum(counts)
    dy = torch.randn(rows, M, generator=generator)
    x = torch.randn(rows, NCOL, generator=generator)
    if rows:
        dy[torch.randint(0, rows, (max(1, rows // 50), ), generator=generator)] *= 100
    offsets_E1 = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    dy, x = (t.to(device=device, dtype=torch.bfloat16) for t in (dy, x))
    return (*quantize_cols_grouped(dy, offsets_E1), *quantize_cols_grouped(x, offsets_E1), offsets_E1)


def make_grouped_inputs(counts: list[int], N: int, K: int, extra_rows: int = 0, device="cuda",
                        generator: torch.Generator | None = None):
    """The operands of an M-grouped GEMM over experts with ``counts`` rows each, then ``extra_rows``
    rows past every expert (the op's empty slots): A (rows, K) e4m3 with 1 x 128 scales (a few rows
    100x larger), B (E, N, K) with 128 x 128 block scales, the offsets, a random row -> slot
    permutation and positive slot weights. Drawn on the CPU from ``generator``, moved to ``device``."""
    E, rows = len(counts), sum(counts) + extra_rows
    kb, nb = -(-K // 128), -(-N // 128)
    a_q = (torch.randn(rows, K, generator=generator) * 3).to(E4M3)
    b_q = (torch.randn(E, N, K, generator=generator) * 3).to(E4M3)
    a_s = torch.rand(rows, kb, generator=generator) + 0.25
    b_s = torch.rand(E, nb, kb, generator=generator) + 0.25
    if rows:
        a_s[torch.randint(0, rows, (max(1, rows // 50), ), generator=generator)] *= 100
    offsets_E1 = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    slot = torch.randperm(rows, generator=generator).to(torch.int32)
    weights = torch.rand(rows, generator=generator) + 0.1
    return [t.to(device) for t in (a_q, a_s, b_q, b_s, offsets_E1, slot, weights)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def scaled_mm(a_q, a_s, b_q, b_s):
    # cuBLAS blockwise: scale_a (M, K/128) column-major, scale_b (K/128, N/128) column-major.
    return torch._scaled_mm(a_q, b_q.t(), scale_a=a_s.t().contiguous().t(), scale_b=b_s.t(),
                            out_dtype=torch.bfloat16)


VARIANTS = {"st4_g8": dict(stages=4, group_m=8), "st5_g8": dict(stages=5, group_m=8),
            "st4_g16": dict(stages=4, group_m=16), "st5_g16": dict(stages=5, group_m=16)}


WGRAD_VARIANTS = {"ws_st4_g8": dict(stages=4, group_m=8), "ws_st3_g8": dict(stages=3, group_m=8),
                  "ws_st4_g4": dict(stages=4, group_m=4),
                  "ws_st4_g8_bf16out": dict(stages=4, group_m=8, out_dtype=torch.bfloat16)}


def time_wgrad(shapes: str, iters: int, experts: int = 128, rows: int = 131072) -> list[dict]:
    """The K-grouped wgrad dW[e] (M x Ncol) over ``rows`` expert-sorted rows split evenly over
    ``experts``: the Triton kernel (kernels/fp8/grouped_gemm.fp8_wgrad) against the Gluon one, fp32
    output as the op writes it; relative errors against a float32 reference."""
    from kernels.fp8.grouped_gemm import fp8_wgrad, fp8_wgrad_ref
    from kernels.fp8.hopper_wgrad import fp8_wgrad_ws

    out = []
    for shape in shapes.split(","):
        M, NCOL = map(int, shape.split("x"))
        at_q, at_s, bt_q, bt_s, offs = make_wgrad_inputs([rows // experts] * experts, M, NCOL)
        ref = fp8_wgrad_ref(at_q, at_s, bt_q, bt_s, offs)
        flop = 2 * rows * M * NCOL
        res = {"shape": f"{M}x{NCOL} ({experts}e)"}
        fns = {"triton": lambda: fp8_wgrad(at_q, at_s, bt_q, bt_s, offs)}
        fns.update({n: (lambda kw=kw: fp8_wgrad_ws(at_q, at_s, bt_q, bt_s, offs, **kw)) for n, kw in WGRAD_VARIANTS.items()})
        for name, fn in fns.items():
            res[name + "_err"] = rel_err(fn(), ref)
            res[name] = flop / time_ms(fn, iters) / 1e9
            print(f"wgrad {shape} {name}: {res[name]:.0f} TFLOP/s (err {res[name + '_err']:.1e})", flush=True)
        out.append(res)
        del ref
        torch.cuda.empty_cache()
    return out


# The MoE op's M-grouped GEMMs: (name, out dtype, scatter, weighted).
GROUPED_MODES = (("down", torch.bfloat16, True, True), ("dX", torch.bfloat16, True, False),
                 ("dA", torch.float32, False, False))


def time_grouped(shapes: str, iters: int, experts: int = 128, rows: int = 131072) -> list[dict]:
    """The M-grouped GEMM (N x K per expert) over ``rows`` expert-sorted rows split evenly over
    ``experts``, in each of the op's modes: the Triton kernel (kernels/fp8/grouped_gemm.py, the op's
    64 x 128 tiles) against the Gluon one; relative errors against a float64 reference."""
    from kernels.fp8.grouped_gemm import fp8_grouped_gemm, fp8_grouped_gemm_ref
    from kernels.fp8.hopper_grouped import fp8_grouped_gemm_ws
    from kernels.common.routing import tile_table

    out = []
    for shape in shapes.split(","):
        N, K = map(int, shape.split("x"))
        a_q, a_s, b_q, b_s, offs, slot, w = make_grouped_inputs([rows // experts] * experts, N, K)
        t64, t128 = tile_table(offs, rows, 64), tile_table(offs, rows, 128)
        flop = 2 * rows * N * K
        for mode, dtype, scatter, weighted in GROUPED_MODES:
            kw = dict(out_slot_N=slot if scatter else None, slot_weights_N=w if weighted else None)
            ref = fp8_grouped_gemm_ref(a_q, a_s, b_q, b_s, offs, **kw)
            res = {"shape": f"{mode} {N}x{K}"}
            fns = {"triton": lambda: fp8_grouped_gemm(a_q, a_s, b_q, b_s, offs, out_dtype=dtype, tiles=t64, **kw),
                   "gluon": lambda: fp8_grouped_gemm_ws(a_q, a_s, b_q, b_s, offs, dtype, t128, **kw)}
            for name, fn in fns.items():
                res[name + "_err"] = rel_err(fn(), ref)
                res[name] = flop / time_ms(fn, iters) / 1e9
                print(f"grouped {res['shape']} {name}: {res[name]:.0f} TFLOP/s (err {res[name + '_err']:.1e})",
                      flush=True)
            out.append(res)
            del ref
        torch.cuda.empty_cache()
    return out


def time_gate_up(shapes: str, iters: int) -> list[dict]:
    """The MoE op's gate/up step (``kernels/fp8/engine.gate_up_swiglu``: x's quantization, the
    GEMM with w1 and w3, the SwiGLU + A-quantization epilogue; D x F per expert) on each engine, at
    two routings: 16,384 tokens x top-8 over 128 experts (one GPU), and one EP rank's receive buffer
    (262,144 rows with one slot each over 16 local experts, half of them empty). Also the Gluon
    kernel alone on rows already in expert order. The engines' H and A (bytes and scales) must be
    equal: they compute the same sums in the same order."""
    from kernels.fp8 import blockwise as Q
    from kernels.fp8.engine import expert_order_rows, gate_up_swiglu
    from kernels.fp8.hopper_gate_up import fp8_gate_up_swiglu_ws
    from kernels.common.routing import sort_by_expert, tile_table

    out = []
    for shape in shapes.split(","):
        D, F = map(int, shape.split("x"))
        for label, T, K, E in (("top-8", 16384, 8, 128), ("EP rank", 262144, 1, 16)):
            x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
            ids = torch.rand(T, E, device="cuda").argsort(dim=1)[:, :K]
            if K == 1:
                ids[T // 2:] = -1
            slots, offs = sort_by_expert(ids, E)
            w1q, w1s = Q.quantize_weight((torch.randn(E, F, D, device="cuda") * 0.02).to(torch.bfloat16))
            w3q, w3s = Q.quantize_weight((torch.randn(E, F, D, device="cuda") * 0.02).to(torch.bfloat16))
            tiles = tile_table(offs, T * K, 128)
            a_in, s_in = expert_order_rows(x, ids >= 0, slots, offs, False)
            fns = {eng: (lambda eng=eng: gate_up_swiglu(x, ids >= 0, w1q, w1s, w3q, w3s, slots, offs, engine=eng,
                                                        pow2_scales=False, tiles=tiles, block_m=128))
                   for eng in ("triton", "gluon")}
            fns["gluon_kernel_only"] = lambda: fp8_gate_up_swiglu_ws(a_in, s_in, w1q, w1s, w3q, w3s, offs, tiles=tiles)
            # Power-of-two A scales (the op runs without).
            fns["gluon_kernel_pow2"] = lambda: fp8_gate_up_swiglu_ws(a_in, s_in, w1q, w1s, w3q, w3s, offs, tiles=tiles,
                                                                     pow2_scales=True)
            n = int(offs[-1])
            got = [fns[eng]() for eng in ("triton", "gluon")]
            # (H, A_q, A_s) of each engine, compared bytewise on the rows the op reads.
            res = {"shape": f"{D}x{F} {label}", "equal": all(
                torch.equal(a[:n].view(torch.uint8), b[:n].view(torch.uint8)) for a, b in zip(*got))}
            flop = 2 * 2 * n * D * F
            for name, fn in fns.items():
                res[name] = flop / time_ms(fn, iters) / 1e9
                print(f"gate/up {res['shape']} {name}: {res[name]:.0f} TFLOP/s", flush=True)
            out.append(res)
            del x, a_in, w1q, w3q, got
            torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8192x8192x8192,131072x1536x2048,131072x2048x768,131072x3072x4096,131072x4096x1536")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--wgrad-shapes", default="768x2048,2048x768,1536x4096,4096x1536",
                   help="M x Ncol of the K-grouped wgrad over 131072 rows, 128 experts ('' skips)")
    p.add_argument("--grouped-shapes", default="2048x768,2048x1536,768x2048,4096x1536,4096x3072,1536x4096",
                   help="N x K of the M-grouped GEMMs over 131072 rows, 128 experts ('' skips)")
    p.add_argument("--gate-up-shapes", default="2048x768,4096x1536",
                   help="D x F of the gate/up step at one GPU's and one EP rank's routing ('' skips)")
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
            if not err < 1e-2:
                bad.append((M, N, K, name, err))
        if K % 128 == 0 and N % 128 == 0:
            print(f"  {M}x{N}x{K} torch._scaled_mm: {rel_err(scaled_mm(a_q, a_s, b_q, b_s), ref):.2e}")

    rows = []
    for shape in filter(None, args.shapes.split(",")):
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

    wrows = time_wgrad(args.wgrad_shapes, args.iters) if args.wgrad_shapes else []
    grows = time_grouped(args.grouped_shapes, args.iters) if args.grouped_shapes else []
    gurows = time_gate_up(args.gate_up_shapes, args.iters) if args.gate_up_shapes else []
    with open(os.path.join(args.out, "hopper_gemm.json"), "w") as f:
        json.dump({"dense": rows, "wgrad": wrows, "grouped": grows, "gate_up": gurows}, f, indent=1)
    if rows:
        print(f"\n{'TFLOP/s':<28}" + "".join(f"{r['shape']:>18}" for r in rows))
        for name in ["cublas"] + names:
            print(f"{name:<28}" + "".join(f"{r[name]:>18.0f}" for r in rows))
    if grows:
        print(f"\n{'M-grouped TFLOP/s':<22}{'triton':>10}{'gluon':>10}{'gluon err':>12}")
        for r in grows:
            print(f"{r['shape']:<22}{r['triton']:>10.0f}{r['gluon']:>10.0f}{r['gluon_err']:>12.1e}")
            if not r["gluon_err"] < 1e-2:
                bad.append((r["shape"], "gluon", r["gluon_err"]))
    if gurows:
        print(f"\n{'gate/up TFLOP/s':<24}{'triton':>8}{'gluon':>8}{'kernel':>8}{'pow2':>8}{'equal':>7}")
        for r in gurows:
            print(f"{r['shape']:<24}{r['triton']:>8.0f}{r['gluon']:>8.0f}{r['gluon_kernel_only']:>8.0f}"
                  f"{r['gluon_kernel_pow2']:>8.0f}{str(r['equal']):>7}")
            if not r["equal"]:
                bad.append((r["shape"], "gate/up engines differ"))
    if wrows:
        print(f"\n{'wgrad TFLOP/s':<28}" + "".join(f"{r['shape']:>18}" for r in wrows))
        for name in [k for k in wrows[0] if k != "shape" and not k.endswith("_err")]:
            print(f"{name:<28}" + "".join(f"{r[name]:>18.0f}" for r in wrows))
    if bad:
        raise SystemExit(f"FAILED correctness: {bad}")


if __name__ == "__main__":
    main()
