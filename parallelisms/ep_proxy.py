"""A one-process proxy of expert parallelism: the compute of one EP rank on one device
(``[experimental] simulate_expert_parallel_degree = P``; docs/expert_parallel.md).

In an EP job of degree P, rank r owns experts [r E/P, (r+1) E/P) and receives from every rank the
(token, k) slots routed to them, as local ids e - r E/P (:func:`~parallelisms.expert_parallel.local_expert_ids`).
The proxy keeps the router whole (it scores all E experts, top-k over E, aux loss as usual), gives
each layer only E/P experts (rank 0's, parameters shaped (E/P, ...)) and sends each slot of global
expert e to local expert e mod (E/P), the id e has on its owner. Each local expert then receives
~T K / (E/P) rows: what rank 0 receives when every rank's tokens route like this process's. The MoE
backend runs on those shapes; the routing weights are applied as without EP.

Not simulated: the dispatch and combine all-to-alls, FSDP's collectives, the empty rows of EP's
static-capacity receive buffers, and imbalance between ranks (the proxy's local expert j gets this
process's slots of experts j, j + E/P, ..., so every simulated rank receives exactly T K rows).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from components.config import ConfigError, JobConfig
from parallelisms.expert_parallel import local_expert_ids


class SimulatedExpertParallel:
    """Stands in for :class:`~parallelisms.expert_parallel.ExpertParallel` as ``GroupedExperts.expert_parallel``:
    no collectives; the slots of all E experts are folded onto the E/P held here."""

    def __init__(self, degree: int, num_experts: int):
        self.degree = degree
        self.num_experts = num_experts
        self.num_local_experts = num_experts // degree
        self.experts_whole = True  # what the compute-weight copies ask (components/compute_weights.py)

    def gather_weight(self, w: torch.Tensor) -> torch.Tensor:
        return w  # one process holds its experts whole, as a plain parameter

    def gather_shards(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def __call__(self, backend, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                 w1_local: torch.Tensor, w3_local: torch.Tensor, w2_local: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(y_TD, dropped_E) as ``ExpertParallel`` returns them; nothing is dropped."""
        local_ids_TK = local_expert_ids(topk_ids_TK, self.num_local_experts)
        y_TD = backend(x_TD, local_ids_TK, topk_weights_TK, w1_local, w3_local, w2_local)
        return y_TD, torch.zeros(self.num_experts, dtype=torch.float32, device=x_TD.device)


def apply_ep_proxy(model: nn.Module, degree: int) -> None:
    """Every layer keeps the first E/``degree`` experts (those rank 0 of an EP-``degree`` job owns;
    their values too, on a materialised model) and folds its routed slots onto them. Call on the
    meta-device model, in place of ``apply_ep``."""
    for block in model.layers.values():
        experts = block.moe.experts
        if experts.expert_parallel is not None:
            raise ValueError("the experts are already expert-parallel: the proxy replaces expert parallelism")
        if experts.num_experts % degree:
            raise ValueError(f"simulated expert parallelism {degree} does not divide the {experts.num_experts} experts")
        n_local = experts.num_experts // degree
        for name in ("w1", "w2", "w3"):
            held = getattr(experts, name).detach()[:n_local].clone()
            experts.register_parameter(name, nn.Parameter(held))
        experts.expert_parallel = SimulatedExpertParallel(degree, experts.num_experts)


def check_ep_proxy(cfg: JobConfig, world_size: int, distributed: bool, num_experts: int, flavor: str) -> None:
    """Refuse what the proxy cannot represent, naming the keys and the fix."""
    degree = cfg.experimental.simulate_expert_parallel_degree
    if degree == 1:
        return
    key = f"[experimental] simulate_expert_parallel_degree = {degree}"
    if num_experts % degree:
        divisors = ", ".join(str(d) for d in range(2, num_experts + 1) if num_experts % d == 0)
        raise ConfigError(f"{key} does not divide the {num_experts} experts of the {flavor} model (each simulated "
                          f"rank holds E/P of them); choose one of {divisors}")
    ep = cfg.parallelism.expert_parallel_degree
    if ep > 1:
        raise ConfigError(f"{key} simulates expert parallelism in one process and cannot run with real expert "
                          f"parallelism ([parallelism] expert_parallel_degree = {ep}); set one of them to 1")
    if distributed or world_size > 1:
        raise ConfigError(f"{key} runs one rank's compute in a single process, and this run has {world_size} "
                          f"rank{'s' if world_size > 1 else ''} under torchrun; start it as one process "
                          f"(python train.py ...), or drop the key to train on the ranks")
    chunks = cfg.experimental.expert_parallel_chunks
    if chunks > 1:
        raise ConfigError(f"{key} with [experimental] expert_parallel_chunks = {chunks}: the proxy runs each "
                          f"layer's experts once over all its tokens and does not simulate chunked EP; set "
                          f"expert_parallel_chunks = 1")
    c = cfg.checkpoint
    if c.initial_load_path and c.initial_load_format == "hf":
        raise ConfigError(f"{key} with [checkpoint] initial_load_format = \"hf\": a Hugging Face checkpoint holds "
                          f"all {num_experts} experts of each layer and the proxy {num_experts // degree}, so it is "
                          f"not imported; leave [checkpoint] initial_load_path empty (the proxy starts from "
                          f"random weights)")


def ep_proxy_label(degree: int) -> str:
    """What a proxy run stands in for, as its closing summary names it (``MetricsLogger.proxy``)."""
    return f"one rank of expert parallelism {degree}, without its collectives"


def describe_ep_proxy(degree: int, num_experts: int) -> str:
    """The line that says at the start that the run is a proxy (printed after the header)."""
    return (f"simulating one rank of expert parallelism {degree}: {num_experts // degree} of {num_experts} experts "
            f"per layer, tokens folded onto them; times exclude the all-to-all and FSDP collectives")
