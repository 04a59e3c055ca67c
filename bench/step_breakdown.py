"""Where a training step's GPU time goes, from a profiler trace of our trainer.

    # 1. a trace of steps 8-9 of the run to explain (any train.py run; here through bench.compare):
    python -m bench.compare --only ours_mega --ours-args "--profiling.enable_profiling \
        --profiling.profile_start_step 8 --profiling.profile_steps 2" ...
    # 2. the breakdown:
    python -m bench.step_breakdown <dump_folder>/profile_traces/step-8-9/rank0_trace.json --steps 2

Every GPU kernel (and memcpy/memset) of the trace is put in one part, by the first rule that
matches its name or the CPU op that launched it (the innermost profiled op, found through the
launch's correlation id, and the ops enclosing it on the launching thread):

    optimizer  AdamW, gradient-norm clipping (foreach / fused multi-tensor kernels)
    comm       NCCL, and any kernel or memcpy launched inside a collective's op (in a simulated
               world, parallelisms/simulate.py, the loopback copies that stand in for communication)
    attention  SDPA (cuDNN, flash, memory-efficient) forward and backward
    moe        the MoE ops (mega_moe::*, mega_moe_fp8::*, _grouped_mm, _scaled_grouped_mm, the
               torch reference's per-expert mm), routing (topk, sort, histc; scatter/gather/index
               only inside a MoE op or as their aten ops, as RoPE and the embedding use them too)
    lm_head    GEMMs with an operand dimension >= 100,000 (the vocabulary) and the loss kernels
    gemm       the other GEMMs (attention projections, router)
    norm       RMSNorm (inductor kernels computing an rsqrt)
    cast       pure dtype conversions (inductor ``_to_copy`` kernels, aten::copy_/to)
    memory     the other memcpy / memset
    other      the rest: the top of that list is what to explain next

Inductor's generated kernels have no CPU op of their own (they run inside one "CompiledFunction"),
so they are classified by the aten ops their names list. Times are GPU-busy time per step; the
step's wall time is the span of the trace's kernels divided by ``--steps``, and ``idle`` is the
wall time with no kernel running (launch gaps, host syncs, data loading). Overlapping kernels
(several streams) are counted in each part but once in the busy union. ``comm_exposed`` is the
communication time during which no other kernel runs (the exposed EP communication).
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

PARTS = ("attention", "moe", "lm_head", "gemm", "norm", "cast", "optimizer", "comm", "memory", "other")

_GEMM_KERNEL = re.compile(r"gemm|nvjet|cutlass|xmma|sm90_.*(mma|gmma)|cublas", re.I)
_GEMM_OP = re.compile(r"aten::(mm|addmm|bmm|matmul|linear|_scaled_mm)$")
_COMM_OP = re.compile(r"nccl|c10d::|all_to_all|all_gather|reduce_scatter")
# (part, regex on the kernel name, regex on the launching op chain), tried in order.
_RULES: list[tuple[str, re.Pattern | None, re.Pattern | None]] = [
    ("comm", re.compile(r"nccl", re.I), _COMM_OP),
    ("optimizer", re.compile(r"multi_tensor_apply|fused_adam|adamw", re.I),
     re.compile(r"Optimizer\.step|_fused_adamw|_foreach_|clip_grad|get_total_norm")),
    ("attention", re.compile(r"flash|fmha|sdpa|attn|cudnn_generated_fort_native_sdpa", re.I),
     re.compile(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention|flex_attention")),
    # Kernel names alone: our kernels and routing's sorts/counts; index/gather/scatter kernels also
    # serve RoPE and the embedding, so they count as MoE only when launched inside a MoE op.
    ("moe", re.compile(r"^_(gate_up|down|dh|dx|dw13|dw2|fp8_dh|sum_over_k|tile_table)|_kernel_grouped|mega|"
                       r"topk|sort|histc|bincount", re.I),
     # aten::_index_put_impl_ (an index's backward) too, so upstream's indexing_backward_kernel counts
     # as MoE (unverified: the profile does not say which op launched it).
     re.compile(r"mega_moe|_grouped_mm|_scaled_grouped_mm|moe|experts|aten::_?(topk|sort|argsort|histc|bincount|"
                r"scatter|gather|index)")),
    ("lm_head", re.compile(r"log_softmax|nll_loss|cross_entropy", re.I),
     re.compile(r"cross_entropy|nll_loss|log_softmax|chunked_loss")),
    ("norm", re.compile(r"rsqrt|rms_norm", re.I), re.compile(r"rms_norm")),
    ("cast", re.compile(r"^triton_\w+_fused__to_copy_\d+$|elementwise_kernel.*copy|bfloat16_copy", re.I),
     re.compile(r"aten::(copy_|_to_copy|to)$")),
]


def _events(trace: dict[str, Any] | list) -> list[dict[str, Any]]:
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def _parents(by_tid: dict[Any, list[dict[str, Any]]]) -> dict[int, dict[str, Any] | None]:
    """id(event) -> the innermost CPU event enclosing it on its thread (intervals nest)."""
    parent: dict[int, dict[str, Any] | None] = {}
    for evs in by_tid.values():
        stack: list[dict[str, Any]] = []
        for ev in evs:  # sorted by start, longer first on ties
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) <= ev["ts"]:
                stack.pop()
            parent[id(ev)] = stack[-1] if stack else None
            stack.append(ev)
    return parent


def _chain(op: dict[str, Any] | None, parent: dict[int, dict[str, Any] | None],
           by_tid: dict[Any, list[dict[str, Any]]], starts: dict[Any, list[float]], at: float | None,
           tid: Any) -> list[dict[str, Any]]:
    """The launching op and the CPU events enclosing it. Without an op (an inductor kernel), the
    innermost event on the launching thread that encloses the launch time ``at``, and its parents."""
    if op is None and at is not None and tid in by_tid:
        i = bisect.bisect_right(starts[tid], at) - 1
        ev = by_tid[tid][i] if i >= 0 else None
        while ev is not None and ev["ts"] + ev.get("dur", 0) < at:
            ev = parent.get(id(ev))
        op = ev
    chain = []
    while op is not None:
        chain.append(op)
        op = parent.get(id(op))
    return chain


def _is_vocab_gemm(chain: list[dict[str, Any]], vocab_min: int) -> bool:
    for ev in chain:
        dims = ev.get("args", {}).get("Input Dims")
        if dims and _GEMM_OP.search(ev["name"]):
            flat = [d for shape in dims if isinstance(shape, list) for d in shape if isinstance(d, int)]
            if any(d >= vocab_min for d in flat):
                return True
    return False


def classify(kernel: str, chain: list[dict[str, Any]], vocab_min: int = 100_000) -> str:
    names = " ".join(ev["name"] for ev in chain)
    for part, k_re, op_re in _RULES:
        if (k_re is not None and k_re.search(kernel)) or (op_re is not None and names and op_re.search(names)):
            return part
    if _GEMM_KERNEL.search(kernel) or any(_GEMM_OP.search(ev["name"]) for ev in chain):
        return "lm_head" if _is_vocab_gemm(chain, vocab_min) else "gemm"
    return "other"


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint sorted intervals covering ``spans``."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intersection of two disjoint sorted interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in spans)


def breakdown(trace: dict[str, Any] | list, steps: int, vocab_min: int = 100_000, top: int = 25,
              top_gaps: int = 10, long_gap_us: float = 1000.0) -> dict[str, Any]:
    """Per-part GPU ms per step, the step's wall and idle ms, the ``top`` kernels by time, the
    ``top_gaps`` largest idle gaps by the kernels around them, and what the host ran during the gaps
    of at least ``long_gap_us`` (:func:`_host_during`)."""
    events = [e for e in _events(trace) if e.get("ph") == "X"]
    cpu = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    ops_by_ext = {e["args"]["External id"]: e for e in cpu if "External id" in e.get("args", {})}
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    by_tid: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in cpu:
        by_tid[e.get("tid")].append(e)
    starts = {}
    for tid, evs in by_tid.items():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        starts[tid] = [e["ts"] for e in evs]
    parent = _parents(by_tid)
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        raise ValueError("the trace has no GPU kernels: profile a CUDA run ([profiling] enable_profiling on a GPU)")
    per_part: dict[str, float] = defaultdict(float)
    launch_of: list[dict[str, Any] | None] = []
    per_kernel: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    parts: list[str] = []
    for k in gpu:
        args = k.get("args", {})
        launch = launches.get(args.get("correlation"))
        op = ops_by_ext.get(args.get("External id"))
        if op is None and launch is not None:
            op = ops_by_ext.get(launch.get("args", {}).get("External id"))
        chain = _chain(op, parent, by_tid, starts, launch["ts"] if launch else None,
                       launch.get("tid") if launch else None)
        launch_of.append(launch)
        if k["cat"] == "kernel":
            part = classify(k["name"], chain, vocab_min)
        else:  # a copy made by a collective (a simulated world's loopback) is its communication
            part = "comm" if _COMM_OP.search(" ".join(ev["name"] for ev in chain)) else "memory"
        parts.append(part)
        per_part[part] += k["dur"]
        entry = per_kernel[(part, k["name"])]
        entry[0] += k["dur"]
        entry[1] += 1
    spans = [(k["ts"], k["ts"] + k["dur"]) for k in gpu]
    busy = _length(_union(spans))
    wall = max(e for _, e in spans) - min(s for s, _ in spans)
    # Communication time, and the part of it during which no other kernel runs (exposed
    # communication): the union of comm kernels minus the union of the rest.
    comm = _union([(k["ts"], k["ts"] + k["dur"]) for k, part in zip(gpu, parts) if part == "comm"])
    compute = _union([(k["ts"], k["ts"] + k["dur"]) for k, part in zip(gpu, parts) if part != "comm"])
    comm_exposed = _length(comm) - _length(_intersection(comm, compute))
    ms = 1e-3 / steps
    kernels = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    # Where the GPU idles: every gap between busy spans, charged to the (kernel before, kernel after)
    # pair around it and summed over the steps, so a recurring bubble (a host sync, a launch-bound
    # stretch) shows up by its neighbours.
    gaps: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    host: dict[tuple[str, str], float] = defaultdict(float)
    end, last = None, None
    for i in sorted(range(len(gpu)), key=lambda i: gpu[i]["ts"]):
        k = gpu[i]
        if end is not None and k["ts"] > end:
            entry = gaps[(f"{parts[last]}: {gpu[last]['name']}", f"{parts[i]}: {k['name']}")]
            entry[0] += k["ts"] - end
            entry[1] += 1
            launch = launch_of[i]
            if k["ts"] - end >= long_gap_us and launch is not None and launch.get("tid") in by_tid:
                _host_during(end, min(k["ts"], launch["ts"]), by_tid[launch.get("tid")], parent, host)
        if end is None or k["ts"] + k["dur"] > end:
            end, last = k["ts"] + k["dur"], i
    idle_gaps = sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top_gaps]
    return {
        "steps": steps,
        "wall_ms": wall * ms,
        "busy_ms": busy * ms,
        "idle_ms": (wall - busy) * ms,
        "comm_ms": _length(comm) * ms,
        "comm_exposed_ms": comm_exposed * ms,
        "parts_ms": {p: per_part.get(p, 0.0) * ms for p in PARTS},
        "top_kernels": [{"part": p, "name": n, "ms": t * ms, "calls": c / steps} for (p, n), (t, c) in kernels],
        "idle_gaps": [{"after": a, "before": b, "ms": t * ms, "count": c / steps} for (a, b), (t, c) in idle_gaps],
        "long_gap_ms": long_gap_us / 1e3,
        "long_gap_host": [{"within": w, "op": o, "ms": t * ms}
                          for (w, o), t in sorted(host.items(), key=lambda kv: -kv[1])[:top_gaps]],
    }


def _host_during(t0: float, t1: float, evs: list[dict[str, Any]], parent: dict[int, dict[str, Any] | None],
                 out: dict[tuple[str, str], float]) -> None:
    """Charge the host time [t0, t1) of an idle gap (until the launch of the kernel that ends it) to
    the CPU ops of the launching thread that ran then: each op whose parent encloses the whole span
    and that overlaps it, keyed by (that parent's name, its name). A gap the launch did not wait for
    (t1 <= t0) charges nothing; the span outside any op is charged to (parent, "(no op)")."""
    if t1 <= t0:
        return
    enclosing, children = None, []
    for ev in evs:
        s, e = ev["ts"], ev["ts"] + ev.get("dur", 0)
        if s >= t1:
            break
        if e <= t0:
            continue
        if s <= t0 and e >= t1:
            enclosing = ev  # sorted by start, so the last one found is the innermost
        else:
            children.append(ev)
    name = enclosing["name"] if enclosing is not None else "(none)"
    charged = 0.0
    for ev in children:
        if parent.get(id(ev)) is enclosing:
            overlap = min(ev["ts"] + ev.get("dur", 0), t1) - max(ev["ts"], t0)
            out[(name, ev["name"])] += overlap
            charged += overlap
    if t1 - t0 - charged > 0:
        out[(name, "(no op)")] += t1 - t0 - charged


def markdown(report: dict[str, Any]) -> str:
    wall = report["wall_ms"]
    lines = [f"step wall {wall:.1f} ms, GPU busy {report['busy_ms']:.1f} ms, idle {report['idle_ms']:.1f} ms, "
             f"communication {report['comm_ms']:.1f} ms of which exposed {report['comm_exposed_ms']:.1f} ms "
             f"({100 * report['comm_exposed_ms'] / wall:.1f}% of wall) (per step, over {report['steps']} steps)", "",
             "| part | ms / step | % of wall |", "| --- | ---: | ---: |"]
    for part, v in sorted(report["parts_ms"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {part} | {v:.2f} | {100 * v / wall:.1f} |")
    lines.append(f"| idle | {report['idle_ms']:.2f} | {100 * report['idle_ms'] / wall:.1f} |")
    lines += ["", "| kernel | part | ms / step | calls / step |", "| --- | --- | ---: | ---: |"]
    for k in report["top_kernels"]:
        name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
        lines.append(f"| `{name}` | {k['part']} | {k['ms']:.2f} | {k['calls']:g} |")
    if report.get("idle_gaps"):
        cut = lambda n: n if len(n) <= 70 else n[:67] + "..."  # noqa: E731
        lines += ["", "Idle gaps by the kernels around them:", "",
                  "| after | before | idle ms / step | gaps / step |", "| --- | --- | ---: | ---: |"]
        for g in report["idle_gaps"]:
            lines.append(f"| `{cut(g['after'])}` | `{cut(g['before'])}` | {g['ms']:.3f} | {g['count']:g} |")
    if report.get("long_gap_host"):
        lines += ["", f"What the host ran while the GPU idled in gaps of {report['long_gap_ms']:g} ms or more (until the "
                  "next launch):", "",
                  "| inside | op | ms / step |", "| --- | --- | ---: |"]
        for h in report["long_gap_host"]:
            lines.append(f"| `{cut(h['within'])}` | `{cut(h['op'])}` | {h['ms']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_breakdown", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="a Chrome trace written by [profiling] enable_profiling")
    p.add_argument("--steps", type=int, required=True, help="steps in the trace ([profiling] profile_steps)")
    p.add_argument("--vocab-min", type=int, default=100_000, help="a GEMM dim this large marks the output head")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)
    if not args.trace.is_file():
        p.error(f"{args.trace} does not exist: pass the rank<r>_trace.json a profiled run wrote")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    try:
        report = breakdown(json.loads(args.trace.read_text()), args.steps, args.vocab_min, args.top)
    except ValueError as e:
        print(f"error: {args.trace}: {e}", file=sys.stderr)
        return 2
    print(markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
