"""Token-choice top-k router for Qwen3-MoE, and its load-balancing terms.

Qwen3 routes with a softmax over all experts in float32, picks the top k and (``norm_topk_prob``)
renormalises the k weights to sum to one. Load balancing, chosen by ``[moe] load_balance``:

- ``aux_loss``: Qwen3's auxiliary loss, ``E * sum_e f_e * P_e`` where ``f_e`` is the fraction of
  tokens whose top-k includes expert e and ``P_e`` the mean router probability of e. As in the
  Hugging Face Qwen3-MoE implementation, f and P are taken over the tokens of *all* layers together
  (see :func:`router_aux_loss`), so each layer returns its raw sums and the model combines them.
- ``expert_bias``: aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for
  the choice of experts only (the weights stay the unbiased probabilities), nudged after each
  optimizer step towards under-loaded experts by :func:`update_expert_bias`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool, use_expert_bias: bool):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        # Persistent so that a resumed run keeps its balancing state; not a parameter (no gradient).
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32) if use_expert_bias else None)

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (topk_ids_TK int64, topk_weights_TK fp32, tokens_per_expert_E fp32, probs_sum_E fp32).

        ``tokens_per_expert_E`` counts routed (token, k) slots per expert (no gradient);
        ``probs_sum_E`` is the sum over tokens of the router probabilities (carries gradient, for the
        auxiliary loss).
        """
        probs_TE = F.softmax(self.gate(x_TD).float(), dim=-1)
        if self.expert_bias is not None:
            _, topk_ids_TK = torch.topk(probs_TE + self.expert_bias, self.top_k, dim=-1)
        else:
            _, topk_ids_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        topk_weights_TK = probs_TE.gather(-1, topk_ids_TK)
        if self.norm_topk_prob:
            topk_weights_TK = topk_weights_TK / topk_weights_TK.sum(dim=-1, keepdim=True)
        # A scatter of ones has a static shape (unlike bincount), so this compiles with fullgraph.
        tokens_per_expert_E = torch.zeros(self.num_experts, dtype=torch.float32, device=x_TD.device)
        tokens_per_expert_E = tokens_per_expert_E.scatter_add(
            0, topk_ids_TK.reshape(-1), torch.ones(topk_ids_TK.numel(), dtype=torch.float32, device=x_TD.device))
        return topk_ids_TK, topk_weights_TK, tokens_per_expert_E.detach(), probs_TE.sum(dim=0)

    def reset_parameters(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)
        if self.expert_bias is not None:
            self.expert_bias.zero_()


def router_aux_loss(tokens_per_expert_LE: torch.Tensor, probs_sum_LE: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Qwen3's load-balancing loss over all layers at once.

    tokens_per_expert_LE: routed-slot counts per layer and expert; probs_sum_LE: per-layer sums of the
    router probabilities over the ``num_tokens`` tokens of the batch. Equal to the Hugging Face
    ``load_balancing_loss_func`` on the concatenated router logits of all layers: with perfectly
    uniform routing it is ``top_k``.
    """
    num_layers, num_experts = probs_sum_LE.shape
    frac_tokens_E = tokens_per_expert_LE.sum(0) / (num_layers * num_tokens)
    mean_prob_E = probs_sum_LE.sum(0) / (num_layers * num_tokens)
    return num_experts * (frac_tokens_E * mean_prob_E).sum()


@torch.no_grad()
def update_expert_bias(expert_bias_E: torch.Tensor, tokens_per_expert_E: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's aux-loss-free update: raise the bias of under-loaded experts, lower over-loaded."""
    load_E = tokens_per_expert_E.float()
    expert_bias_E.add_(rate * torch.sign(load_E.mean() - load_E))
