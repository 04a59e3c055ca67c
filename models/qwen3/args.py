"""Qwen3-MoE model arguments and the named size presets (flavors)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class Qwen3MoEArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # Qwen3 decouples head_dim from dim / n_heads
    vocab_size: int
    moe_inter_dim: int  # F: hidden size of each expert's SwiGLU
    num_experts: int
    top_k: int
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_seq_len: int = 40960

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be in [1, num_experts={self.num_experts}]")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")


# Published shapes (Qwen3 technical report / the released config.json files).
FLAVORS: dict[str, Qwen3MoEArgs] = {
    # Tiny: trains in seconds on a laptop CPU; vocab matches the shipped 2048-token tokenizer.
    "debug": Qwen3MoEArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32, vocab_size=2048,
                          moe_inter_dim=128, num_experts=8, top_k=2, max_seq_len=4096),
    "qwen3_30b_a3b": Qwen3MoEArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                                  vocab_size=151936, moe_inter_dim=768, num_experts=128, top_k=8),
    "qwen3_235b_a22b": Qwen3MoEArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128,
                                    vocab_size=151936, moe_inter_dim=1536, num_experts=128, top_k=8),
}


def get_model_args(flavor: str, *, n_layers: int = 0, rope_theta: float | None = None,
                   max_seq_len: int | None = None) -> Qwen3MoEArgs:
    """The flavor's args with the job's overrides (``n_layers`` 0 keeps the flavor's depth)."""
    if flavor not in FLAVORS:
        raise ValueError(f"unknown Qwen3-MoE flavor {flavor!r}; known: {', '.join(FLAVORS)}")
    overrides = {}
    if n_layers:
        overrides["n_layers"] = n_layers
    if rope_theta is not None:
        overrides["rope_theta"] = rope_theta
    if max_seq_len is not None:
        overrides["max_seq_len"] = max(max_seq_len, 1)
    return dataclasses.replace(FLAVORS[flavor], **overrides)
