"""The FP8 attention projections (``[precision] linear = "fp8_rowwise"``, kernels/fp8/rowwise.py)
against bf16, compiled by inductor as the trainer runs them, forward + backward, at the
Qwen3-30B-A3B projection shapes; each checked against float64 and timed.

    python -m bench.fp8_linear                 # T 16384, the four projections of a 30B-A3B layer

``--device cpu --timer wall --tokens 64 --only wk`` runs it tiny on CPU (the tests).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import kernels.fp8.rowwise as R
from bench.timing import time_ms, wall_ms

# (name, in features K, out features N) of a Qwen3-30B-A3B attention block: 32 query heads and 4
# KV heads of 128 over a 2048-wide residual stream.
PROJECTIONS = [("wq", 2048, 4096), ("wk", 2048, 512), ("wv", 2048, 512), ("wo", 4096, 2048)]
MODES = ("bf16", "fp8")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timer", choices=("cuda", "wall"), default="cuda")
    ap.add_argument("--only", default="", help="comma-separated projections (wq, wk, wv, wo); default all")
    args = ap.parse_args(argv)
    projections = [p for p in PROJECTIONS if not args.only or p[0] in args.only.split(",")]
    timer = time_ms if args.timer == "cuda" else wall_ms
    dev = args.device
    rows = []
    for name, K, N in projections:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(args.tokens, K, generator=gen)
        w = torch.randn(N, K, generator=gen) / K**0.5
        dy = torch.randn(args.tokens, N, generator=gen) * 1e-4  # a deep model's gradient size
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        y64 = x64 @ w64.t()
        y64.backward(dy.double())
        x_d, w_d, dy_d = x.to(dev, torch.bfloat16), w.to(dev), dy.to(dev, torch.bfloat16)

        def variant(fp8: bool):
            def f(a, b):
                with torch.autocast(dev, dtype=torch.bfloat16):
                    return R.fp8_linear(a, b, torch.bfloat16) if fp8 else F.linear(a, b)
            return torch.compile(f, fullgraph=True)

        for mode in MODES:
            torch._dynamo.reset()
            fn = variant(mode == "fp8")
            a = x_d.clone().requires_grad_()
            b = w_d.clone().requires_grad_()
            y = fn(a, b)
            y.backward(dy_d)
            errs = {"y": rel(y.float().cpu(), y64), "dx": rel(a.grad.float().cpu(), x64.grad),
                    "dw": rel(b.grad.float().cpu(), w64.grad)}

            def step():
                a.grad = b.grad = None
                fn(a, b).backward(dy_d)

            ms = timer(step, args.iters)
            rows.append({"proj": name, "mode": mode, "ms": ms, **errs})
            print(f"{name} {mode:5s} {ms:8.3f} ms  y {errs['y']:.4f} dx {errs['dx']:.4f} dw {errs['dw']:.4f}",
                  flush=True)
    print("\n| projection (K -> N) | " + " | ".join(f"{m} ms (max rel. err.)" for m in MODES) + " |")
    print("| --- |" + " --- |" * len(MODES))
    for name, K, N in projections:
        by = {r["mode"]: r for r in rows if r["proj"] == name}
        cells = [f"{by[m]['ms']:.3f} ({max(by[m]['y'], by[m]['dx'], by[m]['dw']):.3f})" for m in MODES]
        print(f"| {name} ({K} -> {N}) | " + " | ".join(cells) + " |")
    return rows


if __name__ == "__main__":
    main()
