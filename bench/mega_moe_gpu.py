"""Benchmark of the ``mega`` MoE backend on one GPU (H200): correctness, then speed.

    python -m bench.mega_moe_gpu                      # both shapes, full sweep (~8 min on an H200)
    python -m bench.mega_moe_gpu --shapes 30B --no-sweep --profile

For each shape (Qwen3-30B-A3B and -235B-A22B expert layers, T = 16384 tokens, top-8 of 128 experts,
random softmax routing renormalised over the top-k):

1. correctness: bf16 mega vs the plain-PyTorch reference run in fp32 on the same (bf16-valued)
   inputs; relative Frobenius error of y and of the five gradients;
2. time of forward and forward+backward (CUDA events, median of --iters after warm-up) for mega and
   the ``grouped_mm`` backend, each eager and under ``torch.compile(fullgraph=True)``;
3. a sweep of tile configs for each of the six mega GEMM kernels, timed alone, then the whole op
   again with the best config of each kernel, and the ``MegaMoEConfigs`` line to paste into
   ``kernels/moe/mega/configs.py``.

Configs other than the defaults go to ``moe_forward`` / ``moe_backward`` directly (the custom op
always runs ``get_configs``' defaults).

TFLOP/s count 6*N*D*F for the forward and 18*N*D*F for forward+backward (N = T*K), router excluded.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import traceback

import torch

from bench.timing import time_ms
from kernels.common.routing import sort_by_expert, tile_table
from kernels.common.tiles import TileConfig
from kernels.moe import get_moe_backend
from kernels.moe.mega import MegaMoEConfigs, get_configs, mega_moe, moe_backward, moe_forward
from kernels.moe.mega import backward as mb
from kernels.moe.mega import forward as mf
from kernels.moe.reference import moe_reference

SHAPES = {
    "30B": dict(T=16384, D=2048, F=768, E=128, K=8),
    "235B": dict(T=16384, D=4096, F=1536, E=128, K=8),
}

# Candidates per kernel: TileConfig(block_m, block_n, block_k, num_warps, num_stages, epilogue_split,
# persistent). Persistent grids (1 program per SM, tile loop flattened so the next tile's loads
# overlap this tile's epilogue) for the M-tiled kernels; dW13 is one GEMM over the 2F columns of dH
# (block_m tiles 2F), so 128 x 256 tiles read 85 FLOP per L2 byte instead of 51.
SWEEP = {
    "gate_up": [(128, 128, 64, 8, 4), (128, 128, 64, 8, 4, 1, 1), (128, 128, 64, 8, 3, 1, 1), (128, 128, 32, 8, 4, 1, 1)],
    "down": [(128, 256, 64, 8, 4), (128, 256, 64, 8, 4, 1, 1), (128, 256, 64, 8, 3, 1, 1), (128, 128, 64, 8, 4, 1, 1)],
    "dh": [(128, 128, 64, 8, 4, 2), (128, 128, 64, 8, 4, 2, 1), (128, 128, 64, 8, 3, 2, 1), (128, 64, 64, 8, 4, 2, 1)],
    "dx": [(128, 256, 32, 8, 3), (128, 256, 32, 8, 3, 1, 1), (128, 256, 32, 8, 4, 1, 1), (128, 128, 64, 8, 3, 1, 1)],
    "dw13": [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4),
             (128, 256, 32, 8, 4)],
    "dw2": [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 256, 64, 8, 4), (128, 256, 32, 8, 4)],
}
# FLOPs of each kernel in units of N*D*F.
KERNEL_FLOPS = {"gate_up": 4, "down": 2, "dh": 2, "dx": 4, "dw13": 4, "dw2": 2}


def log(*args) -> None:
    print(*args, flush=True)


def make_inputs(T, D, F, E, K, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, D, device="cuda", generator=g).to(dtype)
    logits = torch.randn(T, E, device="cuda", generator=g)
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    s, ids = probs.topk(K, dim=-1)
    s = s / s.sum(dim=-1, keepdim=True)
    w1 = (torch.randn(E, F, D, device="cuda", generator=g) / D**0.5).to(dtype)
    w3 = (torch.randn(E, F, D, device="cuda", generator=g) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, F, device="cuda", generator=g) / F**0.5).to(dtype)
    dy = torch.randn(T, D, device="cuda", generator=g).to(dtype)
    return x, ids, s, w1, w3, w2, dy


def check_correctness(inputs) -> dict[str, float]:
    x, ids, s, w1, w3, w2, dy = inputs
    leaves = [t.clone().requires_grad_() for t in (x, s, w1, w3, w2)]
    y = mega_moe(leaves[0], ids, *leaves[1:])
    grads = torch.autograd.grad(y, leaves, dy)
    ref_leaves = [t.detach().float().requires_grad_() for t in (x, s, w1, w3, w2)]
    y_ref = moe_reference(ref_leaves[0], ids, *ref_leaves[1:])
    ref_grads = torch.autograd.grad(y_ref, ref_leaves, dy.float())
    errs = {}
    for name, a, b in zip(("y", "dx", "ds", "dw1", "dw3", "dw2"), (y, *grads), (y_ref, *ref_grads)):
        errs[name] = ((a.float() - b).norm() / b.norm()).item()
    return errs


def time_backend(fn, inputs, iters):
    x, ids, s, w1, w3, w2, dy = inputs
    leaves = [t.clone().requires_grad_() for t in (x, s, w1, w3, w2)]

    def fwd():
        with torch.no_grad():
            fn(x, ids, s, w1, w3, w2)

    def fwd_bwd():
        y = fn(leaves[0], ids, *leaves[1:])
        torch.autograd.grad(y, leaves, dy)

    return time_ms(fwd, iters), time_ms(fwd_bwd, iters)


def time_mega_configs(configs: MegaMoEConfigs, inputs, iters):
    """Forward and forward+backward times of mega with ``configs``, through the launchers."""
    x, ids, s, w1, w3, w2, dy = inputs

    def fwd():
        moe_forward(x, ids, s, w1, w3, w2, configs)

    return time_ms(fwd, iters), time_ms(lambda: mega_step(configs, inputs), iters)


def mega_step(configs: MegaMoEConfigs, inputs):
    """One mega forward and backward with ``configs`` (what the op's autograd runs)."""
    x, ids, s, w1, w3, w2, dy = inputs
    y, h, slots, offsets = moe_forward(x, ids, s, w1, w3, w2, configs)
    return y, moe_backward(dy, x, s, w1, w3, w2, h, slots, offsets, configs)


def profile_mega(configs: MegaMoEConfigs, inputs) -> None:
    """Per-kernel GPU time of one mega forward+backward (torch profiler), to see where time goes."""

    def step():
        mega_step(configs, inputs)

    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    log("  profile of mega fwd+bwd (5 steps; GPU time per kernel):")
    log(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=60))


def sweep_kernels(inputs, iters, flop_unit):
    """Time each kernel alone over its candidate configs; returns the best MegaMoEConfigs."""
    x, ids, s, w1, w3, w2, dy = inputs
    E, Fdim, D = w1.shape
    K = ids.shape[1]
    N = ids.numel()
    slots, offsets = sort_by_expert(ids, E)
    default = get_configs(D, Fdim, E)
    h, a = mf.gate_up(x, w1, w3, slots, offsets, K, default.gate_up)
    dh, _, sa = mb.dh(dy, w2, h, s, slots, offsets, default.dh)
    tables = {}

    def table(bm):
        if bm not in tables:
            tables[bm] = tile_table(offsets, N, bm)
        return tables[bm]

    launch = {
        "gate_up": lambda c: mf.gate_up(x, w1, w3, slots, offsets, K, c, table(c.block_m)),
        "down": lambda c: mf.down(a, w2, s, slots, offsets, c, table(c.block_m)),
        "dh": lambda c: mb.dh(dy, w2, h, s, slots, offsets, c, table(c.block_m)),
        "dx": lambda c: mb.dx_slots(dh, w1, w3, slots, offsets, c, table(c.block_m)),
        "dw13": lambda c: mb.dw13(x, dh, slots, offsets, E, K, c),
        "dw2": lambda c: mb.dw2(dy, h, s, sa, slots, offsets, E, c),
    }
    best = {}
    for name, candidates in SWEEP.items():
        results = []
        for cand in candidates:
            cfg = TileConfig(*cand)
            try:
                t0 = time.time()
                launch[name](cfg)
                torch.cuda.synchronize()
                compile_s = time.time() - t0
                ms = time_ms(lambda: launch[name](cfg), iters)
                tflops = KERNEL_FLOPS[name] * flop_unit / ms / 1e9
                results.append((ms, cfg))
                log(f"    {name:8s} {cand}: {ms:7.3f} ms  {tflops:6.1f} TFLOP/s  (first call {compile_s:.1f} s)")
            except Exception as exc:
                log(f"    {name:8s} {cand}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
        best[name] = min(results, key=lambda r: r[0])[1] if results else getattr(default, name)
    return MegaMoEConfigs(**best)  # the Triton backward (grouped_mm_backward off): its kernels are what was swept


def config_variant(name: str, D: int, F: int, E: int) -> MegaMoEConfigs:
    """The default configs with named changes, '+'-joined: bwd_gmm / bwd_triton (dA', dX and the
    weight gradients through torch._grouped_mm, or the fused Triton backward kernels),
    down_persistent / down_plain (persistent grid or not)."""
    configs = get_configs(D, F, E)
    for part in name.split("+"):
        if part == "default":
            continue
        elif part in ("bwd_gmm", "bwd_triton"):
            configs = dataclasses.replace(configs, grouped_mm_backward=part == "bwd_gmm")
        elif part in ("down_persistent", "down_plain"):
            down = dataclasses.replace(configs.down, persistent=int(part == "down_persistent"))
            configs = dataclasses.replace(configs, down=down)
        else:
            raise ValueError(f"unknown config variant part {part!r}")
    return configs


def run_shape(label, shape, args, table_rows):
    T, D, Fdim, E, K = shape["T"], shape["D"], shape["F"], shape["E"], shape["K"]
    N = T * K
    unit = N * D * Fdim
    log(f"\n=== {label}: T={T} D={D} F={Fdim} E={E} K={K} (N={N}) ===")
    inputs = make_inputs(T, D, Fdim, E, K)

    t0 = time.time()
    errs = check_correctness(inputs)
    ok = all(v < 2e-2 for v in errs.values())
    log(f"  correctness (bf16 mega vs fp32 reference, rel err): "
        + " ".join(f"{k}={v:.2e}" for k, v in errs.items()) + f"  -> {'PASS' if ok else 'FAIL'}"
        + f"  ({time.time() - t0:.1f} s)")  # fmt: skip
    torch.cuda.empty_cache()

    base_fn = get_moe_backend("grouped_mm")
    variants = [("mega", mega_moe, False), ("mega", mega_moe, True), ("grouped_mm", base_fn, False),
                ("grouped_mm", base_fn, True)]
    if args.only_mega:
        variants = variants[:1]
    for name, fn, compiled in variants:
        mode = "compile" if compiled else "eager"
        try:
            t0 = time.time()
            if compiled:
                torch._dynamo.reset()
                fn = torch.compile(fn, fullgraph=True)
            f_ms, fb_ms = time_backend(fn, inputs, args.iters)
            log(f"  {name:18s} {mode:8s} fwd {f_ms:7.3f} ms ({6 * unit / f_ms / 1e9:6.1f} TFLOP/s)  "
                f"fwd+bwd {fb_ms:7.3f} ms ({18 * unit / fb_ms / 1e9:6.1f} TFLOP/s)  [{time.time() - t0:.0f} s]")  # fmt: skip
            table_rows.append((label, f"{name} {mode}", f_ms, 6 * unit / f_ms / 1e9, fb_ms, 18 * unit / fb_ms / 1e9))
        except Exception as exc:
            log(f"  {name} {mode}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
            traceback.print_exc()
        torch.cuda.empty_cache()

    for variant in args.config_variants.split(",") if args.config_variants else []:
        configs = config_variant(variant, D, Fdim, E)
        try:
            f_ms, fb_ms = time_mega_configs(configs, inputs, args.iters)
        except Exception as exc:
            log(f"  mega [{variant}]: FAILED {type(exc).__name__}: {str(exc)[:300]}")
            continue
        log(f"  mega [{variant:22s}] eager fwd {f_ms:7.3f} ms ({6 * unit / f_ms / 1e9:6.1f} TFLOP/s)  "
            f"fwd+bwd {fb_ms:7.3f} ms ({18 * unit / fb_ms / 1e9:6.1f} TFLOP/s)")  # fmt: skip
        table_rows.append((label, f"mega eager [{variant}]", f_ms, 6 * unit / f_ms / 1e9, fb_ms, 18 * unit / fb_ms / 1e9))

    if args.profile:
        profile_mega(config_variant(args.profile_variant, D, Fdim, E), inputs)

    if not args.no_sweep:
        log("  per-kernel tile sweep (each kernel alone):")
        best = sweep_kernels(inputs, args.iters, unit)
        log(f"  best configs for (D={D}, F={Fdim}, E={E}):")
        log("    " + repr(best).replace("TileConfig", "\n      TileConfig"))
        f_ms, fb_ms = time_mega_configs(best, inputs, args.iters)
        log(f"  mega (best tiles)  eager    fwd {f_ms:7.3f} ms ({6 * unit / f_ms / 1e9:6.1f} TFLOP/s)  "
            f"fwd+bwd {fb_ms:7.3f} ms ({18 * unit / fb_ms / 1e9:6.1f} TFLOP/s)")  # fmt: skip
        table_rows.append((label, "mega eager, best tiles", f_ms, 6 * unit / f_ms / 1e9, fb_ms, 18 * unit / fb_ms / 1e9))
    del inputs
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="30B,235B", help="comma-separated subset of " + ",".join(SHAPES))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-sweep", action="store_true", help="skip the per-kernel tile sweep")
    parser.add_argument("--profile", action="store_true", help="print a torch-profiler kernel table")
    parser.add_argument("--only-mega", action="store_true", help="time mega eager only (no baseline, no compile)")
    parser.add_argument("--profile-variant", default="default", help="config variant to profile (see --config-variants)")
    parser.add_argument("--config-variants", default="", help="comma-separated config variants to time in "
                        "eager mode after the main variants, e.g. bwd_triton,bwd_gmm+down_plain")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    log(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"triton {__import__('triton').__version__}")  # fmt: skip
    t_start = time.time()
    rows: list[tuple] = []
    for label in args.shapes.split(","):
        run_shape(label, SHAPES[label], args, rows)
    log(f"\n=== summary (median of {args.iters}; TFLOP/s: 6NDF fwd, 18NDF fwd+bwd) ===")
    log(f"{'shape':6s} {'variant':28s} {'fwd ms':>8s} {'TFLOP/s':>8s} {'f+b ms':>8s} {'TFLOP/s':>8s}")
    for label, variant, f_ms, f_tf, fb_ms, fb_tf in rows:
        log(f"{label:6s} {variant:28s} {f_ms:8.3f} {f_tf:8.1f} {fb_ms:8.3f} {fb_tf:8.1f}")
    log(f"total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
