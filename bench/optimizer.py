"""AdamW implementations on the parameters of a model shape: torch's fused (with and without a
``grad_scale``, the trainer's folded clipping), foreach, and ours (``kernels/adamw.py``).

    python -m bench.optimizer                                   # the 4-layer Qwen3-30B-A3B proxy's 3.11 B parameters
    python -m bench.optimizer --model qwen3_235b_a22b --layers 1
    python -m bench.optimizer --fp8-experts                     # one layer's FP8 expert weights, 30B shape

Prints one row per implementation: ms per step (CUDA events, median), the bytes one pass moves
(28 per parameter; 32 for fused with a scale, which writes the divided gradients back; foreach
makes several passes, so its rate is of that one-pass count) and the rate, and checks each
against fused AdamW (with the same scale or none) after one step from the same state.
``--device cpu --timer wall`` runs it on a tiny model under the Triton interpreter (the tests).

``--fp8-experts`` (:func:`fp8_expert_rows`): one layer's expert weights of ``--model`` (w1, w3
(E, F, D), w2 (E, D, F); 30B: E 128, F 768, D 2048) as ``[quantize] moe = "fp8_blockwise"``
trains them: the Triton AdamW step followed by the expert weight cache's refresh (the default),
against the step writing the e4m3 copies itself (``[optimizer] fp8_weights_in_step``), at each
``--fp8-launch`` (rows of a block per iteration x warps; the first is the default); each checked
bitwise equal to step + refresh after one step from the same state.
"""

from __future__ import annotations

import argparse

import torch

from bench.timing import time_ms, wall_ms
from kernels.adamw import FP8_ROWS, FP8_WARPS, TritonAdamW
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


def fp8_expert_rows(E: int, F: int, D: int, iters: int, device: str, timer,
                    launches: tuple[tuple[int, int], ...] = ((FP8_ROWS, FP8_WARPS),)) -> list[tuple[str, float, int]]:
    """(label, ms, counted bytes) of one layer's expert weights' optimizer step with their e4m3 copies
    made by a refresh after it, or by the step itself (module docstring). Bytes per parameter:
    AdamW 28, refresh 6 (float32 read, two e4m3 layouts written; the transposed re-read hits L2),
    the step writing the copies 30."""
    from kernels.moe.mega_fp8.weights import QuantizedExpertWeights

    shapes = [(E, F, D), (E, F, D), (E, D, F)]
    n = 3 * E * F * D

    def setup(in_step: bool, rows: int = FP8_ROWS, num_warps: int = FP8_WARPS):
        params = make_state(shapes, device)
        opt = build("triton", params)
        cache = QuantizedExpertWeights.empty(E, F, D, device)
        if in_step:
            for outputs, p in zip(cache.outputs().values(), params):
                opt.attach_fp8_weights(p, outputs, rows=rows, num_warps=num_warps)
        return params, opt, cache

    def refresh(params, cache):
        QuantizedExpertWeights.quantize(*params, out=cache, round_bf16=True)

    params, opt, cache = setup(False)
    opt.step()
    refresh(params, cache)
    want = [p.detach().clone() for p in params] + [t.view(torch.uint8).clone() for t in cache.tensors()]
    out = [("AdamW step alone", timer(opt.step, iters), 28 * n),
           ("refresh alone (QuantizedExpertWeights.quantize)", timer(lambda: refresh(params, cache), iters), 6 * n),
           ("AdamW step + refresh (default)", timer(lambda: (opt.step(), refresh(params, cache)), iters), 34 * n)]
    del params, opt, cache
    for rows, num_warps in launches:
        params, opt, cache = setup(True, rows, num_warps)
        opt.step()
        got = [p.detach() for p in params] + [t.view(torch.uint8) for t in cache.tensors()]
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            raise AssertionError(f"the step writing the e4m3 copies ({rows} rows x {num_warps} warps) differs from "
                                 "step + refresh")
        out.append((f"AdamW step writing the e4m3 copies, {rows} rows x {num_warps} warps", timer(opt.step, iters),
                    30 * n))
        del params, opt, cache, got
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> list[tuple[str, float, int]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3_30b_a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timer", choices=("cuda", "wall"), default="cuda")
    ap.add_argument("--fp8-experts", action="store_true", help="time one layer's FP8 expert weights' step instead "
                    "(fp8_expert_rows)")
    ap.add_argument("--fp8-launch", default=f"{FP8_ROWS}x{FP8_WARPS},16x8,8x4,32x16",
                    help="with --fp8-experts: comma-separated ROWSxWARPS launches of the step writing the e4m3 copies")
    args = ap.parse_args(argv)
    timer = time_ms if args.timer == "cuda" else wall_ms
    if args.fp8_experts:
        a = get_model_args(args.model)
        E, F, D = a.num_experts, a.moe_inter_dim, a.dim
        print(f"{args.model} expert weights of one layer: w1, w3 ({E}, {F}, {D}), w2 ({E}, {D}, {F}), "
              f"{3 * E * F * D / 1e9:.3f} B float32 parameters", flush=True)
        rows = fp8_expert_rows(E, F, D, args.iters, args.device, timer,
                               tuple(tuple(map(int, x.split("x"))) for x in args.fp8_launch.split(",")))
        _print_rows(rows)
        return rows
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
    _print_rows(rows)
    return rows


def _print_rows(rows: list[tuple[str, float, int]]) -> None:
    print("\n| implementation | ms per step | bytes per pass (counted) | rate |\n| --- | --- | --- | --- |")
    for name, ms, moved in rows:
        print(f"| {name} | {ms:.2f} | {moved / 1e9:.1f} GB | {moved / ms / 1e9:.2f} TB/s |")


if __name__ == "__main__":
    main()
