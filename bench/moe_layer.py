"""The MoE-layer benchmark: every backend on the same inputs, in one process.

    python -m bench.moe_layer                                  # all shapes, tokens, routings (~6 min, H200)
    python -m bench.moe_layer --shapes 30B --tokens 16384 --routing balanced --out /tmp/moe

For each expert shape (Qwen3-30B-A3B: D 2048, F 768; Qwen3-235B-A22B: D 4096, F 1536; E 128, top-8),
token count T and routing (``balanced``: every token picks 8 distinct experts uniformly;
``zipf``: expert popularity ~ 1/rank, the load imbalance of an untrained router), it measures

- forward and forward+backward time (CUDA events, median after warm-up) and TFLOP/s
  (6*T*K*D*F forward, 18*T*K*D*F forward+backward; the router is not counted),
- memory the autograd graph keeps for backward (allocated after the forward minus before, output
  excluded) and the peak memory of forward+backward above the inputs,

for ``grouped_mm`` eager and compiled, ``mega`` eager and compiled, and the whole MoE block
(router + experts, ``models/moe/moe.py``) compiled with each backend. Writes ``moe_layer.json``
and ``moe_layer.md`` (the table for BENCHMARKS.md) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from bench.timing import time_ms
from kernels.moe import get_moe_backend
from kernels.moe.reference import moe_reference

SHAPES = {"30B": dict(D=2048, F=768, E=128, K=8), "235B": dict(D=4096, F=1536, E=128, K=8)}


def routing(T: int, E: int, K: int, kind: str, gen: torch.Generator, device) -> torch.Tensor:
    """topk_ids (T, K) of distinct experts: Gumbel top-k over log-popularities."""
    if kind == "balanced":
        log_p = torch.zeros(E)
    elif kind == "zipf":
        log_p = -torch.log(torch.arange(1, E + 1, dtype=torch.float32))
    else:
        raise ValueError(f"unknown routing {kind!r}: balanced or zipf")
    gumbel = -torch.log(-torch.log(torch.rand(T, E, generator=gen).clamp_min(1e-20)))
    return (log_p + gumbel).topk(K, dim=-1).indices.to(device)


def make_inputs(T, D, F, E, K, kind, seed=0, device="cuda", dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    ids = routing(T, E, K, kind, gen, device)
    w = torch.rand(T, K, generator=gen).to(device)
    w = w / w.sum(-1, keepdim=True)
    x = torch.randn(T, D, generator=gen).to(device, dtype)
    w1 = (torch.randn(E, F, D, generator=gen) / D**0.5).to(device, dtype)
    w3 = (torch.randn(E, F, D, generator=gen) / D**0.5).to(device, dtype)
    w2 = (torch.randn(E, D, F, generator=gen) / F**0.5).to(device, dtype)
    return x, ids, w, w1, w3, w2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def measure(fn, leaves, iters):
    """fn() -> y with grads into ``leaves``: times and memory of forward and forward+backward."""
    dy = torch.randn_like(fn().detach())

    def fwd():
        with torch.no_grad():
            fn()

    def fwd_bwd():
        fn().backward(dy)
        for t in leaves:
            t.grad = None

    out = {"fwd_ms": time_ms(fwd, iters), "fwd_bwd_ms": time_ms(fwd_bwd, iters)}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = fn()
    torch.cuda.synchronize()
    out["saved_gib"] = (torch.cuda.memory_allocated() - base - y.numel() * y.element_size()) / 2**30
    y.backward(dy)
    torch.cuda.synchronize()
    out["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    del y
    for t in leaves:
        t.grad = None
    return out


_COMPILED: dict = {}


def compiled_backend(name: str):
    """The backend compiled for the current case, shapes static (``main`` clears the cache per case).

    Training compiles static shapes (fixed seq len). One compiled function reused across cases
    would recompile dynamic after the first new T (dynamo's automatic dynamic shapes), which reads
    slower than the static compile the trainer runs (BENCHMARKS.md)."""
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(get_moe_backend(name), fullgraph=True, dynamic=False)
    return _COMPILED[name]


def block_fn(backend: str, D: int, F: int, E: int, K: int, x, w1, w3, w2):
    """The MoE block (router + experts) with the given weights, compiled whole-graph with static
    shapes for the current case; gradients to x and every block parameter."""
    from models.moe.moe import MoE

    key = ("block", backend, D, F, E, K)
    if key not in _COMPILED:
        block = MoE(D, F, E, K, norm_topk_prob=True, backend=backend, use_expert_bias=False).to(x.device, x.dtype)
        torch.nn.init.normal_(block.router.gate.weight, std=0.02)
        _COMPILED[key] = (block, torch.compile(block, fullgraph=True, dynamic=False))
    block, compiled = _COMPILED[key]
    with torch.no_grad():
        block.experts.w1.copy_(w1)
        block.experts.w3.copy_(w3)
        block.experts.w2.copy_(w2)
    return lambda: compiled(x.unsqueeze(0))[0].squeeze(0), [x, *block.parameters()]


def run_case(label, shape, T, kind, iters, rows):
    D, F, E, K = shape["D"], shape["F"], shape["E"], shape["K"]
    x, ids, w, w1, w3, w2 = make_inputs(T, D, F, E, K, kind)
    loads = torch.bincount(ids.flatten(), minlength=E).float()
    imbalance = (loads.max() / loads.mean()).item()
    flops = 6 * T * K * D * F  # forward; forward + backward is 3x
    leaves = [t.requires_grad_() for t in (x, w, w1, w3, w2)]

    # Correctness of mega against the fp32 reference on the same bf16-valued inputs.
    mega = get_moe_backend("mega")
    ref = moe_reference(*(t.detach().float() for t in (x,)), ids, w.detach(),
                        *(t.detach().float() for t in (w1, w3, w2)))
    err = rel_err(mega(x, ids, w, w1, w3, w2).detach(), ref)
    del ref

    variants = {}
    for name in ("grouped_mm", "mega"):
        fn = get_moe_backend(name)
        variants[f"{name} eager"] = (lambda f=fn: f(x, ids, w, w1, w3, w2), leaves)
        variants[f"{name} compiled"] = (lambda f=compiled_backend(name): f(x, ids, w, w1, w3, w2), leaves)
    for name in ("grouped_mm", "mega"):
        variants[f"MoE block ({name}) compiled"] = block_fn(name, D, F, E, K, x, w1.detach(), w3.detach(),
                                                            w2.detach())
    for vname, (fn, vleaves) in variants.items():
        try:
            m = measure(fn, vleaves, iters)
        except Exception as e:  # a failing variant is reported, the others still run
            print(f"  {vname}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
            continue
        row = dict(shape=label, T=T, routing=kind, imbalance=round(imbalance, 2), variant=vname,
                   fwd_tflops=flops / m["fwd_ms"] / 1e9, fwd_bwd_tflops=3 * flops / m["fwd_bwd_ms"] / 1e9,
                   mega_rel_err=err, **m)
        rows.append(row)
        print(f"  {vname:28s} fwd {m['fwd_ms']:7.3f} ms ({row['fwd_tflops']:5.0f} TF/s)  "
              f"fwd+bwd {m['fwd_bwd_ms']:7.3f} ms ({row['fwd_bwd_tflops']:5.0f} TF/s)  "
              f"saved {m['saved_gib']:.2f} GiB  peak {m['peak_gib']:.2f} GiB", flush=True)


def markdown(rows) -> str:
    lines = ["| shape | T | routing (max/mean load) | variant | fwd ms | fwd+bwd ms | fwd+bwd TFLOP/s | "
             "saved for bwd GiB | peak GiB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['T']} | {r['routing']} ({r['imbalance']}) | {r['variant']} | "
                     f"{r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_tflops']:.0f} | "
                     f"{r['saved_gib']:.2f} | {r['peak_gib']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="30B,235B")
    parser.add_argument("--tokens", default="4096,16384,32768")
    parser.add_argument("--routing", default="balanced,zipf")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.moe_layer needs a CUDA GPU")
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    rows = []
    for label in args.shapes.split(","):
        for T in map(int, args.tokens.split(",")):
            for kind in args.routing.split(","):
                print(f"== {label} T={T} {kind}", flush=True)
                _COMPILED.clear()
                torch._dynamo.reset()  # static shapes per case, as training compiles them
                run_case(label, SHAPES[label], T, kind, args.iters, rows)
                torch.cuda.empty_cache()
                write(rows, args.out)  # after every case: a run cut short by a time limit keeps its rows
    print(markdown(rows))


def write(rows: list, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "moe_layer.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    with open(os.path.join(out, "moe_layer.md"), "w") as f:
        f.write(markdown(rows) + "\n")


if __name__ == "__main__":
    main()
