"""The one-process proxy of expert parallelism (``[experimental] simulate_expert_parallel_degree``,
parallelisms/ep_proxy.py): its folding against what rank 0 of a real 2-rank gloo EP run computes,
the trainer with it, what it refuses, and its checkpoints.

Tier: integration (tests/conftest.py), but for the tests marked unit or kernels below.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from components.config import ConfigError, parse_args
from tests.utils import DEBUG_CONFIG, SHORT, debug_model, logged_steps, make_trainer, run_job

# A small MoE layer in float64: E = 8 experts, top-2, P = 2 (rank 0 owns experts 0-3).
T, D, F, E, K, P = 24, 16, 24, 8, 2, 2
N_LOCAL = E // P


class Recorder:
    """A MoE backend that records its inputs and output (the rows one rank's experts compute)."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def __call__(self, x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF):
        y_TD = self.backend(x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF)
        self.calls.append({"x": x_TD.detach().clone(), "ids": topk_ids_TK.clone(),
                           "w_shape": tuple(w1_EFD.shape), "y": y_TD.detach().clone()})
        return y_TD


def _layer_inputs() -> dict[str, torch.Tensor]:
    """The same tokens, rank 0's router gate and rank 0's E/2 experts' weights on every rank and in
    the test process (one seeded generator, float64)."""
    gen = torch.Generator().manual_seed(1234)
    return {"x": torch.randn(T, D, generator=gen, dtype=torch.float64),
            "gate": torch.randn(E, D, generator=gen, dtype=torch.float64),
            "w1": torch.randn(N_LOCAL, F, D, generator=gen, dtype=torch.float64) / D**0.5,
            "w3": torch.randn(N_LOCAL, F, D, generator=gen, dtype=torch.float64) / D**0.5,
            "w2": torch.randn(N_LOCAL, D, F, generator=gen, dtype=torch.float64) / F**0.5}


def _route(gate_ED: torch.Tensor, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from models.moe.router import TokenChoiceTopKRouter

    router = TokenChoiceTopKRouter(D, E, K, norm_topk_prob=True, use_expert_bias=False).double()
    with torch.no_grad():
        router.gate.weight.copy_(gate_ED)
    ids_TK, weights_TK, _, _ = router(x_TD)
    return ids_TK, weights_TK.detach()


def _real_ep2_job(rank: int, world: int, backend: str) -> dict:
    """A real EP-2 layer on 2 gloo ranks. Both ranks hold the same tokens; rank 1's router is rank
    0's with the expert halves swapped (its gate rolled by E/2), so rank 1 routes each token to
    e + E/2 mod E where rank 0 routes it to e, with the same weights: the rows rank 1 sends rank 0
    are rank 0's own slots of experts [E/2, E), arriving as local ids e - E/2. Both ranks' experts
    have rank 0's weights (global experts e and e + E/2 are equal). Returns rank 0's received rows,
    its experts' outputs on them and the layer's output."""
    from kernels.moe import get_moe_backend
    from parallelisms.expert_parallel import ExpertParallel
    from parallelisms.parallel_dims import ParallelDims

    inputs = _layer_inputs()
    ids_TK, weights_TK = _route(torch.roll(inputs["gate"], rank * N_LOCAL, dims=0), inputs["x"])
    ep = ExpertParallel(ParallelDims(1, world, world, world).mesh, E, capacity_factor=world,
                        param_dtype=torch.float64)
    recorder = Recorder(get_moe_backend(backend))
    y_TD, dropped_E = ep(recorder, inputs["x"], ids_TK, weights_TK, inputs["w1"], inputs["w3"], inputs["w2"])
    (call,) = recorder.calls
    return {"recv_x": call["x"], "recv_ids": call["ids"].view(-1), "recv_y": call["y"], "w_shape": call["w_shape"],
            "y": y_TD.detach(), "dropped": dropped_E, "ids": ids_TK}


def _proxy_layer(backend: str, dtype=torch.float64):
    """Layer 0 of a 1-layer model of the test's shape, turned into the proxy of EP ``P`` by the
    trainer's own function, with rank 0's router and experts and a recording backend."""
    from parallelisms.ep_proxy import apply_ep_proxy

    model = debug_model(n_layers=1, moe_backend=backend, dim=D, moe_inter_dim=F, num_experts=E, top_k=K,
                        n_heads=2, n_kv_heads=1, head_dim=8, vocab_size=64)
    apply_ep_proxy(model, P)
    moe = model.layers["0"].moe.to(dtype)
    inputs = _layer_inputs()
    with torch.no_grad():
        moe.router.gate.weight.copy_(inputs["gate"])
        for name in ("w1", "w3", "w2"):
            getattr(moe.experts, name).copy_(inputs[name])
    moe.experts.backend = Recorder(moe.experts.backend)
    return moe, inputs


def _token_of_rows(rows_RD: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
    """The token of each row (the all-to-all copies rows bit for bit; the tokens are distinct)."""
    match_RT = (rows_RD[:, None, :] == x_TD[None, :, :]).all(dim=-1)
    assert (match_RT.sum(dim=1) == 1).all()
    return match_RT.int().argmax(dim=1)


@pytest.mark.skipif(sys.platform != "linux", reason="multi-process tests use gloo on Linux")
@pytest.mark.parametrize("backend", ["torch", "grouped_mm"])
def test_folding_is_what_rank0_of_real_ep2_computes(backend):
    """The proxy's experts see exactly the rows rank 0 of a real EP-2 run receives when rank 1's
    tokens route onto rank 0's experts as the proxy's own tokens route onto rank 1's (see
    ``_real_ep2_job``): the same rows per local expert, the same expert outputs on each, and the
    same layer output (both global experts e and e + E/2 having rank 0's weights)."""
    real = run_job(2, _real_ep2_job, backend=backend)
    moe, inputs = _proxy_layer(backend)
    y_BLD, stats_3E = moe(inputs["x"].view(1, T, D))
    (call,) = moe.experts.backend.calls

    ids_TK, weights_TK = _route(inputs["gate"], inputs["x"])
    assert torch.equal(real["ids"], ids_TK)  # rank 0 routed as the proxy's router does
    # The router scores all E experts; the backend sees E/2 experts' weights and the folded ids.
    assert torch.equal(stats_3E[0], torch.bincount(ids_TK.view(-1), minlength=E).float())
    assert call["w_shape"] == real["w_shape"] == (N_LOCAL, F, D)
    assert torch.equal(call["ids"], ids_TK % N_LOCAL)
    assert (ids_TK >= N_LOCAL).any() and (ids_TK < N_LOCAL).any()  # both ranks' experts are routed to

    # Rows per local expert: rank 0's received (non-empty) rows against the proxy's folded slots.
    real_rows = real["recv_ids"] >= 0
    counts_real = torch.bincount(real["recv_ids"][real_rows], minlength=N_LOCAL)
    counts_proxy = torch.bincount(call["ids"].view(-1), minlength=N_LOCAL)
    assert torch.equal(counts_real, counts_proxy) and counts_proxy.sum() == T * K
    assert real["dropped"].sum() == 0

    # The same (token, local expert) rows, and the same expert output on each: the proxy's output
    # of slot (t, k) alone is its backend run with routing weight 1 on that slot and 0 elsewhere.
    # Float64 to its last bits: the GEMMs group the same rows in another order (received order
    # against slot order), which may round a sum differently (seen: 6.7e-16).
    tokens_R = _token_of_rows(real["recv_x"][real_rows], inputs["x"])
    experts_R = real["recv_ids"][real_rows]
    assert sorted(zip(tokens_R.tolist(), experts_R.tolist())) == sorted(
        (t, j) for t, row in enumerate(call["ids"].tolist()) for j in row)
    slot_out_KTD = torch.stack([moe.experts.backend.backend(inputs["x"], call["ids"], torch.eye(K)[k].expand(T, K),
                                                            *(getattr(moe.experts, n) for n in ("w1", "w3", "w2")))
                                for k in range(K)]).detach()
    for y_D, t, j in zip(real["recv_y"][real_rows], tokens_R.tolist(), experts_R.tolist()):
        k = call["ids"][t].tolist().index(j)
        torch.testing.assert_close(y_D, slot_out_KTD[k, t], rtol=1e-13, atol=1e-14)

    # The whole layer: the weighted sum over k of the same expert outputs. EP sums on the source rank
    # in float32 (parallelisms/expert_parallel.py), the backends in float64 for float64 inputs.
    torch.testing.assert_close(y_BLD.view(T, D).detach(), real["y"], rtol=2e-6, atol=1e-7)


@pytest.mark.kernels
def test_mega_backend_sees_one_ranks_experts():
    """The fused Triton ``mega`` backend (Triton's interpreter on CPU) gets the folded ids and E/P
    experts' weights, and computes the torch backend's layer output on them."""
    pytest.importorskip("triton")
    from tests.triton_interpreter import DEVICE

    want, _ = _proxy_layer("torch", torch.float32)
    got, inputs = _proxy_layer("mega", torch.float32)
    x_BLD = inputs["x"].float().view(1, T, D).to(DEVICE)
    y_want, _ = want.to(DEVICE)(x_BLD)
    y_got, _ = got.to(DEVICE)(x_BLD)
    (call,) = got.experts.backend.calls
    assert call["w_shape"] == (N_LOCAL, F, D) and int(call["ids"].max()) < N_LOCAL
    torch.testing.assert_close(y_got, y_want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("degree", [2, 4])
def test_trainer_trains_the_proxy(tmp_path, capsys, degree):
    """train.py main on the debug model (8 experts) as one rank of EP 2 or 4: the proxy line after
    the header, finite losses, and the summary marked as a proxy's."""
    from train import main

    rc = main([*DEBUG_CONFIG, "--job.dump_folder", str(tmp_path), *SHORT, "--metrics.log_freq", "1",
               "--training.device", "cpu", "--experimental.simulate_expert_parallel_degree", str(degree)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    lines = out.out.splitlines()
    assert lines[0].startswith("Qwen3-MoE debug model: Qwen3-MoE debug (1 layers")
    assert lines[1] == (f"simulating one rank of expert parallelism {degree}: {8 // degree} of 8 experts per layer, "
                        f"tokens folded onto them; times exclude the all-to-all and FSDP collectives")
    steps = logged_steps(out.out)
    assert sorted(steps) == [1, 2, 3] and all(math.isfinite(s["loss"]) for s in steps.values())
    summary = next(line for line in lines if line.startswith("summary:"))
    assert summary.endswith(f"proxy: one rank of expert parallelism {degree}, without its collectives")


@pytest.mark.unit
@pytest.mark.parametrize("degree", [2, 4, 8])
def test_proxy_holds_e_over_p_experts(tmp_path, degree):
    """Each layer holds E/P experts (parameters shaped (E/P, ...)); the router still scores E."""
    full = make_trainer(tmp_path / "full")
    proxy = make_trainer(tmp_path / "proxy", "--experimental.simulate_expert_parallel_degree", str(degree))
    args = full.model_args
    for block in proxy.model.layers.values():
        experts = block.moe.experts
        assert experts.w1.shape == experts.w3.shape == (8 // degree, args.moe_inter_dim, args.dim)
        assert experts.w2.shape == (8 // degree, args.dim, args.moe_inter_dim)
        assert block.moe.router.gate.weight.shape == (8, args.dim)
    expert_numel = sum(p.numel() for n, p in full.model.named_parameters() if ".experts." in n)
    assert sum(p.numel() for p in proxy.model.parameters()) == (
        sum(p.numel() for p in full.model.parameters()) - expert_numel + expert_numel // degree)


@pytest.mark.unit
@pytest.mark.parametrize("args,world,distributed,pattern", [
    (["--experimental.simulate_expert_parallel_degree", "3"], 1, False,
     r"^\[experimental\] simulate_expert_parallel_degree = 3 does not divide the 8 experts of the debug model .*"
     r"choose one of 2, 4, 8$"),
    (["--experimental.simulate_expert_parallel_degree", "16"], 1, False, r"does not divide the 8 experts"),
    (["--experimental.simulate_expert_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"], 2, True,
     r"cannot run with real expert parallelism \(\[parallelism\] expert_parallel_degree = 2\); set one of them to 1"),
    (["--experimental.simulate_expert_parallel_degree", "2"], 4, True,
     r"runs one rank's compute in a single process, and this run has 4 ranks under torchrun"),
    (["--experimental.simulate_expert_parallel_degree", "2"], 1, True, r"this run has 1 rank under torchrun"),
    (["--experimental.simulate_expert_parallel_degree", "2", "--experimental.expert_parallel_chunks", "2"], 1, False,
     r"does not simulate chunked EP; set expert_parallel_chunks = 1"),
    (["--experimental.simulate_expert_parallel_degree", "2", "--checkpoint.initial_load_path", "hf_folder"], 1, False,
     r"initial_load_format = \"hf\": a Hugging Face checkpoint holds all 8 experts of each layer and the proxy 4"),
], ids=["not_a_divisor", "over_E", "with_real_ep", "world_4", "torchrun_world_1", "chunks", "hf_import"])
def test_refusals(args, world, distributed, pattern):
    from parallelisms.ep_proxy import check_ep_proxy

    cfg = parse_args([*DEBUG_CONFIG, *args])
    with pytest.raises(ConfigError, match=pattern):
        check_ep_proxy(cfg, world, distributed, 8, "debug")


@pytest.mark.unit
def test_trainer_refuses_before_building(tmp_path):
    """The trainer checks the proxy before its parallel layout, whose own message would not name it."""
    with pytest.raises(ConfigError, match=r"simulate_expert_parallel_degree = 3 does not divide the 8 experts"):
        make_trainer(tmp_path, "--experimental.simulate_expert_parallel_degree", "3")
    with pytest.raises(ConfigError, match=r"simulate_expert_parallel_degree = 2 simulates expert parallelism in one "
                                          r"process and cannot run with real expert parallelism"):
        make_trainer(tmp_path, "--experimental.simulate_expert_parallel_degree", "2",
                     "--parallelism.expert_parallel_degree", "2")
    with pytest.raises(ConfigError, match=r"--experimental.simulate_expert_parallel_degree 0 is out of range: must "
                                          r"be >= 1"):
        make_trainer(tmp_path, "--experimental.simulate_expert_parallel_degree", "0")


@pytest.mark.unit
def test_proxy_checkpoints_load_only_into_the_same_proxy(tmp_path):
    """A proxy's checkpoint resumes a proxy of the same degree; a real model or another degree
    refuses it (and a proxy refuses a real model's) by name, before DCP reads anything; the HF
    export refuses it."""
    from components.checkpoint import CheckpointError
    from tests.utils import load_script

    def trainer(job, *args):
        return make_trainer(tmp_path / job, "--checkpoint.enable", *args)

    proxy_args = ["--experimental.simulate_expert_parallel_degree", "2"]
    saved = trainer("proxy", *proxy_args)
    saved.checkpoint.save(1)
    assert trainer("proxy", *proxy_args).checkpoint.maybe_load() == 1
    hint = r"\(a run with \[experimental\] simulate_expert_parallel_degree = P holds only E/P experts per layer"
    with pytest.raises(CheckpointError, match=r"is of another model: simulate_expert_parallel_degree saved 2 vs "
                                              r"configured None " + hint):
        trainer("proxy").checkpoint.maybe_load()
    with pytest.raises(CheckpointError, match=r"simulate_expert_parallel_degree saved 2 vs configured 4 "):
        trainer("proxy", "--experimental.simulate_expert_parallel_degree", "4").checkpoint.maybe_load()
    trainer("real").checkpoint.save(1)
    with pytest.raises(CheckpointError, match=r"simulate_expert_parallel_degree saved None vs configured 2 " + hint):
        trainer("real", *proxy_args).checkpoint.maybe_load()

    export = load_script("export_hf")
    with pytest.raises(export.ExportError, match=r"was saved by a one-rank proxy of expert parallelism "
                                                 r"\(\[experimental\] simulate_expert_parallel_degree = 2\): it "
                                                 r"holds E/P experts per layer, not a whole model"):
        export.export(saved.checkpoint.folder / "step-1", tmp_path / "hf", [*DEBUG_CONFIG, *proxy_args],
                      torch.float32)


@pytest.mark.unit
def test_compare_marks_proxy_runs():
    """bench/compare.py's report says which runs were proxies (their times exclude the collectives)."""
    from bench import compare

    line = ("simulating one rank of expert parallelism 8: 16 of 128 experts per layer, tokens folded onto them; "
            "times exclude the all-to-all and FSDP collectives")
    step = "step:     1  loss:   7.0000  aux_loss: 1.0  grad_norm:  1.0  lr: 1e-4  memory: 1.0GiB  tps: 1,000"
    assert compare.summarize_log(f"header\n{line}\n{step}\n", 1000, (1, 1))["proxy"] == line
    assert compare.summarize_log(f"header\n{step}\n", 1000, (1, 1))["proxy"] is None
