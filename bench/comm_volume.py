"""Bytes one rank sends per training step, by collective, and the time each takes at link peak.

Computed from the flavor's shapes (``models/qwen3``) and the layout, counting what the code issues
(nothing is measured):

- EP all-to-alls (``parallelisms/expert_parallel.py``): every dispatch and combine sends exactly
  C rows of dim D in the compute dtype (bf16) to every peer, C = ``static_capacity``; the dispatch
  also sends one int64 local expert id per row (forward only: it has no autograd); routing weights
  stay on the source rank. Forward, again in the recomputed forward under full activation
  checkpointing, and the two gradients' all-to-alls in backward (bf16: the rows' dtype).
- Expert weights under EP: w1, w3, w2 all-gathered in bf16 over ``dp_shard_mod_ep`` at every call
  (forward and recomputation), their bf16 gradients reduce-scattered once in backward (the
  all-gather's autograd backward, so not in ``fsdp_reduce_dtype``).
- FSDP2 (``parallelisms/fsdp.py``): per block (the dense parameters; the experts too without EP),
  the embedding, the final norm + output head. All-gather in bf16 in forward and again in backward
  for units resharded after forward; FSDP does not gather again for the recomputation (its
  pre-forward hook returns early while its state is PRE_BACKWARD: the backward's gather serves the
  recompute). Reduce-scatter in ``fsdp_reduce_dtype`` (float32 by default). Dim 0 padded to a
  multiple of the group size, as FSDP2 shards.
- Ring all-gather / reduce-scatter: each rank sends (n-1)/n of the whole tensor; all-to-all: the
  send buffer less the rank's own slice.

Time: ranks are placed node-major (``--gpus-per-node``), so an EP group of 8 is one node and the
expert-shard group (stride ep) has one rank per node. Per call, NVLink and InfiniBand run at once:
time = max(NVLink bytes / NVLink rate, IB bytes / IB rate), summed over calls as if nothing
overlapped (an upper bound on exposed communication; FSDP prefetches and chunked EP overlap some of
it with compute). For a ring over several nodes two figures are given: ``rails``, NCCL's rings
spread over every GPU's NIC (a rank is its node's exit in 1/g of the rings, g = the group's ranks
per node, so sent/g crosses its NIC), and ``one NIC``, every byte at the per-GPU NIC rate (the
slowest link of a single ring). They differ only for groups with several ranks per node.

    python -m bench.comm_volume --preset all                     # the three layouts, markdown
    python -m bench.comm_volume --flavor qwen3_30b_a3b --world 32 --ep 8 --seq-len 16384 --batch 1 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field

import torch

from components.config import Parallelism, Training
from models.qwen3.args import get_model_args
from models.qwen3.model import Qwen3MoE, TransformerBlock
from parallelisms.expert_parallel import static_capacity
from parallelisms.parallel_dims import build_parallel_dims

# Link peaks per GPU and per direction, bytes/s. H200 SXM: NVLink 4, 900 GB/s per GPU counting
# both directions (NVIDIA's H200 page). Inter-node: one 400 Gb/s ConnectX-7 (NDR InfiniBand) per
# GPU, as in the DGX H200 (eight single-port ConnectX-7 for eight GPUs).
NVLINK_BYTES_PER_S = 450e9
IB_BYTES_PER_S = 400e9 / 8
SOURCES = {
    "nvlink": "https://www.nvidia.com/en-us/data-center/h200/",
    "nvlink_mlperf": "https://github.com/mlcommons/inference_results_v4.1/blob/main/closed/NVIDIA/systems/"
                     "H200-SXM-141GBx8_TRT_MaxQ.json",
    "ib": "https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/"
          "latest/core-components.html",
    "ring": "https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md",
}
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# The dispatch's expert ids are built as int64 (``row_expert`` in ExpertParallel._dispatch).
ID_DTYPE = torch.int64

# The shipped configs: train_configs/qwen3_30b_a3b.toml (also at 8 GPUs) and qwen3_235b_a22b.toml.
PRESETS = {
    "30b-8": dict(flavor="qwen3_30b_a3b", world=8, ep=8),
    "30b-32": dict(flavor="qwen3_30b_a3b", world=32, ep=8),
    "235b-128": dict(flavor="qwen3_235b_a22b", world=128, ep=8),
}


@dataclass(frozen=True)
class Layout:
    """One training layout: ``dp_replicate`` = 1, FSDP over all ``world`` ranks, EP ``ep`` within it.
    Defaults are the trainer's (``components/config.py``) and the shipped configs' (full AC)."""

    flavor: str
    world: int
    ep: int
    seq_len: int = 16384
    batch: int = 1
    n_layers: int = 0  # 0: the flavor's depth
    capacity_factor: float = Parallelism.expert_capacity_factor
    reduce_dtype: str = Parallelism.fsdp_reduce_dtype
    reshard_after_forward: str = Parallelism.fsdp_reshard_after_forward
    param_dtype: str = Training.mixed_precision_param
    full_ac: bool = True
    fp8: bool = False  # [precision] moe = fp8_blockwise, linear = fp8_rowwise: checked to send the same bytes
    gpus_per_node: int = 8


@dataclass(frozen=True)
class Collective:
    """One collective issued ``calls`` times per step, each call the same size. Bytes are this rank's."""

    name: str
    kind: str  # all_to_all | all_gather | reduce_scatter
    group: str  # ep | fsdp | dp_shard_mod_ep
    when: str
    calls: int
    tensor_bytes: int  # per call: the send buffer (all-to-all) or the whole gathered / reduced tensor
    sent_bytes: int  # per call: what this rank sends to peers
    nvlink_bytes: int  # per call, of sent_bytes: to ranks of its node
    ib_bytes: int  # per call, of sent_bytes: through its NIC (rails model for rings)
    one_nic_bytes: int  # per call, of sent_bytes: through its NIC if all of a cross-node ring's bytes went there

    def seconds(self, nvlink: float, ib: float, efficiency: float = 1.0) -> float:
        return self.calls * max(self.nvlink_bytes / nvlink, self.ib_bytes / ib) / efficiency

    def one_nic_seconds(self, nvlink: float, ib: float, efficiency: float = 1.0) -> float:
        on_node = self.sent_bytes - self.one_nic_bytes
        return self.calls * max(on_node / nvlink, self.one_nic_bytes / ib) / efficiency


@dataclass
class Report:
    layout: Layout
    derived: dict
    collectives: list[Collective]
    nvlink_bytes_per_s: float = NVLINK_BYTES_PER_S
    ib_bytes_per_s: float = IB_BYTES_PER_S
    efficiency: float = 1.0
    notes: list[str] = field(default_factory=list)

    def seconds(self, c: Collective) -> float:
        return c.seconds(self.nvlink_bytes_per_s, self.ib_bytes_per_s, self.efficiency)

    def one_nic_seconds(self, c: Collective) -> float:
        return c.one_nic_seconds(self.nvlink_bytes_per_s, self.ib_bytes_per_s, self.efficiency)

    def totals(self) -> dict:
        cs = self.collectives
        return {
            "sent_bytes": sum(c.calls * c.sent_bytes for c in cs),
            "tensor_bytes": sum(c.calls * c.tensor_bytes for c in cs),
            "nvlink_bytes": sum(c.calls * c.nvlink_bytes for c in cs),
            "ib_bytes": sum(c.calls * c.ib_bytes for c in cs),
            "seconds": sum(self.seconds(c) for c in cs),
            "one_nic_seconds": sum(self.one_nic_seconds(c) for c in cs),
            "by_group_seconds": {g: sum(self.seconds(c) for c in cs if c.group == g)
                                 for g in dict.fromkeys(c.group for c in cs)},
        }

    def to_json(self) -> dict:
        rows = [dict(dataclasses.asdict(c), seconds=self.seconds(c), one_nic_seconds=self.one_nic_seconds(c))
                for c in self.collectives]
        return {"layout": dataclasses.asdict(self.layout), "derived": self.derived, "collectives": rows,
                "totals": self.totals(), "links": {"nvlink_bytes_per_s": self.nvlink_bytes_per_s,
                                                   "ib_bytes_per_s": self.ib_bytes_per_s,
                                                   "efficiency": self.efficiency, "sources": SOURCES},
                "notes": self.notes}


def ring_tensor_numel(shape: tuple[int, ...], n: int) -> int:
    """Elements of a tensor as FSDP2 all-gathers / reduce-scatters it over n ranks: dim 0 padded
    up to a multiple of n (every rank holds an equal shard)."""
    rest = math.prod(shape[1:])
    return math.ceil(shape[0] / n) * n * rest


def _group_placement(members: list[int], gpus_per_node: int) -> tuple[int, int]:
    """(ranks of the group on the first member's node, nodes the group spans)."""
    nodes = [r // gpus_per_node for r in members]
    return nodes.count(nodes[0]), len(set(nodes))


def _ring(name: str, kind: str, group: str, when: str, calls: int, tensor_bytes: int, n: int,
          placement: tuple[int, int]) -> Collective:
    sent = tensor_bytes * (n - 1) // n
    on_node, nodes = placement
    if nodes == 1:
        nvlink, ib, one_nic = sent, 0, 0
    else:
        # NCCL's rings take turns leaving the node through each member's NIC: 1/on_node of the bytes each.
        ib = round(sent / on_node)
        nvlink, one_nic = sent - ib, sent
    return Collective(name, kind, group, when, calls, tensor_bytes, sent, nvlink, ib, one_nic)


def _all_to_all(name: str, when: str, calls: int, row_bytes: int, rows_per_peer: int, ep: int,
                placement: tuple[int, int]) -> Collective:
    on_node, _ = placement
    slice_bytes = rows_per_peer * row_bytes
    nvlink, ib = (on_node - 1) * slice_bytes, (ep - on_node) * slice_bytes
    return Collective(name, "all_to_all", "ep", when, calls, ep * slice_bytes, nvlink + ib, nvlink, ib, ib)


def _check(layout: Layout, args, dims) -> None:
    if layout.seq_len < 1 or layout.batch < 1:
        raise ValueError(f"seq_len ({layout.seq_len}) and batch ({layout.batch}) must be at least 1")
    if layout.gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be at least 1, got {layout.gpus_per_node}")
    if layout.world > layout.gpus_per_node and layout.world % layout.gpus_per_node:
        raise ValueError(f"world {layout.world} is not a whole number of {layout.gpus_per_node}-GPU nodes")
    for key, choices in (("reduce_dtype", _DTYPES), ("param_dtype", _DTYPES),
                         ("reshard_after_forward", ("default", "always", "never"))):
        if getattr(layout, key) not in choices:
            raise ValueError(f"{key} = {getattr(layout, key)!r}: one of {', '.join(choices)}")
    shard = dims.dp_shard_mod_ep
    for dim in (args.moe_inter_dim, args.dim):
        if dims.ep_enabled and dim % shard:
            raise ValueError(f"expert weights: dim {dim} is not divisible by the {shard} ranks that shard each "
                             f"expert group (world / ep), which apply_ep requires")


def comm_volume(layout: Layout, efficiency: float = 1.0, nvlink_bytes_per_s: float = NVLINK_BYTES_PER_S,
                ib_bytes_per_s: float = IB_BYTES_PER_S) -> Report:
    """The collectives one rank issues in one training step of ``layout`` (one micro-batch), with
    their bytes; raises ValueError (the trainer's own ConfigError where it would refuse) for a
    layout the trainer cannot run."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    args = get_model_args(layout.flavor, n_layers=layout.n_layers)
    dims = build_parallel_dims(Parallelism(expert_parallel_degree=layout.ep), layout.world, args.num_experts)
    _check(layout, args, dims)
    L, D, K, E, n, ep = args.n_layers, args.dim, args.top_k, args.num_experts, layout.world, dims.ep
    shard = dims.dp_shard_mod_ep
    param = _DTYPES[layout.param_dtype].itemsize
    pd = {"bfloat16": "bf16", "float32": "fp32"}[layout.param_dtype]
    reduce = _DTYPES[layout.reduce_dtype].itemsize
    passes = 2 if layout.full_ac else 1  # forward, and its recomputation in backward
    fwd = "fwd + recompute" if layout.full_ac else "fwd"
    gpn = layout.gpus_per_node
    # Rank 0's groups: the mesh is (dp_replicate, dp_shard_mod_ep, ep) with ranks in row-major order.
    fsdp_at = _group_placement(list(range(n)), gpn)
    ep_at = _group_placement(list(range(ep)), gpn)
    shard_at = _group_placement(list(range(0, n, ep)), gpn)

    # Shapes from the model itself, on the meta device: one block, and the model without blocks.
    with torch.device("meta"):
        block = TransformerBlock(0, args, "torch", use_expert_bias=False)
        rest = Qwen3MoE(dataclasses.replace(args, n_layers=0), "torch")
    # Without EP, FSDP gathers the experts with the rest of the block.
    dense = [tuple(p.shape) for name, p in block.named_parameters()
             if not (dims.ep_enabled and name.startswith("moe.experts."))]
    units = {"tok_embeddings": [tuple(p.shape) for p in rest.tok_embeddings.parameters()],
             "norm + output": [tuple(p.shape) for m in (rest.norm, rest.output) for p in m.parameters()]}

    rows: list[Collective] = []
    T = layout.batch * layout.seq_len
    C = static_capacity(T, K, ep, E // ep, layout.capacity_factor) if dims.ep_enabled else 0
    if dims.ep_enabled:
        row = D * param
        rows += [
            _all_to_all(f"EP dispatch: token rows ({pd})", fwd, passes * L, row, C, ep, ep_at),
            _all_to_all("EP dispatch: expert ids (int64)", fwd, passes * L, ID_DTYPE.itemsize, C, ep, ep_at),
            _all_to_all(f"EP combine: expert output rows ({pd})", fwd, passes * L, row, C, ep, ep_at),
            _all_to_all(f"EP gradients of combine and dispatch ({pd})", "bwd", 2 * L, row, C, ep, ep_at),
        ]
        if shard > 1:
            # Each of w1, w3, w2 holds (E/ep) x F x D elements of this rank's experts.
            whole = (E // ep) * args.moe_inter_dim * D * param
            rows += [
                _ring(f"expert weights all-gather ({pd}, w1 w3 w2)", "all_gather", "dp_shard_mod_ep", fwd,
                      passes * 3 * L, whole, shard, shard_at),
                _ring(f"expert gradients reduce-scatter ({pd})", "reduce_scatter", "dp_shard_mod_ep", "bwd",
                      3 * L, whole, shard, shard_at),
            ]
    block_numel = sum(ring_tensor_numel(s, n) for s in dense)
    resharded = {"default": L - 1, "always": L, "never": 0}[layout.reshard_after_forward]
    label = "block params" if dims.ep_enabled else "block params (experts included)"
    rows += [
        _ring(f"FSDP {label} all-gather ({pd})", "all_gather", "fsdp", "fwd", L, block_numel * param, n, fsdp_at),
        _ring(f"FSDP {label} all-gather ({pd})", "all_gather", "fsdp", "bwd", resharded, block_numel * param, n,
              fsdp_at),
        _ring(f"FSDP block grads reduce-scatter ({layout.reduce_dtype})", "reduce_scatter", "fsdp", "bwd", L,
              block_numel * reduce, n, fsdp_at),
    ]
    # The embedding is resharded after forward (gathered again in backward); norm + output are not.
    for unit, gathers in (("tok_embeddings", 2), ("norm + output", 1)):
        numel = sum(ring_tensor_numel(s, n) for s in units[unit])
        when = "fwd + bwd" if gathers == 2 else "fwd"
        rows += [
            _ring(f"FSDP {unit} all-gather ({pd})", "all_gather", "fsdp", when, gathers, numel * param, n, fsdp_at),
            _ring(f"FSDP {unit} grads reduce-scatter ({layout.reduce_dtype})", "reduce_scatter", "fsdp", "bwd", 1,
                  numel * reduce, n, fsdp_at),
        ]
    rows = [r for r in rows if r.calls and r.sent_bytes]

    derived = {"n_layers": L, "dim": D, "moe_inter_dim": args.moe_inter_dim, "num_experts": E, "top_k": K,
               "vocab_size": args.vocab_size, "tokens_per_rank": T, "capacity_rows_per_peer": C,
               "real_rows_per_peer_balanced": T * K / ep if dims.ep_enabled else 0,
               "dp_shard": dims.dp_shard, "dp_shard_mod_ep": shard, "nodes": fsdp_at[1],
               "block_fsdp_numel": block_numel, "ep_peers_on_node": ep_at[0] - 1,
               "ep_peers_off_node": ep - ep_at[0], "expert_shard_ranks_per_node": shard_at[0],
               "fsdp_ranks_per_node": fsdp_at[0]}
    report = Report(layout, derived, rows, nvlink_bytes_per_s, ib_bytes_per_s, efficiency)
    report.notes = _notes(layout, derived)
    return report


def _notes(layout: Layout, d: dict) -> list[str]:
    notes = []
    if d["capacity_rows_per_peer"]:
        notes.append(f"C = {d['capacity_rows_per_peer']} rows per peer per all-to-all, every layer, whatever the "
                     f"routing (static buffers); at balanced routing {d['real_rows_per_peer_balanced']:.0f} of them "
                     f"are real (capacity factor {layout.capacity_factor}).")
    if layout.fp8:
        notes.append("FP8 ([precision] moe = fp8_blockwise, linear = fp8_rowwise) sends the same bytes: rows are "
                     "quantized by the expert kernels after the dispatch, FSDP gathers the FP8 linears' weights in "
                     "bf16, and the expert all-gather is bf16 (there is no FP8 all-gather; without expert sharding "
                     "the e4m3 copies are made locally).")
    if not layout.full_ac:
        notes.append("No activation checkpointing: nothing is recomputed, each forward collective runs once.")
    return notes


def _gb(b: float) -> str:
    return f"{b / 1e9:,.3f}"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


def to_markdown(report: Report) -> str:
    lay, d, t = report.layout, report.derived, report.totals()
    nodes = d["nodes"]
    head = (f"### {lay.flavor}, {d['n_layers']} layers, {lay.world} GPUs ({nodes} node{'s' * (nodes > 1)} of "
            f"{min(lay.world, lay.gpus_per_node)}): FSDP {d['dp_shard']}, EP {lay.ep}, expert shards "
            f"{d['dp_shard_mod_ep']}; T = {d['tokens_per_rank']} tokens per rank "
            f"(seq {lay.seq_len} x batch {lay.batch}), top-{d['top_k']}"
            f"{', full AC' if lay.full_ac else ''}{', FP8' if lay.fp8 else ''}")
    lines = [head, "",
             "| collective | when | calls | GB per call (whole buffer) | GB sent per rank per step "
             "| of which via NIC (rails) | group (ranks per node x nodes) | ms at link peak (rails) | ms, one NIC |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    sizes = {"ep": (lay.ep, d["ep_peers_on_node"] + 1), "fsdp": (d["dp_shard"], d["fsdp_ranks_per_node"]),
             "dp_shard_mod_ep": (d["dp_shard_mod_ep"], d["expert_shard_ranks_per_node"])}
    for c in report.collectives:
        size, per_node = sizes[c.group]
        where = f"{c.group} {size}: {per_node} x {size // per_node}"
        lines.append(f"| {c.name} | {c.when} | {c.calls} | {_gb(c.tensor_bytes)} | {_gb(c.calls * c.sent_bytes)} | "
                     f"{_gb(c.calls * c.ib_bytes)} | {where} | {_ms(report.seconds(c))} | "
                     f"{_ms(report.one_nic_seconds(c))} |")
    lines.append(f"| **total** | | | | **{_gb(t['sent_bytes'])}** | **{_gb(t['ib_bytes'])}** | | "
                 f"**{_ms(t['seconds'])}** | **{_ms(t['one_nic_seconds'])}** |")
    by_group = ", ".join(f"{g} {_ms(s)} ms" for g, s in t["by_group_seconds"].items())
    lines += ["", f"By group (rails): {by_group}. Links: NVLink {report.nvlink_bytes_per_s / 1e9:.0f} GB/s, "
                  f"NIC {report.ib_bytes_per_s / 1e9:.0f} GB/s per GPU and direction, efficiency "
                  f"{report.efficiency:g}."]
    lines += [f"- {note}" for note in report.notes]
    return "\n".join(lines)


def summary_markdown(reports: list[Report]) -> str:
    """One row per layout: its totals, and the time per group at link peak (rails)."""
    lines = ["| layout | GB sent per rank per step | of which via NIC (rails) | ms at link peak (rails) | "
             "ms, one NIC | ms: EP all-to-alls / expert shards / FSDP |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in reports:
        t, lay = r.totals(), r.layout
        groups = " / ".join(_ms(t["by_group_seconds"].get(g, 0.0)) for g in ("ep", "dp_shard_mod_ep", "fsdp"))
        lines.append(f"| {lay.flavor}, {lay.world} GPUs, EP {lay.ep} | {_gb(t['sent_bytes'])} | {_gb(t['ib_bytes'])} | "
                     f"{_ms(t['seconds'])} | {_ms(t['one_nic_seconds'])} | {groups} |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.comm_volume", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--preset", choices=[*PRESETS, "all"], help="a shipped layout (overrides --flavor/--world/--ep)")
    p.add_argument("--flavor", default="qwen3_30b_a3b")
    p.add_argument("--world", type=int, default=32)
    p.add_argument("--ep", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--batch", type=int, default=1, help="local batch size (sequences per rank)")
    p.add_argument("--layers", type=int, default=0, help="0: the flavor's depth")
    p.add_argument("--capacity-factor", type=float, default=Layout.capacity_factor)
    p.add_argument("--reduce-dtype", default=Layout.reduce_dtype, choices=sorted(_DTYPES))
    p.add_argument("--reshard-after-forward", default=Layout.reshard_after_forward,
                   choices=("default", "always", "never"))
    p.add_argument("--no-ac", action="store_true", help="no activation checkpointing (default: full)")
    p.add_argument("--fp8", action="store_true", help="the shipped [precision] settings (same bytes; noted)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nvlink-gbps", type=float, default=NVLINK_BYTES_PER_S / 1e9, help="GB/s per GPU and direction")
    p.add_argument("--ib-gbps", type=float, default=IB_BYTES_PER_S / 1e9, help="GB/s per GPU and direction")
    p.add_argument("--efficiency", type=float, default=1.0,
                   help="fraction of link peak reached (an assumption; 1.0 = peak)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH", help="write JSON to PATH ('-' or no value: stdout)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Report]:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    common = dict(seq_len=a.seq_len, batch=a.batch, n_layers=a.layers, capacity_factor=a.capacity_factor,
                  reduce_dtype=a.reduce_dtype, reshard_after_forward=a.reshard_after_forward, full_ac=not a.no_ac,
                  fp8=a.fp8, gpus_per_node=a.gpus_per_node)
    if a.preset:
        layouts = [Layout(**PRESETS[k], **common) for k in (PRESETS if a.preset == "all" else [a.preset])]
    else:
        layouts = [Layout(a.flavor, a.world, a.ep, **common)]
    reports = [comm_volume(lay, a.efficiency, a.nvlink_gbps * 1e9, a.ib_gbps * 1e9) for lay in layouts]
    payload = [r.to_json() for r in reports]
    if a.json == "-":
        print(json.dumps(payload if len(payload) > 1 else payload[0], indent=1))
        return reports
    print("\n\n".join([to_markdown(r) for r in reports] + ([summary_markdown(reports)] if len(reports) > 1 else [])))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(payload if len(payload) > 1 else payload[0], f, indent=1)
    return reports


if __name__ == "__main__":
    main()
