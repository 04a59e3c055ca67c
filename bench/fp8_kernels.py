"""GPU timings of the FP8 building blocks at the Qwen3 expert shapes (run on the H200).

    python -m bench.fp8_kernels            # both shapes, T = 16384, top-8, E = 128
    python -m bench.fp8_kernels --sweep    # launch-parameter sweep of the three FP8 GEMMs, 30B shape
    python -m bench.fp8_kernels --kernels  # the whole op, with a kernel-by-kernel profile (bf16, FP8 cached)
    python -m bench.fp8_kernels --quantizers  # the token-dim quantizers at one EP rank's rows, both shapes

Prints time, TFLOP/s (GEMMs, counting only routed rows) and GB/s (quantization: bytes read +
written). The GEMM block sizes are grouped_gemm._block_sizes' defaults.
Then :func:`time_moe_ops`: the whole ``mega_fp8`` op (forward, forward + backward), quantizing its
weights per call and with them pre-quantized (the trainer's compute copies), next to the bf16
``mega`` op on the same inputs, with their ratios.
"""

from __future__ import annotations

import functools

import torch
import triton

from bench.timing import time_ms
from kernels.moe import get_moe_backend
from kernels.fp8 import grouped_gemm as G
from kernels.fp8 import blockwise as Q
from kernels.common.routing import sort_by_expert, tile_table

SHAPES = {"30B-A3B": (2048, 768), "235B-A22B": (4096, 1536)}


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main(T: int = 16384, top_k: int = 8, E: int = 128) -> None:
    dev = "cuda"
    for name, (D, F) in SHAPES.items():
        N = T * top_k
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        w1 = (torch.randn(E, F, D, device=dev) * 0.02).to(torch.bfloat16)
        w3 = (torch.randn(E, F, D, device=dev) * 0.02).to(torch.bfloat16)
        w2 = (torch.randn(E, D, F, device=dev) * 0.02).to(torch.bfloat16)
        ids = torch.rand(T, E, device=dev).argsort(dim=1)[:, :top_k]
        slots, offs = sort_by_expert(ids, E)
        tiles = tile_table(offs, N, 128)
        rows = []

        def q(label, fn, nbytes):
            ms = _ms(fn)
            rows.append(f"{name:10s} {label:34s} {ms:8.3f} ms {nbytes / ms / 1e6:8.0f} GB/s")

        def g(label, fn, flops):
            ms = _ms(fn)
            rows.append(f"{name:10s} {label:34s} {ms:8.3f} ms {flops / ms / 1e9:8.0f} TFLOP/s")

        q("quantize_1x128 x (T,D)", lambda: Q.quantize_1x128(x), T * D * 3)
        q("quantize_cols_grouped x gathered", lambda: Q.quantize_cols_grouped(x, offs, slots, top_k, tiles=tiles), N * D * 3)
        q("quantize_weight w1 (E,F,D)", lambda: Q.quantize_weight(w1), E * F * D * 3)
        # The compute copies' refresh from float32 masters: one quantization pass per weight
        # writing every layout, rounding to bf16 inside it (the trainer's), against a bf16 cast first.
        # GB/s: the bytes of the cast path.
        from kernels.moe.mega_fp8.weights import QuantizedExpertWeights

        masters = [w.float() for w in (w1, w3, w2)]
        cache = QuantizedExpertWeights.empty(E, F, D, dev)
        q("weight refresh, cast + one pass", lambda: QuantizedExpertWeights.quantize(
            *(m.to(torch.bfloat16) for m in masters), out=cache), 3 * E * F * D * 6)
        q("weight refresh, one pass rounding fp32", lambda: QuantizedExpertWeights.quantize(
            *masters, out=cache, round_bf16=True), 3 * E * F * D * 6)
        xq, xs = Q.quantize_1x128(x)
        w1q, w1s = Q.quantize_weight(w1)
        w3q, w3s = Q.quantize_weight(w3)
        w2q, w2s = Q.quantize_weight(w2)
        g("gate_up + SwiGLU (+quant A)", lambda: G.fp8_gate_up_swiglu(
            xq, xs, w1q, w1s, w3q, w3s, slots, offs, top_k, quantize_a=True), 2 * N * D * 2 * F)
        _, a, (aq, as_) = G.fp8_gate_up_swiglu(xq, xs, w1q, w1s, w3q, w3s, slots, offs, top_k, quantize_a=True)
        g("down (A sorted)", lambda: G.fp8_grouped_gemm(aq, as_, w2q, w2s, offs), 2 * N * F * D)
        dh = torch.randn(N, F, device=dev, dtype=torch.bfloat16)
        atq, ats = Q.quantize_cols_grouped(dh, offs, tiles=tiles)
        btq, bts = Q.quantize_cols_grouped(x, offs, slots, top_k, tiles=tiles)
        g("wgrad dW1 = dH^T x (K-grouped)", lambda: G.fp8_wgrad(atq, ats, btq, bts, offs), 2 * N * F * D)
        print("\n".join(rows), flush=True)



def _moe_inputs(T, D, F, E, top_k, device):
    """bf16 tokens and weights (std 1/sqrt(fan-in)), softmax top-k routing renormalised, bf16 dy."""
    x = torch.randn(T, D, device=device, dtype=torch.bfloat16)
    probs = torch.randn(T, E, device=device).softmax(dim=-1)
    s, ids = probs.topk(top_k, dim=-1)
    s = s / s.sum(dim=-1, keepdim=True)
    ws = [(torch.randn(E, a, b, device=device) / b**0.5).to(torch.bfloat16) for a, b in ((F, D), (F, D), (D, F))]
    return x, ids, s, *ws, torch.randn(T, D, device=device, dtype=torch.bfloat16)


def kernel_breakdown(fn, iters: int = 10, device: str = "cuda") -> list[tuple[str, float, float]]:
    """Every kernel ``fn`` launches: (name, ms per call of ``fn``, launches per call), largest first,
    from torch.profiler over ``iters`` calls after one warm-up call. On CPU (the tests) the operators'
    own CPU time stands in for kernel time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
        sync()
    rows = []
    for e in prof.key_averages():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us > 0:
            rows.append((e.key, us / 1e3 / iters, e.count / iters))
    return sorted(rows, key=lambda r: -r[1])


def breakdown_rows(title: str, kernels: list[tuple[str, float, float]], top: int = 25) -> list[str]:
    """A printed table of :func:`kernel_breakdown`'s result: the ``top`` largest, then the rest summed."""
    total = sum(ms for _, ms, _ in kernels)
    rows = [f"{title}: {total:.3f} ms of kernels per call", f"  {'ms':>8s} {'calls':>6s}  kernel"]
    rows += [f"  {ms:8.3f} {n:6.1f}  {name[:110]}" for name, ms, n in kernels[:top]]
    if len(kernels) > top:
        rows.append(f"  {sum(ms for _, ms, _ in kernels[top:]):8.3f} {'':6s}  {len(kernels) - top} other kernels")
    return rows


def time_moe_ops(T=16384, top_k=8, E=128, shapes=SHAPES, iters=20, device="cuda", timer=None,
                 breakdown: tuple[str, ...] = ()) -> list[str]:
    """Median ms of the whole MoE op, forward and forward + backward: bf16 ``mega``, ``mega_fp8``
    quantizing its weights per call, and ``mega_fp8`` as the trainer runs it with the expert weight
    cache (``cached``: e4m3 copies made beforehand, bf16 gradient carriers without storage as the
    weights, as ``components/precision/copies.py`` passes them with the Triton AdamW); the cached op
    also with float32 master weights as the carriers (gradients written in float32: the trainer
    without that optimizer) and with every GEMM on the Triton engine (the default ``auto`` takes the
    Gluon kernels on an sm_90 GPU). Each row's ratio is bf16 ``mega`` / it.

    ``timer(fn, iters)`` returns ms (default: CUDA events, :func:`bench.timing.time_ms`); the tests run
    this at a tiny size on CPU with a wall clock to exercise the code paths. ``breakdown``: labels of
    variants whose forward + backward is also profiled kernel by kernel (:func:`kernel_breakdown`).
    """
    from kernels.moe.mega_fp8 import MegaFP8Options, mega_moe_fp8
    from kernels.moe.mega_fp8.weights import QuantizedExpertWeights

    timer = timer or time_ms
    rows = []
    for name, (D, F) in shapes.items():
        x, ids, s, w1, w3, w2, dy = _moe_inputs(T, D, F, E, top_k, device)
        quantized = QuantizedExpertWeights.quantize(w1, w3, w2)
        cached = functools.partial(mega_moe_fp8, quantized=quantized)
        master = (w1.float(), w3.float(), w2.float())
        carriers = tuple(torch.zeros((), device=device, dtype=torch.bfloat16).expand(w.shape) for w in (w1, w3, w2))
        # label -> (op, weights)
        variants = {
            "mega (bf16)": (get_moe_backend("mega"), (w1, w3, w2)),
            "mega_fp8, weights quantized per call": (get_moe_backend("mega_fp8"), (w1, w3, w2)),
            "mega_fp8 cached": (cached, carriers),
            "  fp32 master weights": (cached, master),
            "  engine triton": (functools.partial(cached, options=MegaFP8Options(engine="triton")), carriers),
        }
        flops = 2 * T * top_k * D * F * 3  # forward: gate, up, down
        ms = {}
        for label, (fn, ws) in variants.items():
            leaves = [t.clone().requires_grad_() for t in (x, s, *ws)]

            def fwd(fn=fn, ws=ws):
                with torch.no_grad():
                    fn(x, ids, s, *ws)

            def fwd_bwd(fn=fn, leaves=leaves):
                torch.autograd.grad(fn(leaves[0], ids, *leaves[1:]), leaves, dy)

            ms[label] = (timer(fwd, iters), timer(fwd_bwd, iters))
        f16, fb16 = ms["mega (bf16)"]
        rows.append(f"{name} T={T} top-{top_k} E={E}: fwd ms, fwd+bwd ms (fwd+bwd TFLOP/s, bf16 mega / it)")
        for label, (f, fb) in ms.items():
            rows.append(f"  {label:38s} {f:8.3f} {fb:8.3f} ({3 * flops / fb / 1e9:5.0f} TFLOP/s, {fb16 / fb:4.2f}x)")
        print("\n".join(rows[-len(ms) - 1:]), flush=True)
        for label in breakdown:
            fn, ws = variants[label]
            leaves = [t.clone().requires_grad_() for t in (x, s, *ws)]
            table = breakdown_rows(f"{name} {label.strip()}, fwd+bwd",
                                   kernel_breakdown(lambda: torch.autograd.grad(fn(leaves[0], ids, *leaves[1:]),
                                                                                leaves, dy), device=device))
            rows += table
            print("\n".join(table), flush=True)
    return rows


def sweep(T: int = 16384, top_k: int = 8, E: int = 128, D: int = 2048, F: int = 768, device: str = "cuda",
          timer=None) -> list[str]:
    """Time each FP8 GEMM over launch parameters on one input (30B expert shape, balanced routing:
    each expert gets exactly T * top_k / E rows), TMA on and off where the GEMMs take both, and the
    token-dim quantization over its block widths."""
    dev, timer = device, timer or _ms
    N = T * top_k
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    w1, w3 = ((torch.randn(E, F, D, device=dev) * 0.02).to(torch.bfloat16) for _ in range(2))
    w2 = (torch.randn(E, D, F, device=dev) * 0.02).to(torch.bfloat16)
    # token t, choice k -> expert (t * top_k + k) % E: distinct per token, exactly N / E rows each.
    ids = (torch.arange(T, device=dev)[:, None] * top_k + torch.arange(top_k, device=dev)) % E
    slots, offs = sort_by_expert(ids, E)
    xq, xs = Q.quantize_1x128(x)
    w1q, w1s = Q.quantize_weight(w1)
    w3q, w3s = Q.quantize_weight(w3)
    w2q, w2s = Q.quantize_weight(w2)
    _, _, (aq, as_) = G.fp8_gate_up_swiglu(xq, xs, w1q, w1s, w3q, w3s, slots, offs, top_k, quantize_a=True)
    dh = torch.randn(N, F, device=dev, dtype=torch.bfloat16)
    flops = 2 * N * D * F
    rows = []

    def t(label, fn, fl, unit="TFLOP/s"):
        """fl: FLOPs (TFLOP/s), or bytes moved with unit="GB/s"."""
        try:
            ms = timer(fn)
            rate = fl / ms / (1e9 if unit == "TFLOP/s" else 1e6)
            rows.append(f"{label:52s} {ms:8.3f} ms {rate:6.0f} {unit}")
        except Exception as exc:  # a config that does not fit (shared memory, registers)
            rows.append(f"{label:52s} failed: {type(exc).__name__}: {str(exc)[:60]}")
        print(rows[-1], flush=True)

    for bm, warps, stages in ((64, 8, 3), (128, 8, 3), (64, 4, 3), (128, 8, 4)):
        tiles = tile_table(offs, N, bm)
        t(f"gate_up+quantA bm{bm} bn128 w{warps} s{stages}", lambda: G.fp8_gate_up_swiglu(
            xq, xs, w1q, w1s, w3q, w3s, slots, offs, top_k, quantize_a=True, store_a=False, tiles=tiles,
            block_m=bm, num_warps=warps, num_stages=stages), 2 * flops)
    for bm, bn, warps, stages, tma in ((64, 128, 4, 4, False), (64, 128, 4, 3, False), (128, 128, 8, 3, False),
                                       (64, 128, 4, 3, True), (64, 128, 4, 4, True), (128, 128, 8, 3, True)):
        tiles = tile_table(offs, N, bm)
        t(f"down bm{bm} bn{bn} w{warps} s{stages}{' tma' if tma else ''}", lambda: G.fp8_grouped_gemm(
            aq, as_, w2q, w2s, offs, tiles=tiles, block_m=bm, block_n=bn, num_warps=warps,
            num_stages=stages, tma=tma), flops)
    # The backward's M-tiled FP8 kernels: dA' (a gathered fp8_grouped_gemm) + the SwiGLU backward
    # kernel, and dX.
    from kernels.moe.mega_fp8 import backward as B

    dy = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    dyq, dys = Q.quantize_1x128(dy)
    w2t_q, w2t_s = B._transposed(w2q), w2s.mT.contiguous()
    h, _, _ = G.fp8_gate_up_swiglu(xq, xs, w1q, w1s, w3q, w3s, slots, offs, top_k)
    s_TK = torch.rand(T, top_k, device=dev)
    t("dh (fp8_grouped_gemm fp32 dA' + SwiGLU backward kernel)", lambda: B.dh_swiglu(
        dyq, dys, w2t_q, w2t_s, h, s_TK, slots, offs), flops)
    _, (dhq, dhs), _, _ = B.dh_swiglu(dyq, dys, w2t_q, w2t_s, h, s_TK, slots, offs)
    w13t_q, w13t_s = B.dx_weight(w1, w3)
    for bm, bn, warps, stages, tma in ((64, 128, 4, 4, False), (128, 128, 8, 3, False), (64, 128, 4, 3, True),
                                       (64, 128, 4, 4, True), (128, 128, 8, 3, True)):
        tiles = tile_table(offs, N, bm)
        t(f"dX bm{bm} bn{bn} w{warps} s{stages}{' tma' if tma else ''}", lambda: G.fp8_grouped_gemm(
            dhq, dhs, w13t_q, w13t_s, offs, tiles=tiles, block_m=bm, block_n=bn, out_slot_N=slots,
            num_warps=warps, num_stages=stages, tma=tma), 2 * flops)
    # The token-dim operands of the wgrad: every tile at a multiple of 128 columns.
    atp, atps = Q.quantize_cols_grouped(dh, offs)
    btp, btps = Q.quantize_cols_grouped(x, offs, slots, top_k)
    for bk, warps in ((64, 4), (32, 4), (128, 4), (128, 8), (256, 8)):
        # bytes: x read in bf16 (gathered), written in e4m3
        t(f"quantize_cols_grouped x gathered bk{bk} w{warps}", lambda: Q.quantize_cols_grouped(
            x, offs, slots, top_k, block_k=bk, num_warps=warps), N * D * 3, "GB/s")
    for bk in (32, 64):  # the backward's other operands: dH (N, 2F) and dy's sorted rows, not gathered
        t(f"quantize_cols_grouped dH bk{bk} w4", lambda: Q.quantize_cols_grouped(
            dh, offs, block_k=bk), N * F * 3, "GB/s")
    for bm, bn, warps, stages, tma in ((128, 128, 8, 3, False), (64, 128, 4, 4, False), (128, 256, 8, 3, False),
                                       (64, 128, 4, 4, True), (64, 128, 4, 3, True), (128, 128, 8, 3, True)):
        t(f"wgrad bm{bm} bn{bn} w{warps} s{stages}{' tma' if tma else ''}", lambda: G.fp8_wgrad(
            atp, atps, btp, btps, offs, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages,
            tma=tma), flops)
    print("\n".join(rows))
    return rows


def quantizer_sweep(rows: int = 262144, routed: int = 131072, E: int = 16, shapes=SHAPES, device: str = "cuda",
                    timer=None, variants=((32, 512, 4, 1), (64, 1024, 8, 1), (32, 512, 4, 2), (32, 512, 4, 3),
                                          (64, 512, 4, 3), (64, 1024, 8, 3), (128, 1024, 8, 2))) -> list[str]:
    """The wgrad operands' token-dim quantizer (``quantize_cols_grouped``) over (block_k, k_chunk,
    warps, stages), and the 1 x 128 quantizer with and without its valid-row mask, at the rows one rank of
    EP 8 receives at capacity factor 2 (defaults: ``rows`` receive rows of which ``routed`` carry a
    slot, over ``E`` local experts, top-1 as the backend sees them). The first variant is the
    default. Each variant's output is compared bitwise with the first's on the experts' tiles; GB/s
    counts the routed rows' bytes read and written."""
    dev, timer = device, timer or _ms
    gen = torch.Generator(device="cpu").manual_seed(0)
    counts = torch.rand(E, generator=gen) + 0.2
    counts = (counts / counts.sum() * routed).long()
    counts[0] += routed - counts.sum()
    offs = torch.zeros(E + 1, dtype=torch.int32)
    offs[1:] = counts.cumsum(0)
    offs = offs.to(dev)
    slots = torch.randperm(rows, generator=gen).int().to(dev)
    tiles = tile_table(offs, rows, Q.TILE)
    used = int(((counts + Q.TILE - 1) // Q.TILE).sum())
    valid = (torch.arange(rows, device=dev) < routed).view(rows, 1)
    out = []

    def t(label, fn, nbytes):
        ms = timer(fn)
        out.append(f"{label:60s} {ms:8.3f} ms {nbytes / ms / 1e6:6.0f} GB/s")
        print(out[-1], flush=True)

    for name, (D, F) in shapes.items():
        for what, K, gather in (("x gathered", D, True), ("dH", 2 * F, False), ("s*A", F, False)):
            x = torch.randn(rows, K, device=dev, dtype=torch.bfloat16)
            sl = slots if gather else None
            first = None
            for bk, kc, warps, stages in variants:
                if kc % bk:
                    continue
                q, sc = Q.quantize_cols_grouped(x, offs, sl, 1, True, tiles, bk, kc, warps, stages)
                got = (q[:, : used * Q.TILE].view(torch.uint8), sc[:, :used])
                first = first or got
                same = torch.equal(got[0], first[0]) and torch.equal(got[1], first[1])
                t(f"{name} quantize_cols_grouped {what} bk{bk} kc{kc} w{warps} st{stages}{'' if same else ' DIFFERS'}",
                  lambda: Q.quantize_cols_grouped(x, offs, sl, 1, True, tiles, bk, kc, warps, stages), routed * K * 3)
        x = torch.randn(rows, D, device=dev, dtype=torch.bfloat16)
        t(f"{name} quantize_1x128 x, every row", lambda: Q.quantize_1x128(x, True), rows * D * 3)
        t(f"{name} quantize_1x128 x, routed rows", lambda: Q.quantize_1x128(x, True, valid), routed * D * 3)
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="launch-parameter sweep only")
    parser.add_argument("--kernels", action="store_true", help="the whole op only, with a kernel-by-kernel "
                        "profile of bf16 mega and cached mega_fp8 forward + backward")
    parser.add_argument("--quantizers", action="store_true", help="the token-dim quantizers' sweep at one EP "
                        "rank's receive rows only")
    cli = parser.parse_args()
    if cli.sweep:
        sweep()
    elif cli.quantizers:
        quantizer_sweep()
    elif cli.kernels:
        time_moe_ops(breakdown=("mega (bf16)", "mega_fp8 cached"))
    else:
        main()
        time_moe_ops()
