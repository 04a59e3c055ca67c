"""kernels/adamw.py: the Triton AdamW step against torch's AdamW (CPU interpreter, or the GPU),
its optimizer's state dict against torch's, and the trainer with ``implementation = "triton"``."""

from __future__ import annotations

import copy

import pytest
import torch

from kernels.adamw import TritonAdamW, _adamw_kernel, adamw_step_
from tests.triton_interpreter import DEVICE, skip_unless_runnable

skip_unless_runnable(_adamw_kernel, "kernels.adamw")

# Sizes: one element, partial last blocks, several blocks (of the GPU's 4096 and the interpreter's
# 65536 elements), matrices.
SHAPES = [(1,), (4097,), (3, 5000), (64, 129), (2, 40000)]
SEED = int(torch.randint(0, 2**30, ()))  # fresh inputs every run; failures name it


def make_params(seed: int, device: str = DEVICE) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(SEED + seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in SHAPES]


def set_grads(params, seed: int, scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(SEED + seed)
    for p in params:
        # Gradients of mixed sizes, some rows tiny, as a deep model's are.
        g = torch.randn(p.shape, generator=gen) * scale * torch.logspace(-6, 0, p.numel()).view(p.shape)
        p.grad = g.to(p.device)


def run(opt_cls, steps: int, grad_scale: float | None = None, **kw):
    params = make_params(0)
    groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]
    opt = opt_cls(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: (i + 1) / steps)  # the lr changes every step
    for step in range(steps):
        set_grads(params, 100 + step, scale=2.0 if grad_scale else 1.0)
        if grad_scale is not None:
            opt.grad_scale = torch.tensor(grad_scale, device=DEVICE)
        opt.step()
        sched.step()
    return params, opt


def torch_adamw(groups, **kw):
    return torch.optim.AdamW(groups, foreach=False, **kw)


def test_matches_torch_adamw():
    got, _ = run(TritonAdamW, 4)
    want, _ = run(torch_adamw, 4)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-6, atol=2e-7, msg=lambda m: f"seed {SEED}: {m}")


def test_bf16_gradient_is_its_float32_value():
    gen = torch.Generator().manual_seed(SEED + 3)
    p = torch.randn(5000, generator=gen).to(DEVICE)
    g = torch.randn(5000, generator=gen).to(DEVICE, torch.bfloat16)
    states = [(p.clone(), torch.full_like(p, 0.1), torch.full_like(p, 0.2)) for _ in range(2)]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3)
    adamw_step_(states[0][0], g, *states[0][1:], **kw)
    adamw_step_(states[1][0], g.float(), *states[1][1:], **kw)
    assert all(torch.equal(a, b) for a, b in zip(*states))


def test_grad_scale_divides_gradients_and_leaves_them_unwritten():
    """grad_scale = 2 with doubled gradients is the plain step; the gradients are not rewritten
    (torch's fused kernel stores the divided gradient back; this one does not need to)."""
    got, opt = run(TritonAdamW, 3, grad_scale=2.0)
    want, _ = run(torch_adamw, 3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-6, atol=2e-7, msg=lambda m: f"seed {SEED}: {m}")
    params = make_params(0)
    set_grads(params, 7)
    before = [p.grad.clone() for p in params]
    opt = TritonAdamW(params, lr=1e-3)
    opt.grad_scale = torch.tensor(4.0, device=DEVICE)
    opt.step()
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))


def test_state_dict_moves_between_torch_and_triton():
    """Two steps with TritonAdamW, its state loaded into torch's AdamW (and back), one more step
    each: the same parameters (checkpoints move between the implementations)."""
    params_a, opt_a = run(TritonAdamW, 2)
    params_b = [torch.nn.Parameter(p.detach().clone()) for p in params_a]
    groups = [{"params": params_b[:2], "weight_decay": 0.1}, {"params": params_b[2:], "weight_decay": 0.0}]
    opt_b = torch_adamw(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # state_dict() shares the step tensors
    for params, opt in ((params_a, opt_a), (params_b, opt_b)):
        set_grads(params, 50)
        opt.step()
    for a, b in zip(params_a, params_b):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7, msg=lambda m: f"seed {SEED}: {m}")
    # torch -> Triton (on a GPU, a fused AdamW checkpoint holds device step counts: moved to the CPU once).
    opt_c = TritonAdamW([{"params": params_a[:2], "weight_decay": 0.1}, {"params": params_a[2:], "weight_decay": 0.0}],
                        lr=3e-3, betas=(0.9, 0.95))
    state = copy.deepcopy(opt_b.state_dict())
    opt_c.load_state_dict(state)
    set_grads(params_a, 51)
    set_grads(params_b, 51)
    opt_c.step()
    opt_b.step()
    assert all(opt_c.state[p]["step"].item() == 4 for p in params_a)
    for a, b in zip(params_a, params_b):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7, msg=lambda m: f"seed {SEED}: {m}")


def test_clear_errors():
    p = torch.zeros(10, device=DEVICE)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="step counts from 1"):
        adamw_step_(p, p.clone(), m, v, step=0, **kw)
    with pytest.raises(TypeError, match="param must be float32"):
        adamw_step_(p.bfloat16(), p.clone(), m, v, step=1, **kw)
    with pytest.raises(ValueError, match="contiguous"):
        adamw_step_(p, torch.zeros(20, device=DEVICE)[::2], m, v, step=1, **kw)
    with pytest.raises(ValueError, match="grad_scale must be one float32"):
        adamw_step_(p, p.clone(), m, v, step=1, grad_scale=torch.ones(2, device=DEVICE), **kw)
    with pytest.raises(TypeError, match="contiguous float32 parameters"):
        TritonAdamW([torch.nn.Parameter(torch.zeros(4, 4, device=DEVICE).t())])
    opt = TritonAdamW([torch.nn.Parameter(torch.zeros(4, device=DEVICE))])
    opt.found_inf = torch.zeros(1)
    with pytest.raises(NotImplementedError, match="found_inf"):
        opt.step()


def test_copy_is_the_updated_parameter_cast_to_bf16():
    """attach_copy: every step writes p.to(bfloat16) of the updated value (bitwise torch's
    round-to-nearest cast); a step without the parameter's gradient leaves both untouched; the
    parameters follow exactly the steps without copies."""
    params = make_params(0)
    plain = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = TritonAdamW(params, lr=1e-2, weight_decay=0.1), TritonAdamW(plain, lr=1e-2, weight_decay=0.1)
    copies = [torch.full(p.shape, 7.0, dtype=torch.bfloat16, device=DEVICE) for p in params[:3]]
    for p, sh in zip(params, copies):
        opt.attach_copy(p, sh)
    for step in range(2):
        set_grads(params, 30 + step)
        set_grads(plain, 30 + step)
        if step == 1:
            params[0].grad = plain[0].grad = None  # not updated this step
        before = params[0].detach().clone()
        opt.step()
        ref.step()
        assert all(torch.equal(a, b) for a, b in zip(params, plain)), f"seed {SEED}"
        for i, (p, sh) in enumerate(zip(params, copies)):
            assert torch.equal(sh, p.detach().to(torch.bfloat16)), f"seed {SEED}: copy {i}, step {step}"
        if step == 1:
            assert torch.equal(params[0], before)


def test_attach_copy_refuses_what_it_cannot_write():
    p = torch.nn.Parameter(torch.zeros(8, 4, device=DEVICE))
    opt = TritonAdamW([p])
    with pytest.raises(ValueError, match="not one this optimizer updates"):
        opt.attach_copy(torch.nn.Parameter(torch.zeros(8, 4, device=DEVICE)), torch.zeros(8, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous bf16 tensor of shape"):
        opt.attach_copy(p, torch.zeros(8, 4, device=DEVICE))  # float32
    with pytest.raises(ValueError, match="contiguous bf16 tensor of shape"):
        opt.attach_copy(p, torch.zeros(4, 8, dtype=torch.bfloat16, device=DEVICE).t())
    with pytest.raises(ValueError, match="the copy must be a contiguous bf16"):
        adamw_step_(p.detach(), torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p), lr=1e-3, beta1=0.9,
                    beta2=0.95, eps=1e-8, weight_decay=0.0, step=1, copy=torch.zeros(3, dtype=torch.bfloat16))


COMPILED_AC = ["--compile.enable", "--compile.backend", "aot_eager", "--activation_checkpoint.mode", "full",
               "--activation_checkpoint.keep", "attention_and_moe"]


@pytest.mark.integration
@pytest.mark.parametrize("accum,more", [(1, []), (1, COMPILED_AC), (2, [])],
                         ids=["carriers", "carriers-compiled-ac-keep", "accum2-float32-grads"])
def test_trainer_writes_compute_copies_in_the_optimizer_pass(tmp_path, accum, more):
    """bf16 autocast, one process, implementation = "triton": the optimizer writes the experts'
    compute copies (none left to refresh after a step). Without accumulation the copies carry the
    experts' bf16 gradients and the dense linears compute with bf16 copies carrying theirs (the
    parameters get none), and training follows the run without copies up to the clipping norm's
    float32 rounding; with accumulation (float32 gradients, no carriers) it is bitwise that run."""
    import components.precision.copies as cw
    from tests.utils import make_trainer

    def run(cache):  # two steps: the second runs on the weights (and copies) the first step's optimizer wrote
        trainer = make_trainer(tmp_path, "--optimizer.implementation", "triton", "--model.n_layers", "1",
                               "--training.mixed_precision_param", "bfloat16", "--moe.backend", "torch",
                               "--training.global_batch_size", str(4 * accum), "--training.max_norm", "0.5",
                               "--precision.compute_copies", str(cache).lower(), *more)
        experts = trainer.model.layers["0"].moe.experts
        data_iter, losses, norms, refreshed, seen = iter(trainer.dataloader), [], [], None, {}
        real_step = trainer.optimizer.step

        def step(*a, **k):  # what the optimizer sees, after backward and clipping
            if "param_grads" not in seen:  # the first step's gradients, before any update
                wq = trainer.model.layers["0"].attention.wq
                first = wq.copies.grad_carriers[0].grad if cache and accum == 1 else wq.weight.grad
                seen["first_wq_grad"] = first.float().clone()
            seen["param_grads"] = [getattr(experts, n).grad for n in ("w1", "w3", "w2")]
            seen["carriers"] = [t.grad for t in cw.grad_carriers(experts)]
            seen["linear_grads"] = [m.weight.grad for m in (trainer.model.output, trainer.model.layers["0"].attention.wq)]
            seen["linear_carriers"] = [t.grad for m in trainer.precision.copied_linears for t in m.copies.grad_carriers]
            return real_step(*a, **k)

        trainer.optimizer.step = step
        for trainer.step in (1, 2):
            loss, _, norm = trainer.train_step(data_iter)
            losses.append(loss)
            norms.append(norm)
        if cache:
            refreshed = cw.refresh_copies(trainer.model)
            for name in ("w1", "w3", "w2"):
                assert torch.equal(getattr(experts.copies, name), getattr(experts, name).detach().bfloat16())
        return trainer, losses, norms, {k: v.clone() for k, v in trainer.model.state_dict().items()}, refreshed, seen

    cached, losses, norms, state, refreshed, seen = run(True)
    assert cached.precision.expert_copies == "bf16" and cached.precision.copies_in_optimizer == 1
    assert refreshed == 0  # synced by the optimizer: nothing left to remake
    _, plain_losses, plain_norms, plain_state, _, plain_seen = run(False)
    assert all(g is not None and g.dtype == torch.float32 for g in plain_seen["param_grads"])
    if accum == 1:
        assert all(g is None for g in seen["param_grads"] + seen["linear_grads"])
        # wq, wk, wv, wo and the output head (the router's gate keeps float32 gradients)
        assert len(seen["linear_carriers"]) == 5 and all(g.dtype == torch.bfloat16 for g in seen["linear_carriers"])
        assert len(seen["carriers"]) == 3 and all(g.dtype == torch.bfloat16 for g in seen["carriers"])
        assert losses == pytest.approx(plain_losses, rel=1e-5)
        assert norms == pytest.approx(plain_norms, rel=1e-5)
        # The carriers hold the very gradients autocast's casts gave: bitwise at the first step.
        assert torch.equal(seen["first_wq_grad"], plain_seen["first_wq_grad"])
        # After it the runs may part by whole bf16 steps: the clip factors differ in the last bit, so
        # the updated float32 weights do, and a weight next to a bf16 rounding boundary gets another
        # bf16 copy (on one CPU 10% of wq's elements moved 1e-6 to 1e-4 by step 2; on another none).
        # Two steps of at most ~lr each bound how far apart that can take them.
        for k, v in plain_state.items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=2e-3, msg=lambda m: f"{k}: {m}")
    else:
        assert seen["carriers"] == [] and seen["linear_carriers"] == [] and all(g.dtype == torch.float32 for g in seen["param_grads"])
        assert losses == plain_losses and norms == plain_norms
        for k, v in plain_state.items():
            assert torch.equal(state[k], v), k


@pytest.mark.integration
def test_trainer_with_triton_adamw(tmp_path):
    """train.py's step with implementation = "triton" (clipping folded into it) follows foreach's
    (clipping in place) on the debug model."""
    from tests.utils import make_trainer, run_losses

    def losses(impl):
        trainer = make_trainer(tmp_path, "--optimizer.implementation", impl, "--training.steps", "2",
                               "--model.n_layers", "1", "--training.max_norm", "0.5")
        out = run_losses(trainer)
        return out, trainer.optimizer

    want, _ = losses("foreach")
    got, opt = losses("triton")
    assert isinstance(opt, TritonAdamW) and opt.grad_scale is not None  # the clip was folded
    assert got == pytest.approx(want, rel=1e-4)


def test_optimizer_benchmark_runs():
    """bench/optimizer.py end to end on the debug model (CPU: interpreter, wall clock): every
    implementation steps and the Triton one agrees with fused AdamW's first step."""
    from bench import optimizer

    rows = optimizer.main(["--model", "debug", "--layers", "1", "--iters", "1", "--device", DEVICE,
                           "--timer", "cuda" if DEVICE == "cuda" else "wall"])
    assert {"triton", "triton+scale", "foreach"} <= {name for name, *_ in rows}
