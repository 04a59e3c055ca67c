"""The ``torchtitan`` MoE backend: upstream TorchTitan 0.2.2's own expert code behind our interface.

This is the baseline of the head-to-head benchmark: the same token reordering
(``TokenReorderer``: histc + stable argsort), the same padded ``torch._grouped_mm`` expert
computation (``GroupedExperts`` with its Triton ``indices_padding_wrapper``, casting the weights to
bf16 on every call as upstream does) and the same combine (scatter back to (token, k) order, then a
``bmm`` with the routing weights), imported from the installed ``torchtitan`` package rather than
rewritten. It needs a CUDA device (upstream's MoE does not run on CPU) and
``pip install ".[baseline]"`` (torchtitan==0.2.2).
"""

from __future__ import annotations

import torch

from kernels.moe import register_moe_backend

try:
    from torchtitan.models.moe.moe import GroupedExperts, TokenReorderer
except ImportError as e:  # pragma: no cover - depends on the optional package
    raise ImportError(
        "the 'torchtitan' MoE backend runs upstream TorchTitan's own expert code and needs the package: "
        "pip install \".[baseline]\" (torchtitan==0.2.2, the release for torch 2.11)") from e


@register_moe_backend("torchtitan")
def moe_torchtitan(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w1_EFD: torch.Tensor,
    w3_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
) -> torch.Tensor:
    """Upstream's ``MoE.forward`` from the router's output on, for Qwen3 (no shared experts,
    scores applied after the experts). Empty slots (id -1) are not supported upstream."""
    if not x_TD.is_cuda:
        raise RuntimeError("the 'torchtitan' MoE backend needs a CUDA device: upstream's MoE does not run on CPU")
    T, K = topk_ids_TK.shape
    E = w1_EFD.shape[0]
    D = x_TD.shape[1]
    _, token_indices_sorted_N, num_tokens_per_expert_E = TokenReorderer(E, K)(topk_weights_TK, topk_ids_TK)
    routed_input_ND = x_TD[token_indices_sorted_N // K]
    # Upstream's GroupedExperts.forward, called unbound so that our weights (plain tensors, possibly
    # FSDP-gathered) stand in for its parameters.
    experts = _Weights(w1_EFD, w2_EDF, w3_EFD)
    routed_output_ND = GroupedExperts.forward(experts, routed_input_ND, num_tokens_per_expert_E)
    unsorted_ND = torch.zeros((T * K, D), dtype=routed_output_ND.dtype, device=x_TD.device)
    unsorted_ND[token_indices_sorted_N] = routed_output_ND
    out_TD = torch.bmm(topk_weights_TK.float().reshape(-1, 1, K), unsorted_ND.reshape(-1, K, D).float())
    return out_TD.to(x_TD.dtype).squeeze(1)


class _Weights:
    """The attributes ``GroupedExperts.forward`` reads."""

    use_grouped_mm = True

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor):
        self.w1, self.w2, self.w3 = w1, w2, w3
