"""The cross-entropy of the output projection, computed so the logits are never held in full.

Part of the model's forward (``Qwen3MoE.forward`` with labels and ``loss_chunk_size``), not of
the trainer: it reads the output weight directly, so it must run inside the model, where FSDP has
gathered that weight.

At seq len 16384 and Qwen3's vocabulary (151,936) the logits of one sample are 2.5 G elements:
10 GiB in float32, plus the same again for their gradient. ``linear_cross_entropy`` computes the
loss and both gradients (w.r.t. the hidden states and the output weight) chunk by chunk during the
forward, keeping only (chunk x V) logits alive at a time; backward then just scales the stored
gradients. FLOPs are those of the plain path (three matmuls per chunk), nothing is recomputed.
"""

from __future__ import annotations

import torch


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor, chunk: int) -> torch.Tensor:
        N = h_ND.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        dh_ND = torch.empty_like(h_ND)
        dw_VD = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device)
        for start in range(0, N, chunk):
            h_cD = h_ND[start:start + chunk]
            y_c = labels_N[start:start + chunk]
            logits_cV = (h_cD @ w_VD.t()).float()
            lse_c = torch.logsumexp(logits_cV, dim=-1)
            loss += (lse_c - logits_cV.gather(1, y_c[:, None]).squeeze(1)).sum()
            # d(mean loss)/d(logits) = (softmax - onehot) / N, formed in place over the logits.
            grad_cV = logits_cV.sub_(lse_c[:, None]).exp_()
            grad_cV.scatter_add_(1, y_c[:, None], torch.full_like(y_c[:, None], -1, dtype=grad_cV.dtype))
            grad_cV.div_(N)
            grad_cV = grad_cV.to(h_ND.dtype)
            dh_ND[start:start + chunk] = grad_cV @ w_VD
            # Each chunk's partial is rounded to h's dtype once, as a bf16 matmul over all N would be.
            dw_VD += (grad_cV.t() @ h_cD).float()
        ctx.save_for_backward(dh_ND, dw_VD.to(w_VD.dtype))
        return loss / N

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        dh_ND, dw_VD = ctx.saved_tensors
        return dh_ND * grad_loss.to(dh_ND.dtype), dw_VD * grad_loss.to(dw_VD.dtype), None, None


def linear_cross_entropy(h_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean cross-entropy of ``h @ w.T`` against ``labels`` without materialising all logits.

    h_ND: (N, D) hidden states (bf16 or fp32); w_VD: (V, D) output weight, same dtype;
    labels_N: (N,) int64 in [0, V). Logits and the softmax are computed in float32 per chunk of
    ``chunk`` rows; the weight gradient is accumulated in float32.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return _ChunkedLinearCrossEntropy.apply(h_ND, w_VD, labels_N, chunk)
