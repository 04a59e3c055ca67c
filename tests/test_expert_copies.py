"""The experts' compute copies, made once per optimizer step (components/precision/copies.py and
kernels/moe/mega_fp8/weights.py), against the per-call conversion they replace.

The copies must change nothing but speed: the bf16 copies are the same casts, the e4m3 copies the
same quantization, so the op-level checks are bitwise; only the FP8 weight gradients, written in
float32 instead of bf16 when the op gets float32 master weights, are compared after rounding to
bf16 (the kernels round their fp32 accumulators to nearest either way).
"""

import dataclasses

import pytest
import torch

from components.precision.copies import EXPERT_WEIGHTS, MODES, ComputeCopies, expert_copy_mode

triton = pytest.importorskip("triton")
from kernels.moe.mega_fp8 import MegaFP8Options, mega_moe_fp8  # noqa: E402
from kernels.moe.mega_fp8.weights import QuantizedExpertWeights  # noqa: E402

from tests.test_mega_moe_fp8 import _inputs  # noqa: E402
from tests.utils import make_trainer, random_seed, run_losses  # noqa: E402

# On the GPU machine the trainer runs on the GPU: Triton kernels there take CUDA tensors only.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Over train_configs/debug_model.toml (tests/utils.py make_trainer).
_BASE = ["--model.n_layers", "2", "--training.seq_len", "32",
         "--training.local_batch_size", "2", "--training.device", DEVICE, "--lr_scheduler.warmup_steps", "1",
         "--training.mixed_precision_param", "bfloat16"]


def _run(op_args, weights, quantized, options=None):
    x, ids, s, dy = op_args
    leaves = [t.clone().requires_grad_() for t in (x, s, *weights)]
    y = mega_moe_fp8(leaves[0], ids, leaves[1], *leaves[2:], quantized=quantized, options=options)
    grads = torch.autograd.grad(y, leaves, dy)
    return [y, *grads]


# (T, K, E, D, F, routing, pow2): T never a multiple of the tiles; both scale roundings appear.
# (Routing patterns -- top-1, top-8, all tokens on one expert -- are the op tests' business,
# tests/test_mega_moe_fp8.py; here the pre-made e4m3 weights must change nothing.)
_CASES = [
    pytest.param(37, 2, 4, 256, 128, "empty_expert", True, id="T37-top2-emptyexperts-pow2"),
    # F not a multiple of 128: the dX operand's two zero-padded halves; D a partial scale tile.
    pytest.param(21, 2, 4, 200, 192, "empty_expert", False, id="T21-D200-F192"),
]


@pytest.mark.parametrize("T,K,E,D,F,kind,pow2", _CASES)
def test_quantized_weights_give_the_per_call_results(T, K, E, D, F, kind, pow2):
    """mega_fp8 with the weights quantized beforehand equals mega_fp8 quantizing them itself, with
    bf16 weights (bitwise) and with float32 master weights as gradient carriers (bitwise, the
    weight gradients after rounding their float32 values to bf16). Fresh random inputs each run
    (the seed is in the failure message)."""
    seed = random_seed()
    x, ids, s, w1, w3, w2, dy = _inputs(T, K, E, D, F, kind)
    opts = MegaFP8Options(pow2_scales=pow2)
    want = _run((x, ids, s, dy), (w1, w3, w2), None, opts)
    q = QuantizedExpertWeights.quantize(w1, w3, w2, pow2)
    got_bf16 = _run((x, ids, s, dy), (w1, w3, w2), q, opts)
    got_fp32 = _run((x, ids, s, dy), (w1.float(), w3.float(), w2.float()), q, opts)
    names = ("y", "dx", "ds", "dw1", "dw3", "dw2")
    for name, a, b, c in zip(names, want, got_bf16, got_fp32):
        assert torch.equal(a, b), f"seed={seed}: {name} differs with bf16 weights"
        if name.startswith("dw"):
            assert c.dtype == torch.float32, name
            c = c.to(a.dtype)
        assert torch.equal(a, c), f"seed={seed}: {name} differs with float32 weights"


def test_quantized_weights_are_checked():
    _, _, _, w1, w3, w2, _ = _inputs(3, 2, 4, 256, 128, "random")
    q = QuantizedExpertWeights.quantize(w1, w3, w2)
    with pytest.raises(ValueError, match="quantized w1 has shape"):
        q.check_matches(w1[:2], w3, w2, False)
    with pytest.raises(ValueError, match="pow2_scales=False but the op runs with pow2_scales=True"):
        q.check_matches(w1, w3, w2, True)
    with pytest.raises(ValueError, match="takes 10 tensors"):
        QuantizedExpertWeights.from_tensors(q.tensors()[:3], False)
    x, ids, s, *_ = _inputs(3, 2, 4, 256, 128, "random")
    with pytest.raises(TypeError, match="x_TD has dtype torch.float32"):
        mega_moe_fp8(x.float(), ids, s, w1.float(), w3.float(), w2.float(), quantized=q)


def test_expert_mode():
    assert expert_copy_mode("mega_fp8", torch.bfloat16, True) == "fp8_blockwise"
    assert expert_copy_mode("mega_fp8", torch.bfloat16, False) == "bf16"  # shards: bf16 copy, per-call FP8
    assert expert_copy_mode("mega", torch.bfloat16, True) == "bf16"
    assert expert_copy_mode("grouped_mm", None, True) is None  # float32 training: no cast to save
    assert set(MODES) == {"bf16", "fp8_blockwise"}


def _train(tmp_path, extra, steps=3):
    trainer = make_trainer(tmp_path, *extra, base=_BASE)
    losses = run_losses(trainer, steps)
    return trainer, losses, {k: v.clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("extra", [
    ["--moe.backend", "torch", "--training.global_batch_size", "4"],  # 2 micro-batches per step
    ["--moe.backend", "grouped_mm", "--activation_checkpoint.mode", "full", "--compile.enable",
     "--compile.backend", "aot_eager"],
], ids=["torch-accum2", "grouped_mm-ac-compiled"])
def test_bf16_copies_train_bitwise_like_per_call_casts(tmp_path, extra):
    """bf16 autocast in one process: the copies are the casts each call made, refreshed after every
    optimizer step; a stale copy would change the second step's loss."""
    cached, losses, state = _train(tmp_path, extra)
    assert cached.precision.expert_copies == "bf16"
    plain, plain_losses, plain_state = _train(tmp_path, extra + ["--precision.compute_copies", "false"])
    assert plain.precision.expert_copies is None
    assert losses == plain_losses
    assert state.keys() == plain_state.keys()  # the copies' buffers are not part of the state
    for k, v in plain_state.items():
        assert torch.equal(state[k], v), k


@pytest.mark.parametrize("more", [[], ["--compile.enable", "--compile.backend", "aot_eager", "--activation_checkpoint.mode",
                                   "full", "--activation_checkpoint.keep", "attention_and_moe"]],
                         ids=["eager", "compiled-ac-keep"])
def test_fp8_copies_train_like_per_call_quantization(tmp_path, more, narrow_debug_model):
    """mega_fp8 in one process: the first step is bitwise (same e4m3 weights); later steps follow
    closely (with copies the weight gradients are written in float32, per call in bf16). Compiled,
    the copies reach the op through the traced graph (``BackendArgs.quantized``)."""
    # Small (16 tokens): the interpreter runs every FP8 kernel of both runs, compiled ones twice under AC.
    extra = ["--moe.backend", "mega", "--precision.moe", "fp8_blockwise", "--model.n_layers", "1",
             "--training.seq_len", "16", "--training.local_batch_size", "1", *more]
    cached, losses, _ = _train(tmp_path, extra, steps=2)
    assert cached.precision.expert_copies == "fp8_blockwise"
    _, plain_losses, _ = _train(tmp_path, extra + ["--precision.compute_copies", "false"], steps=2)
    assert losses[0] == plain_losses[0]
    assert losses == pytest.approx(plain_losses, rel=1e-4)


def _expert_grads_each_step(trainer, steps: int) -> tuple[list[float], list[list[torch.Tensor]]]:
    """Losses, and the first layer's expert gradients as the optimizer reads them at each step (the
    carriers' ``.grad`` where there are carriers, else the parameters')."""
    experts = trainer.model.layers["0"].moe.experts
    seen, step = [], trainer.optimizer.step

    def recording_step(*args, **kwargs):
        copies = experts.copies
        carriers = copies.grad_carriers if copies is not None else []
        seen.append([t.grad.clone() for t in carriers] or [getattr(experts, n).grad.clone() for n in EXPERT_WEIGHTS])
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    return run_losses(trainer, steps), seen


def test_fp8_copies_carry_bf16_gradients(tmp_path, narrow_debug_model):
    """With the Triton AdamW in one process the FP8 experts' gradients land on bf16 carriers without
    storage (the parameters get none): bitwise the bf16 gradients the per-call path writes before its
    cast to float32, compiled under full AC (the carriers reach the op through the traced graph). The
    losses follow that run closely, not bitwise: the clipping norm sums the bf16
    gradients in another group than the float32 ones (a last-bit difference in the clip factor)."""
    extra = ["--moe.backend", "mega", "--precision.moe", "fp8_blockwise", "--model.n_layers", "1",
             "--training.seq_len", "16", "--training.local_batch_size", "1", "--optimizer.implementation", "triton",
             "--compile.enable", "--compile.backend", "aot_eager", "--activation_checkpoint.mode", "full"]
    cached = make_trainer(tmp_path / "cached", *extra, base=_BASE)
    experts = cached.model.layers["0"].moe.experts
    copies = experts.copies
    assert copies.mode == "fp8_blockwise" and copies.carries_grads
    carriers = copies.grad_carriers
    assert [tuple(c.shape) for c in carriers] == [tuple(getattr(experts, n).shape) for n in copies.params]
    assert all(c.dtype == torch.bfloat16 and c.stride() == (0, 0, 0) and c.requires_grad for c in carriers)
    losses, grads = _expert_grads_each_step(cached, 2)
    assert all(getattr(experts, n).grad is None for n in copies.params)
    assert all(g.dtype == torch.bfloat16 and g.is_contiguous() for g in grads[0])
    assert not any(k.endswith("_grad_carrier") for k in cached.model.state_dict())
    plain = make_trainer(tmp_path / "plain", *extra, "--precision.compute_copies", "false", base=_BASE)
    plain_losses, plain_grads = _expert_grads_each_step(plain, 2)
    for name, got, want in zip(EXPERT_WEIGHTS, grads[0], plain_grads[0]):
        assert want.dtype == torch.float32 and torch.equal(got, want.bfloat16()) and torch.equal(got.float(), want), name
    assert losses[0] == plain_losses[0]
    assert losses == pytest.approx(plain_losses, rel=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_eager_forward_refreshes_a_stale_copy(tmp_path, mode):
    """Weights changed in place outside the trainer (here: scaled) are seen by the next eager call."""
    backend = "mega" if mode == "fp8_blockwise" else "torch"
    extra = ["--moe.backend", backend, "--model.n_layers", "1"]
    if mode == "fp8_blockwise":
        extra += ["--precision.moe", "fp8_blockwise"]
    trainer = make_trainer(tmp_path, *extra, base=_BASE)
    assert trainer.precision.expert_copies == mode
    experts = trainer.model.layers["0"].moe.experts
    assert isinstance(experts.copies, ComputeCopies)
    inputs = next(iter(trainer.dataloader))[0].to(DEVICE)

    def forward():
        with torch.no_grad(), trainer.amp:
            return trainer.model(inputs)[0].float()

    before = forward()
    with torch.no_grad():
        experts.w2.mul_(3.0)
    assert experts.copies.is_stale(experts)
    after = forward()
    assert not experts.copies.is_stale(experts)
    assert (experts.args.quantized is not None) == (mode == "fp8_blockwise")
    experts.use_compute_copies(None, dataclasses.replace(experts.args, quantized=None))
    uncached = forward()
    assert torch.equal(after, uncached)
    assert not torch.equal(before, after)


def test_resume_with_copies_gives_same_losses(tmp_path):
    """A checkpoint load writes the weights in place: the copies are refreshed before the next step."""
    common = ["--moe.backend", "torch", "--checkpoint.enable", "--checkpoint.interval", "2"]
    _, ref, _ = _train(tmp_path / "ref", ["--moe.backend", "torch"], steps=4)
    first = make_trainer(tmp_path, *common, base=_BASE)
    data_iter = iter(first.dataloader)
    for first.step in (1, 2):
        first.train_step(data_iter)
    first.checkpoint.save(2)
    resumed = make_trainer(tmp_path, *common, base=_BASE)
    assert resumed.precision.expert_copies == "bf16"
    resumed.step = resumed.checkpoint.maybe_load()
    data_iter = iter(resumed.dataloader)
    losses = []
    for resumed.step in (3, 4):
        losses.append(resumed.train_step(data_iter)[0])
    assert losses == ref[2:]


def test_optimizer_step_invalidates_the_copies(tmp_path):
    """Fused AdamW (the trainer's choice on a GPU), and foreach AdamW on DTensors, update the weights
    without moving their version counters; the precision step's optimizer hook invalidates the
    copies instead, so a later eager forward refreshes them."""
    trainer = make_trainer(tmp_path, "--moe.backend", "torch", "--model.n_layers", "1", base=_BASE)
    experts = trainer.model.layers["0"].moe.experts
    assert not experts.copies.is_stale(experts)
    for p in trainer.model.parameters():
        p.grad = torch.ones_like(p)
    trainer.optimizer.step()
    assert experts.copies._versions is None  # invalidated by the hook, not by the counters
