"""Qwen3-MoE model: published parameter counts, forward/backward, router and load balancing."""

import math

import pytest
import torch
import torch.nn.functional as F

from models.moe.router import TokenChoiceTopKRouter, router_aux_loss, update_expert_bias
from models.qwen3.args import get_model_args
from models.qwen3.model import Qwen3MoE, apply_rope, count_params, rope_cos_sin
from tests.utils import debug_model


@pytest.mark.parametrize("flavor,total_b,active_b", [("qwen3_30b_a3b", 30.5, 3.3), ("qwen3_235b_a22b", 235.0, 22.0)])
def test_full_flavor_parameter_counts(flavor, total_b, active_b):
    total, active = count_params(get_model_args(flavor))
    # Published: Qwen3-30B-A3B 30.5B total / 3.3B active; Qwen3-235B-A22B 235B / 22B.
    assert abs(total / 1e9 - total_b) / total_b < 0.01, total
    assert abs(active / 1e9 - active_b) / active_b < 0.03, active


def test_n_layers_override_keeps_layer_shape():
    full, proxy = get_model_args("qwen3_30b_a3b"), get_model_args("qwen3_30b_a3b", n_layers=4)
    assert proxy.n_layers == 4 and proxy.dim == full.dim and proxy.num_experts == full.num_experts
    t_full, _ = count_params(full)
    t_proxy, _ = count_params(proxy)
    embed_out = 2 * full.vocab_size * full.dim + full.dim  # embedding, output, final norm
    assert math.isclose((t_full - embed_out) / 48, (t_proxy - embed_out) / 4)


def test_debug_forward_backward():
    model = debug_model(n_layers=2)
    tokens = torch.randint(0, model.args.vocab_size, (2, 32))
    logits, stats = model(tokens)
    assert logits.shape == (2, 32, model.args.vocab_size)
    assert stats.shape == (2, 3, model.args.num_experts)
    assert torch.all(stats[:, 0].sum(-1) == 2 * 32 * model.args.top_k)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten()) + 0.01 * model.aux_loss(stats, tokens.numel())
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.layers["0"].moe.router.gate.weight.grad.abs().sum() > 0, "the router must receive gradient"
    # Initial loss of an untrained model is close to uniform over the vocabulary.
    assert abs(F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).item() - math.log(model.args.vocab_size)) < 1.0


def test_backends_give_same_model_output():
    tokens = torch.randint(0, 2048, (2, 16))
    ref = debug_model(n_layers=2, moe_backend="torch")
    fast = debug_model(n_layers=2, moe_backend="grouped_mm")
    fast.load_state_dict(ref.state_dict())
    torch.testing.assert_close(fast(tokens)[0], ref(tokens)[0], rtol=1e-4, atol=1e-4)


def test_causality():
    model = debug_model(n_layers=2)
    tokens = torch.randint(0, 2048, (1, 24))
    changed = tokens.clone()
    changed[0, 12:] = torch.randint(0, 2048, (12,))
    a, _ = model(tokens)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_rope_rotates_pairs_by_position():
    """Rotate-half RoPE: dims i and i + d/2 form a pair rotated by pos * theta^(-2i/d)."""
    d, theta = 8, 10000.0
    cos, sin = rope_cos_sin(d, 5, theta)
    x = torch.randn(1, 5, 1, d)
    out = apply_rope(x, cos, sin)
    for pos in range(5):
        for i in range(d // 2):
            ang = pos * theta ** (-2 * i / d)
            a, b = x[0, pos, 0, i], x[0, pos, 0, i + d // 2]
            assert torch.allclose(out[0, pos, 0, i], a * math.cos(ang) - b * math.sin(ang), atol=1e-5)
            assert torch.allclose(out[0, pos, 0, i + d // 2], b * math.cos(ang) + a * math.sin(ang), atol=1e-5)


def test_router_softmax_topk_renormalised():
    torch.manual_seed(1)
    router = TokenChoiceTopKRouter(16, 8, 3, norm_topk_prob=True, use_expert_bias=False)
    x = torch.randn(10, 16)
    ids, weights, counts, probs_sum = router(x)
    probs = torch.softmax(x @ router.gate.weight.t(), dim=-1)
    expected_ids = probs.topk(3, dim=-1).indices
    assert torch.equal(ids, expected_ids)
    expected_w = probs.gather(-1, ids)
    torch.testing.assert_close(weights, expected_w / expected_w.sum(-1, keepdim=True))
    torch.testing.assert_close(counts, torch.bincount(ids.flatten(), minlength=8).float())
    torch.testing.assert_close(probs_sum, probs.sum(0))


def hf_style_aux_loss(router_logits_per_layer, top_k):
    """Qwen3's load_balancing_loss_func, written from its definition: concatenate all layers' logits."""
    logits = torch.cat(router_logits_per_layer, dim=0)
    probs = torch.softmax(logits.float(), dim=-1)
    _, selected = torch.topk(probs, top_k, dim=-1)
    num_experts = probs.shape[-1]
    expert_mask = F.one_hot(selected, num_experts).float()  # (N, K, E)
    tokens_per_expert = expert_mask.mean(dim=0)  # (K, E)
    router_prob_per_expert = probs.mean(dim=0)  # (E)
    return num_experts * (tokens_per_expert * router_prob_per_expert.unsqueeze(0)).sum()


def test_aux_loss_matches_qwen3_definition():
    torch.manual_seed(2)
    E, K, T, L = 8, 2, 40, 3
    routers = [TokenChoiceTopKRouter(16, E, K, True, False) for _ in range(L)]
    xs = [torch.randn(T, 16) for _ in range(L)]
    stats = []
    for r, x in zip(routers, xs):
        _, _, counts, probs_sum = r(x)
        stats.append(torch.stack([counts, probs_sum]))
    stats = torch.stack(stats)
    ours = router_aux_loss(stats[:, 0], stats[:, 1], T)
    expected = hf_style_aux_loss([x @ r.gate.weight.t() for r, x in zip(routers, xs)], K)
    torch.testing.assert_close(ours, expected)


def test_expert_bias_changes_choice_not_weights():
    router = TokenChoiceTopKRouter(16, 4, 1, norm_topk_prob=False, use_expert_bias=True)
    x = torch.randn(50, 16)
    router.expert_bias.copy_(torch.tensor([10.0, 0, 0, 0]))  # force expert 0
    ids, weights, _, _ = router(x)
    assert torch.all(ids == 0)
    probs = torch.softmax(x @ router.gate.weight.t(), dim=-1)
    torch.testing.assert_close(weights[:, 0], probs[:, 0])


def test_expert_bias_update_moves_toward_balance():
    bias = torch.zeros(4)
    update_expert_bias(bias, torch.tensor([9.0, 1.0, 5.0, 5.0]), rate=0.01)
    torch.testing.assert_close(bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))


def test_meta_init_is_deterministic():
    a, b = debug_model(n_layers=1), debug_model(n_layers=1)
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), n


def test_attention_backend_choice_gives_the_same_output():
    tokens = torch.randint(0, 2048, (2, 16))
    auto = debug_model(n_layers=1)
    with torch.device("meta"):
        pinned = Qwen3MoE(auto.args, moe_backend="grouped_mm", attention_backend="math")
    pinned.to_empty(device="cpu")
    pinned.load_state_dict(auto.state_dict())
    # Same weights; the RoPE tables are buffers outside the state dict.
    pinned.rope_cos.copy_(auto.rope_cos)
    pinned.rope_sin.copy_(auto.rope_sin)
    torch.testing.assert_close(pinned(tokens)[0], auto(tokens)[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        Qwen3MoE(auto.args, attention_backend="fast")
