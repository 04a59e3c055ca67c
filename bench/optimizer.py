"""AdamW implementations on the parameters of a model shape: torch's fused (with and without a
``grad_scale``, the trainer's folded clipping), foreach, and ours (``kernels/adamw.py``).

    python -m bench.optimizer                                   # the 4-layer Qwen3-30B-A3B proxy's 3.11 B parameters
    python -m bench.optimizer --model qwen3_235b_a22b --layers 1

Prints one row per implementation: ms per step (CUDA events, median), the bytes one pass moves
(28 per parameter; 32 for fused with a scale, which writes the divided gradients back; foreach
makes several passes, so its rate is of that one-pass count) and the rate, and checks each
against fused AdamW (with the same scale or none) after one step from the same state.
``--device cpu --timer wall`` runs it on a tiny model under the Triton interpreter (the tests).
"""

from __future__ import annotations

import argparse

import torch

from bench.timing import time_ms, wall_ms
from kernels.adamw import TritonAdamW
from models.qwen3.args import get_model_args
from models.qwen3.model import Qwen3MoE


def param_shapes(model: str, layers: int) -> list[tuple[int, ...]]:
    with torch.device("meta"):
        m = Qwen3MoE(get_model_args(model, n_layers=layers))
    return [tuple(p.shape) for p in m.parameters()]


def make_state(shapes, device: str, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=gen) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-3
    return params


def build(name: str, params) -> torch.optim.Optimizer:
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    kw = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    if name.startswith("triton"):
        return TritonAdamW(groups, **kw)
    return torch.optim.AdamW(groups, fused=name.startswith("fused"), foreach=name == "foreach", **kw)


def main(argv: list[str] | None = None) -> list[tuple[str, float, int]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3_30b_a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timer", choices=("cuda", "wall"), default="cuda")
    args = ap.parse_args(argv)
    timer = time_ms if args.timer == "cuda" else wall_ms
    shapes = param_shapes(args.model, args.layers)
    n = sum(torch.Size(s).numel() for s in shapes)
    print(f"{args.model}, {args.layers} layers: {len(shapes)} tensors, {n / 1e9:.3f} B float32 parameters", flush=True)
    references: dict[bool, list[torch.Tensor]] = {}
    rows = []
    for name in ("fused", "fused+scale", "triton", "triton+scale", "foreach"):
        if name.startswith("fused") and args.device == "cpu" and not hasattr(torch, "_fused_adamw_"):
            continue
        params = make_state(shapes, args.device)
        opt = build(name, params)
        scaled = name.endswith("+scale")
        if scaled:
            opt.grad_scale = torch.tensor(1.25, device=args.device)
        opt.step()  # one step from the common start, checked against fused AdamW's
        first = [p.detach().flatten()[:4096].clone() for p in params]
        if name.startswith("fused"):
            references[scaled] = first
        elif scaled in references:
            err = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()
                      for a, b in zip(first, references[scaled]))
            if err > 1e-5:
                raise AssertionError(f"{name}: one step differs from fused AdamW's by {err:.2e} (max, relative)")
        ms = timer(opt.step, args.iters)
        rows.append((name, ms, n * (32 if name == "fused+scale" else 28)))
        del opt, params
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print("\n| implementation | ms per step | bytes per pass (counted) | rate |\n| --- | --- | --- | --- |")
    for name, ms, moved in rows:
        print(f"| {name} | {ms:.2f} | {moved / 1e9:.1f} GB | {moved / ms / 1e9:.2f} TB/s |")
    return rows


if __name__ == "__main__":
    main()
