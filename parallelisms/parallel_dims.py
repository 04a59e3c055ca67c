"""Parallel degrees from ``[parallelism]``, checked against the world size.

Only a single process is implemented so far; the multi-process paths (FSDP2, expert parallelism)
come with the parallelisms issue. Until then, every setting that would need them is refused at
start with a message that says so, rather than silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from components.config import ConfigError, Parallelism


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    ep: int
    world_size: int

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard


def build_parallel_dims(cfg: Parallelism, world_size: int, num_experts: int) -> ParallelDims:
    for key in ("tensor_parallel_degree", "context_parallel_degree", "pipeline_parallel_degree"):
        if getattr(cfg, key) > 1:
            raise ConfigError(f"[parallelism] {key} = {getattr(cfg, key)}: not implemented; set it to 1")
    dp_shard = cfg.data_parallel_shard_degree
    if dp_shard == -1:
        if world_size % cfg.data_parallel_replicate_degree:
            raise ConfigError(
                f"[parallelism] data_parallel_replicate_degree = {cfg.data_parallel_replicate_degree} does not "
                f"divide the world size {world_size}")
        dp_shard = world_size // cfg.data_parallel_replicate_degree
    if cfg.data_parallel_replicate_degree * dp_shard != world_size:
        raise ConfigError(
            f"[parallelism] data_parallel_replicate_degree ({cfg.data_parallel_replicate_degree}) x "
            f"data_parallel_shard_degree ({dp_shard}) = {cfg.data_parallel_replicate_degree * dp_shard} "
            f"must equal the world size ({world_size})")
    ep = cfg.expert_parallel_degree
    if num_experts % ep:
        raise ConfigError(f"[parallelism] expert_parallel_degree = {ep} does not divide the {num_experts} experts")
    if ep > dp_shard:
        raise ConfigError(f"[parallelism] expert_parallel_degree = {ep} is larger than the data-parallel shard "
                          f"degree {dp_shard}: EP borrows its ranks from FSDP")
    if world_size > 1 or ep > 1:
        raise ConfigError(
            f"multi-process training (world size {world_size}, expert_parallel_degree {ep}) is not implemented "
            "yet: FSDP2 and expert parallelism come with the parallelisms issue; run with one process")
    return ParallelDims(cfg.data_parallel_replicate_degree, dp_shard, ep, world_size)
