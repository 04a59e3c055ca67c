"""Parallel degrees from ``[parallelism]``, checked against the world size, and the device mesh.

Expert parallelism borrows its ranks from FSDP's shard dimension (TorchTitan's "dp2ep"): with
``dp_shard = 8`` and ``ep = 4``, the 8 shard ranks form 2 groups of 4; within a group each rank
owns E/4 experts, and the same experts are FSDP-sharded over the 2 groups. The mesh is

    (dp_replicate, dp_shard_mod_ep, ep)      with dp_shard = dp_shard_mod_ep x ep

and the submeshes used are:

- ``dp``: (dp_replicate, dp_shard_mod_ep, ep) flattened: data loading (each rank its own samples)
- ``fsdp``: (dp_replicate, dp_shard_mod_ep x ep) -- HSDP for the dense parameters
- ``dp_shard_mod_ep``: the ranks that hold the same experts and shard them (expert_parallel.py)
- ``ep``: the expert-parallel group (token all-to-all)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from components.config import ConfigError, Parallelism


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    ep: int
    world_size: int
    device_type: str = "cpu"

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.dp_shard // self.ep

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @cached_property
    def mesh(self):
        """The world mesh with the flattened submeshes registered (see the module docstring)."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.device_type, (self.dp_replicate, self.dp_shard_mod_ep, self.ep),
                                mesh_dim_names=("dp_replicate", "dp_shard_mod_ep", "ep"))
        mesh["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp")
        mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        return mesh

    @property
    def dp_mesh(self):
        return self.mesh["dp"]

    @property
    def fsdp_mesh(self):
        return self.mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else self.mesh["dp_shard"]



def build_parallel_dims(cfg: Parallelism, world_size: int, num_experts: int, device_type: str = "cpu") -> ParallelDims:
    """Resolve -1 degrees and refuse combinations that cannot work, naming the numbers that conflict."""
    replicate, dp_shard, ep = cfg.data_parallel_replicate_degree, cfg.data_parallel_shard_degree, cfg.expert_parallel_degree
    simulated = " ([parallelism] simulate_world_size)" if cfg.simulate_world_size > 1 else ""
    if dp_shard == -1:
        if world_size % replicate:
            raise ConfigError(f"[parallelism] data_parallel_replicate_degree = {replicate} does not divide the "
                              f"world size {world_size}{simulated}")
        dp_shard = world_size // replicate
    if replicate * dp_shard != world_size:
        raise ConfigError(
            f"[parallelism] data_parallel_replicate_degree ({replicate}) x data_parallel_shard_degree ({dp_shard}) "
            f"= {replicate * dp_shard} must equal the world size ({world_size}){simulated}")
    if num_experts % ep:
        raise ConfigError(f"[parallelism] expert_parallel_degree = {ep} does not divide the {num_experts} experts")
    if ep > dp_shard:
        raise ConfigError(f"[parallelism] expert_parallel_degree = {ep} is larger than the data-parallel shard "
                          f"degree {dp_shard}: EP borrows its ranks from FSDP's shard dimension")
    if dp_shard % ep:
        raise ConfigError(f"[parallelism] expert_parallel_degree = {ep} does not divide the data-parallel shard "
                          f"degree {dp_shard}: EP groups are carved out of the FSDP shard ranks")
    return ParallelDims(replicate, dp_shard, ep, world_size, device_type)
