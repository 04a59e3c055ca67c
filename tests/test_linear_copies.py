"""components/precision/copies.py for the dense linears: their bf16 compute copies, carrying the
gradients, against autocast's per-call casts, and the trainer with them (``[optimizer]
implementation = "triton"``, ``[precision] compute_copies``)."""

import pytest
import torch
import torch.nn as nn

from components.precision.copies import ComputeLinear, grad_carriers, invalidate_copies, make_compute_copies
from models.moe.router import TokenChoiceTopKRouter

SEED = int(torch.randint(0, 2**30, ()))  # fresh inputs every run; failures name it


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32, bias=False)
        self.b = nn.Linear(32, 8, bias=True)  # a bias: no copy
        self.router = TokenChoiceTopKRouter(8, 4, 2, True, False)  # skipped by type

    def forward(self, x):
        return self.b(self.a(x))


def test_copied_linear_is_autocasts_linear():
    """Forward bitwise autocast's F.linear of the float32 weight; the gradient lands on the bf16
    copy (autocast's bf16 weight gradient) and the parameter gets none."""
    torch.manual_seed(SEED)
    ref, model = Tiny(), Tiny()
    model.load_state_dict(ref.state_dict())
    made = make_compute_copies(model, None, None, linears=True, skip=(TokenChoiceTopKRouter,))
    assert made == [model.a.copies] and type(model.a) is ComputeLinear and type(model.b) is nn.Linear
    copy = model.a.copies.weight
    assert type(model.router.gate) is nn.Linear and grad_carriers(model) == [copy]
    assert model.a.compute_weight is copy and not hasattr(model.b, "compute_weight")
    assert list(model.state_dict()) == list(ref.state_dict())  # never checkpointed
    x = torch.randn(5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref, y = ref(x), model(x)
    assert torch.equal(y_ref, y), f"seed {SEED}"
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    y.backward(dy)
    assert model.a.weight.grad is None and copy.grad.dtype == torch.bfloat16
    assert torch.equal(copy.grad.float(), ref.a.weight.grad), f"seed {SEED}"


def test_in_place_edits_and_loads_reach_the_copy():
    torch.manual_seed(SEED)
    model = Tiny()
    make_compute_copies(model, None, None, linears=True)
    copy = model.a.copies.weight
    with torch.no_grad():
        model.a.weight.mul_(2.0)  # moves the version counter: the next eager call re-casts
    x = torch.randn(2, 16)
    assert torch.equal(model(x), nn.functional.linear(model.a(x), model.b.weight, model.b.bias))  # float32 call
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    assert torch.equal(copy, model.a.weight.detach().bfloat16())
    with torch.no_grad():
        model.a.weight.data.copy_(torch.randn(32, 16))  # .data: no counter; a load path calls invalidate
    invalidate_copies(model)  # the next eager call (or the trainer's step start) re-casts
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    assert torch.equal(copy, model.a.weight.detach().bfloat16())


triton = pytest.importorskip("triton")


def _losses(tmp_path, *extra, steps=4, resume_at=None):
    from tests.utils import make_trainer

    args = ["--optimizer.implementation", "triton", "--model.n_layers", "1", "--training.mixed_precision_param",
            "bfloat16", "--moe.backend", "torch", *extra]
    trainer = make_trainer(tmp_path, *args)
    data_iter, losses = iter(trainer.dataloader), []
    for trainer.step in range(1, steps + 1):
        losses.append(trainer.train_step(data_iter)[0])
        if trainer.step == resume_at:
            trainer.checkpoint.save(trainer.step)
            trainer = make_trainer(tmp_path, *args)
            assert trainer.checkpoint.maybe_load() == resume_at
            data_iter = iter(trainer.dataloader)
    return trainer, losses


def test_trainer_chunked_loss_computes_with_the_output_copy(tmp_path):
    """The chunked linear + cross-entropy reads the output head's weight directly: it must read the
    copy (else the float32 weight would get a gradient the optimizer refuses)."""
    trainer, got = _losses(tmp_path, "--training.loss_chunk_size", "64", steps=2)
    assert trainer.precision.carry_grads and trainer.model.output in trainer.precision.copied_linears
    _, want = _losses(tmp_path, "--training.loss_chunk_size", "64", "--precision.compute_copies", "false", steps=2)
    assert got == pytest.approx(want, rel=1e-5)


def test_trainer_resume_with_copies(tmp_path):
    """Resumed from a checkpoint the copies hold the loaded weights: the losses continue exactly."""
    _, want = _losses(tmp_path / "a")
    _, got = _losses(tmp_path / "b", "--checkpoint.enable", "--checkpoint.interval", "100", resume_at=2)
    assert got == want


def test_trainer_copies_beside_fp8_projections(tmp_path):
    """With FP8 projections the converted linears keep their float32 gradients (they are not plain
    nn.Linear) and only the output head gets a copy; the steps follow the run without copies."""
    fp8 = ["--precision.linear", "fp8_rowwise"]
    trainer, got = _losses(tmp_path, *fp8, steps=2)
    assert [m is trainer.model.output for m in trainer.precision.copied_linears] == [True]
    _, want = _losses(tmp_path, *fp8, "--precision.compute_copies", "false", steps=2)
    assert got == pytest.approx(want, rel=1e-4)
