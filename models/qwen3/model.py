"""Qwen3-MoE, as published: RMSNorm, grouped-query attention with QK-norm and RoPE, causal SDPA,
untied embedding and output, a top-k routed SwiGLU MoE in every block, no shared experts.

Built on the meta device and materialised by ``init_weights`` (TorchTitan's pattern), so that
parallelisms can be applied before any memory is allocated:

    with torch.device("meta"):
        model = Qwen3MoE(args, moe_backend="grouped_mm")
    model.to_empty(device="cuda")
    model.init_weights()
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.moe import BackendArgs
from models.loss import linear_cross_entropy
from models.moe.moe import MoE, depth_init_std
from models.moe.router import router_aux_loss
from models.qwen3.args import Qwen3MoEArgs


class RMSNorm(nn.Module):
    """Normalises in float32 and casts back, as Qwen3 does, so bf16 inputs lose no precision here."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_cos_sin(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables (max_seq_len, head_dim) for the rotate-half RoPE layout of Qwen/Llama HF models."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles_LH = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=device), inv_freq)
    angles_LH = torch.cat([angles_LH, angles_LH], dim=-1)
    return angles_LH.cos(), angles_LH.sin()


def apply_rope(x_BLHd: torch.Tensor, cos_Ld: torch.Tensor, sin_Ld: torch.Tensor) -> torch.Tensor:
    half = x_BLHd.shape[-1] // 2
    x1, x2 = x_BLHd[..., :half], x_BLHd[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    cos = cos_Ld[None, :, None, :]
    sin = sin_Ld[None, :, None, :]
    return (x_BLHd.float() * cos + rotated.float() * sin).to(x_BLHd.dtype)


# SDPA kernel preference per ``[model] attention_backend``; "auto" leaves the choice to SDPA. A
# preferred kernel that cannot run a given call falls through to the next in the list.
ATTENTION_BACKENDS = {
    "auto": None,
    "cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "math": [SDPBackend.MATH],
}


class Attention(nn.Module):
    def __init__(self, args: Qwen3MoEArgs, attention_backend: str = "auto"):
        super().__init__()
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {attention_backend!r}; known: {', '.join(ATTENTION_BACKENDS)}")
        self.sdpa_backends = ATTENTION_BACKENDS[attention_backend]
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        # A bool fixed here, not compared per call: once a process has compiled blocks of another
        # width, dynamo makes int module attributes symbolic, and SDPA's enable_gqa takes no SymBool.
        self.gqa = args.n_heads != args.n_kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # QK-norm: per-head RMSNorm over head_dim, before RoPE.
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def forward(self, x_BLD: torch.Tensor, cos_Ld: torch.Tensor, sin_Ld: torch.Tensor) -> torch.Tensor:
        return self.project_out(self.attend(*self.project_qkv(x_BLD, cos_Ld, sin_Ld)))

    def project_qkv(self, x_BLD: torch.Tensor, cos_Ld: torch.Tensor, sin_Ld: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, L, d), k and v (B, Hkv, L, d): projected, QK-normed, rotated."""
        B, L, _ = x_BLD.shape
        q = self.q_norm(self.wq(x_BLD).view(B, L, self.n_heads, self.head_dim))
        k = self.k_norm(self.wk(x_BLD).view(B, L, self.n_kv_heads, self.head_dim))
        v = self.wv(x_BLD).view(B, L, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos_Ld, sin_Ld), apply_rope(k, cos_Ld, sin_Ld)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal SDPA: (B, H, L, d)."""
        if self.sdpa_backends is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)
        with sdpa_kernel(self.sdpa_backends, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)

    def project_out(self, out_BHLd: torch.Tensor) -> torch.Tensor:
        B, _, L, _ = out_BHLd.shape
        return self.wo(out_BHLd.transpose(1, 2).reshape(B, L, self.n_heads * self.head_dim))

    def reset_parameters(self, init_std: float, out_init_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_init_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Qwen3MoEArgs, moe_backend: str, use_expert_bias: bool,
                 attention_backend: str = "auto", moe_args: BackendArgs = BackendArgs()):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, attention_backend)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = MoE(args.dim, args.moe_inter_dim, args.num_experts, args.top_k, args.norm_topk_prob,
                       moe_backend, use_expert_bias, moe_args)

    def forward(self, h_BLD: torch.Tensor, cos_Ld: torch.Tensor, sin_Ld: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (h_BLD, router_stats_3E). Written as the stages below, which activation
        checkpointing recomposes to keep some ops' outputs (``parallelisms/activation_checkpoint.py``)."""
        return self.after_attention(h_BLD, self.attention.attend(*self.qkv(h_BLD, cos_Ld, sin_Ld)))

    def qkv(self, h_BLD: torch.Tensor, cos_Ld: torch.Tensor, sin_Ld: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention core's inputs: q (B, H, L, d), k and v (B, Hkv, L, d)."""
        return self.attention.project_qkv(self.attention_norm(h_BLD), cos_Ld, sin_Ld)

    def after_attention(self, h_BLD: torch.Tensor, attn_BHLd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From the attention core's output to the block's: (h_BLD, router_stats_3E)."""
        h_BLD = h_BLD + self.attention.project_out(attn_BHLd)
        moe_BLD, router_stats_3E = self.moe(self.ffn_norm(h_BLD))
        return h_BLD + moe_BLD, router_stats_3E

    def after_attention_to_router(self, h_BLD: torch.Tensor, attn_BHLd: torch.Tensor
                                  ) -> tuple[torch.Tensor, ...]:
        """:meth:`after_attention` up to the routed experts: (h_BLD, *``MoE.route``'s outputs);
        ``self.moe.run_experts(h_BLD.shape, *routed)`` and the residual add finish the block."""
        h_BLD = h_BLD + self.attention.project_out(attn_BHLd)
        return (h_BLD, *self.moe.route(self.ffn_norm(h_BLD)))

    def init_weights(self) -> None:
        out_std = depth_init_std(self.layer_id)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.reset_parameters(0.02, out_std)
        self.moe.reset_parameters(0.02, out_std)


class Qwen3MoE(nn.Module):
    def __init__(self, args: Qwen3MoEArgs, moe_backend: str = "grouped_mm", use_expert_bias: bool = False,
                 attention_backend: str = "auto", moe_args: BackendArgs = BackendArgs()):
        """``moe_backend`` and ``moe_args``: every layer's experts' backend and its arguments
        (``kernels/moe/__init__.py``)."""
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by index keeps FQNs stable when blocks are wrapped (AC, compile, FSDP).
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args, moe_backend, use_expert_bias, attention_backend, moe_args)
             for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_cos_sin(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens_BL: torch.Tensor, labels_BL: torch.Tensor | None = None, loss_chunk_size: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logits_BLV, router_stats_L3E): per layer the routed-slot counts per expert, the
        summed router probabilities and the slots dropped by EP capacity (see ``MoE.forward``).

        With ``labels_BL`` and ``loss_chunk_size`` > 0 it returns the mean cross-entropy instead of
        the logits, computed chunk by chunk so the (B, L, V) logits never exist
        (``models/loss.py``). It is computed here, inside the model, so that FSDP has gathered
        the output weight (it is sharded together with the final norm). The weight is the output
        head's ``compute_weight`` when the precision step gave it one (its bf16 compute copy,
        ``components/precision``), else its parameter."""
        L = tokens_BL.shape[1]
        if L > self.args.max_seq_len:
            raise ValueError(f"sequence length {L} exceeds max_seq_len {self.args.max_seq_len}")
        cos, sin = self.rope_cos[:L], self.rope_sin[:L]
        h = self.tok_embeddings(tokens_BL)
        stats = []
        for layer in self.layers.values():
            h, router_stats_3E = layer(h, cos, sin)
            stats.append(router_stats_3E)
        h = self.norm(h)
        if labels_BL is not None and loss_chunk_size > 0:
            weight = getattr(self.output, "compute_weight", self.output.weight)
            loss = linear_cross_entropy(h.flatten(0, 1), weight, labels_BL.flatten(), loss_chunk_size)
            return loss, torch.stack(stats)
        return self.output(h), torch.stack(stats)

    def aux_loss(self, router_stats_L3E: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return router_aux_loss(router_stats_L3E[:, 0], router_stats_L3E[:, 1], num_tokens)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Materialised weights and buffers: call after ``to_empty`` (or on a fresh CPU model)."""
        device = self.tok_embeddings.weight.device
        cos, sin = rope_cos_sin(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device=device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        cutoff = 3 * self.args.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=self.args.dim**-0.5, a=-cutoff, b=cutoff)

    def expert_biases(self) -> list[torch.Tensor]:
        return [layer.moe.router.expert_bias for layer in self.layers.values()
                if layer.moe.router.expert_bias is not None]


def count_params(args: Qwen3MoEArgs) -> tuple[int, int]:
    """(total, active-per-token) parameter counts, from the shapes alone."""
    with torch.device("meta"):
        model = Qwen3MoE(args)
    total = sum(p.numel() for p in model.parameters())
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - expert_params + expert_params * args.top_k // args.num_experts
    return total, active
