"""FP8 dense linears (``[precision] linear = "fp8_rowwise"``): the rowwise GEMMs, the module swap and
training through ``train.py``, on CPU (an exact emulation of ``torch._scaled_mm`` there).

Tolerances. e4m3 keeps 3 mantissa bits: rounding to nearest moves a value by at most 2^-4 of
itself and by about 2.5% RMS over a binade (more for values small enough to land among the
subnormals). A product of two quantized operands therefore carries ~3.5-4% relative error per
term, and because the errors are independent the relative Frobenius error of a whole GEMM output
stays at that level (measured: 3.8% on Gaussian data). So FP8 against the exact product is
checked at < 5%; FP8 against the float64 product of the *dequantized* operands (only the
accumulation order and the bf16 output differ) at < 1%.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn as nn

from components.precision.float8 import Float8Linear, convert_to_float8
from kernels.fp8.rowwise import E4M3_MAX, fp8_linear, quantize_rowwise, scaled_mm_rowwise
from models.qwen3.args import Qwen3MoEArgs, get_model_args
from models.qwen3.model import Qwen3MoE
from tests.utils import DEBUG_CONFIG, assert_steps_close, debug_model, make_trainer, short_run_losses
from tests.utils import rel_error as rel


def test_quantize_rowwise_scales_and_range():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 48, generator=gen) * torch.tensor([1e-6, 1e-2, 1.0, 3.0, 1e4, 0.0]).unsqueeze(1)
    q, s = quantize_rowwise(x)
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and s.shape == (6, 1) and s.dtype == torch.float32
    mantissa, _ = torch.frexp(s)
    assert (mantissa == 0.5).all(), "scales must be powers of two"
    assert q.float().abs().max() <= E4M3_MAX
    assert (q[5].float() == 0).all() and torch.isfinite(s).all()  # an all-zero row
    # Each non-zero row uses the top binade of e4m3: its amax lands in (224, 448].
    amax_q = q[:5].float().abs().amax(dim=1)
    assert ((amax_q > 224) & (amax_q <= 448)).all(), amax_q
    assert rel(q.float() * s, x) < 0.05


@pytest.mark.parametrize("M,K,N", [(64, 128, 96), (37, 40, 48)])  # K = 40 is zero-padded to 48
def test_scaled_mm_matches_dequantized_product(M, K, N):
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen)
    got = scaled_mm_rowwise(a, b, use_fast_accum=False)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    (qa, sa), (qb, sb) = quantize_rowwise(a), quantize_rowwise(b)
    exact_fp8 = (qa.double() * sa.double()) @ (qb.double() * sb.double()).t()
    assert rel(got, exact_fp8) < 1e-2
    assert rel(got, a.double() @ b.double().t()) < 0.05


def fp8_and_reference(x, w, dy, dtype):
    """(y, dx, dw) of fp8_linear with x in ``dtype`` and w in float32, and of the float64 product."""
    x_ = x.detach().to(dtype).requires_grad_()
    w_ = w.detach().float().requires_grad_()
    y = fp8_linear(x_, w_)
    y.backward(dy.to(y.dtype))
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = x64 @ w64.t()
    y64.backward(dy.double())
    return (y, x_.grad, w_.grad), (y64, x64.grad, w64.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 24, 64, 96), (3, 7, 32, 16)])  # (B, L, K, N); 21 tokens: padded in wgrad
def test_fp8_linear_forward_and_grads_vs_reference(dtype, shape):
    B, L, K, N = shape
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(B, L, K, generator=gen)
    w = torch.randn(N, K, generator=gen) / K**0.5
    dy = torch.randn(B, L, N, generator=gen)
    got, want = fp8_and_reference(x, w, dy, dtype)
    assert got[0].dtype == dtype and got[1].dtype == dtype and got[2].dtype == torch.float32
    for name, g, r in zip(["y", "dx", "dw"], got, want):
        assert g.shape == r.shape
        assert rel(g, r) < 0.05, f"{name}: relative error {rel(g, r):.3f}"


def test_outlier_rows_keep_their_own_precision():
    """Rows (tokens) 10^6 apart in magnitude: each gets its own scale, so every row of y, and of
    dx, is as accurate as FP8 allows. One scale for the whole tensor would flush the small rows
    to zero. (The wgrad quantizes along the tokens, so there the small tokens are flushed, as in
    torchao's recipe; dW stays accurate because they also contribute the least to it.)"""
    gen = torch.Generator().manual_seed(3)
    row_scale = 10.0 ** torch.linspace(-3, 3, 32)
    x = torch.randn(32, 64, generator=gen) * row_scale.unsqueeze(1)
    w = torch.randn(48, 64, generator=gen) / 8
    dy = torch.randn(32, 48, generator=gen) * row_scale.unsqueeze(1)
    (y, dx, dw), (y64, dx64, dw64) = fp8_and_reference(x, w, dy, torch.float32)
    for got, want in ((y, y64), (dx, dx64)):
        per_row = (got.double() - want).norm(dim=1) / want.norm(dim=1)
        assert per_row.max() < 0.08, per_row
    assert rel(dw, dw64) < 0.05
    # What a single per-tensor scale would give for the smallest rows:
    s = x.abs().max() / E4M3_MAX
    tensorwise = (x / s).to(torch.float8_e4m3fn).float() * s
    assert rel(tensorwise[0], x[0]) > 0.5


class TinyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = Float8Linear(32, 64, bias=False)
        self.down = Float8Linear(64, 32, bias=True)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiles_fullgraph_and_matches_eager(backend):
    """Compiled without graph breaks, and the same gradients as eager: the backward's GEMMs are an
    opaque custom op (inductor on CUDA got them wrong when it compiled them)."""
    torch.manual_seed(4)
    block = TinyBlock()
    x = torch.randn(2, 24, 32, requires_grad=True)
    block(x).square().sum().backward()
    eager = [t.grad.clone() for t in (x, *block.parameters())]
    for t in (x, *block.parameters()):
        t.grad = None
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    compiled(x).square().sum().backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    for want, t in zip(eager, (x, *block.parameters())):
        if backend == "aot_eager":
            torch.testing.assert_close(t.grad, want, rtol=0, atol=0)
        else:
            # Inductor rounds the forward's float32 work differently and the FP8 quantization of
            # dy amplifies it (measured ~3%); a wrongly compiled backward is off by 100%.
            assert rel(t.grad, want) < 0.06, (t.shape, rel(t.grad, want))


def test_conversion_picks_exactly_the_attention_projections():
    model = debug_model(init=False)
    before = dict(model.named_parameters())
    logs = []
    assert convert_to_float8(model, "fp8_rowwise", log=logs.append) == 8
    converted = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {f"layers.{i}.attention.{p}" for i in range(2) for p in ("wq", "wk", "wv", "wo")}
    # Parameters are the same objects under the same names (FSDP, optimizer and checkpoints see no change).
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert type(model.output) is nn.Linear and type(model.layers["0"].moe.router.gate) is nn.Linear
    assert "8 attention projections" in logs[-1]
    assert convert_to_float8(debug_model(init=False), "none") == 0


def test_conversion_skips_shapes_fp8_cannot_run():
    model = debug_model(n_layers=1, init=False, n_heads=3, n_kv_heads=1, head_dim=8)  # q: 24 features, k and v: 8
    logs = []
    assert convert_to_float8(model, "fp8_rowwise", log=logs.append) == 0
    assert sum("stays bf16" in line for line in logs) == 4
    assert "layers.0.attention.wq stays bf16: its shape (24, 256)" in logs[0]


def test_converted_model_matches_bf16_model():
    """The debug model with FP8 attention projections against the same weights in float32: the
    logits move by FP8 error only."""
    torch.manual_seed(5)
    args = get_model_args("debug", n_layers=1)
    ref = Qwen3MoE(args)
    ref.init_weights()
    fp8 = Qwen3MoE(args)
    fp8.load_state_dict(ref.state_dict())
    convert_to_float8(fp8, "fp8_rowwise", log=lambda msg: None)
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the trainer runs a single process
        logits, _ = fp8(tokens)
    want, _ = ref(tokens)
    assert logits.dtype == torch.bfloat16
    assert rel(logits, want) < 0.05


def test_train_with_fp8_linears(tmp_path):
    """train.py end to end: FP8 projections follow the bf16 run's losses; so do FP8 projections
    and FP8 experts together under full activation checkpointing + compile (fullgraph) in bf16
    autocast."""
    ref = short_run_losses(tmp_path)
    got = short_run_losses(tmp_path, "--precision.linear", "fp8_rowwise")
    assert all(math.isfinite(v) for v in got)
    assert got == pytest.approx(ref, rel=1e-2)
    got = short_run_losses(tmp_path, "--precision.linear", "fp8_rowwise", "--precision.moe", "fp8_rowwise",
                           "--activation_checkpoint.mode", "full", "--compile.enable", "--compile.backend", "aot_eager",
                           "--training.mixed_precision_param", "bfloat16")
    assert got == pytest.approx(ref, rel=1e-2)


def test_train_main_with_fp8_linears_and_experts(tmp_path, capsys):
    """train.py main with FP8 projections and FP8 experts follows main's bf16 run of the same
    config (same seed, same data) in the logged losses and gradient norms. Measured on CPU: at
    most 5e-5 (loss) and 1e-4 (grad norm) apart relatively, near the 4 printed decimals; checked
    at < 2e-3."""
    from train import main

    args = [*DEBUG_CONFIG, "--job.dump_folder", str(tmp_path), "--training.steps", "2",
            "--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
            "--metrics.log_freq", "1"]
    assert main(args) == 0
    want = capsys.readouterr().out
    assert main([*args, "--precision.linear", "fp8_rowwise", "--precision.moe", "fp8_rowwise"]) == 0
    out = capsys.readouterr().out
    assert "4 attention projections run in FP8" in out and "run in FP8" not in want
    assert_steps_close(out, want, steps=2, rel=2e-3)


@pytest.mark.gpu  # FP8 matmuls: sm_89 or newer
@pytest.mark.parametrize("M,K,N", [(1000, 256, 384), (4096, 2048, 512)])
def test_fp8_linear_cuda(M, K, N):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(M, K, generator=gen)
    w = torch.randn(N, K, generator=gen) / K**0.5
    dy = torch.randn(M, N, generator=gen)
    x_ = x.cuda().bfloat16().requires_grad_()
    w_ = w.cuda().bfloat16().requires_grad_()
    y = fp8_linear(x_, w_)
    y.backward(dy.cuda().bfloat16())
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    y64 = x64 @ w64.t()
    y64.backward(dy.double())
    for name, g, r in zip(["y", "dx", "dw"], (y, x_.grad, w_.grad), (y64, x64.grad, w64.grad)):
        assert rel(g.cpu(), r) < 0.05, f"{name}: relative error {rel(g.cpu(), r):.3f}"


@pytest.mark.skipif(sys.platform != "linux", reason="multi-process tests use gloo on Linux")
def test_fsdp2_trains_like_one_process(tmp_path):
    """FSDP2 over 2 CPU ranks with FP8 linears and FP8 experts against one process taking the
    same micro-batches in turn: the FP8 weights stay plain parameters that FSDP shards. (Each rank
    quantizes its own micro-batch exactly as the single process does; only the gradient reduction
    order differs, hence float32-level tolerances.)"""
    from components.config import parse_args
    from tests.test_distributed import BASE, full_state, global_batches, run_steps, spawn
    from train import Trainer

    fp8 = ["--precision.linear", "fp8_rowwise", "--precision.moe", "fp8_rowwise"]
    single = Trainer(parse_args(BASE + fp8 + ["--training.global_batch_size", "4"]))
    init = str(tmp_path / "init.pt")
    torch.save(full_state(single.model), init)
    losses = run_steps(single, global_batches(2), 2, accumulate=True)
    got = spawn(2, fp8 + ["--parallelism.data_parallel_shard_degree", "2"], init, str(tmp_path / "out.pt"))
    assert got["losses"] == pytest.approx(losses, rel=1e-4)
    for name, value in full_state(single.model).items():
        # Only the gradient reduction order differs, but in FP8 that can flip an e4m3 code of an
        # operand quantized from a reduced value (a 6% step in one element), and Adam turns such a
        # flip into an update differing by a good part of lr (3e-3); on torch 2.11 up to 0.16% of an
        # attention weight's entries, at most 6.3e-4 apart. So: float32-level agreement everywhere
        # but under 1% of the entries,
        # and those within 2 lr x steps (a wrong reduction or a lost shard moves nearly all of them).
        diff = (got["state"][name].double() - value.double()).abs()
        far = diff > 1e-4 + 1e-3 * value.double().abs()
        assert far.double().mean() < 1e-2, f"{name}: {int(far.sum())} of {far.numel()} entries differ (max {diff.max():.2e})"
        assert diff.max() < 2 * 3e-3 * 2, f"{name}: {diff.max():.2e} apart (beyond 2 updates of lr 3e-3)"


@pytest.mark.gpu  # FP8 matmuls: sm_89 or newer
@pytest.mark.parametrize("dy_scale", [1.0, 1e-7])
def test_fp8_linear_cuda_compiled_as_trained(dy_scale):
    """The projection as the trainer runs it on the GPU: a float32 weight under bf16 autocast,
    eager and compiled, at the Qwen3-30B-A3B q-projection shape,
    with gradients as small as a deep model's: output and both gradients against float64."""
    gen = torch.Generator().manual_seed(8)
    M, K, N = 16384, 2048, 4096
    x = torch.randn(M, K, generator=gen)
    w = torch.randn(N, K, generator=gen) / K**0.5
    dy = torch.randn(M, N, generator=gen) * dy_scale

    def f(x_, w_):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return fp8_linear(x_, w_, torch.bfloat16)

    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    (x64 @ w64.t()).backward(dy.double())
    # aot_eager too: the autograd.Function this op replaced got a zero tangent under AOTAutograd on CUDA.
    for label, fn in (("eager", f), ("aot_eager", torch.compile(f, backend="aot_eager", fullgraph=True)),
                      ("inductor", torch.compile(f, fullgraph=True))):
        x_ = x.cuda().bfloat16().requires_grad_()
        w_ = w.cuda().requires_grad_()
        y = fn(x_, w_)
        y.backward(dy.cuda().bfloat16())
        assert w_.grad.dtype == torch.float32
        errs = {name: rel(g.cpu(), r) for name, g, r in
                zip(["y", "dx", "dw"], (y, x_.grad, w_.grad), (x64 @ w64.t(), x64.grad, w64.grad))}
        assert max(errs.values()) < 0.05, f"{label}: relative errors {errs}"


@pytest.mark.gpu  # FP8 matmuls: sm_89 or newer
@pytest.mark.parametrize("keep", ["none", "attention_and_moe"])
def test_fp8_linear_trainer_gradients_cuda(tmp_path, keep):
    """One micro-batch through the trainer's compiled, checkpointed model on the GPU: every
    parameter's gradient with FP8 attention projections against the bf16 model's (same init, same
    batch). A wrong FP8 backward shows here as a gradient far off (a training run showed the first
    step's gradient norm halved)."""
    def grads(*extra):
        trainer = make_trainer(tmp_path, "--training.device", "cuda", "--compile.enable",
                               "--activation_checkpoint.mode", "full", "--activation_checkpoint.keep", keep,
                               "--training.mixed_precision_param", "bfloat16", *extra)
        inputs_BL, labels_BL = (t.cuda() for t in next(iter(trainer.dataloader)))
        with trainer.amp:
            logits_BLV, _ = trainer.model(inputs_BL)
            ce = trainer.loss_fn(logits_BLV, labels_BL)
        ce.backward()
        return {name: p.grad.float().cpu() for name, p in trainer.model.named_parameters() if p.grad is not None}

    ref, got = grads(), grads("--precision.linear", "fp8_rowwise")
    assert got.keys() == ref.keys()
    errs = {name: rel(got[name], ref[name]) for name in ref if ref[name].norm() > 0}
    worst = sorted(errs.items(), key=lambda kv: -kv[1])[:8]
    norm = lambda g: math.sqrt(sum(t.double().square().sum().item() for t in g.values()))  # noqa: E731
    # Attention weights: FP8 error of their own GEMMs plus what reaches them from later layers. Experts
    # and the router are not checked one by one: a perturbed input can flip a token's top-k choice.
    attention = {name: e for name, e in errs.items() if ".attention.w" in name}
    assert len(attention) == 8 and max(attention.values()) < 0.15, f"worst relative errors: {worst}"
    assert norm(got) == pytest.approx(norm(ref), rel=0.05), f"gradient norms {norm(got)} vs {norm(ref)}; {worst}"


def test_fp8_linear_benchmark_runs():
    """bench/fp8_linear.py at a tiny size on CPU: bf16 and the FP8 custom ops compile with inductor
    and are checked against float64 (FP8-level errors for the FP8 rows)."""
    from bench import fp8_linear

    rows = fp8_linear.main(["--tokens", "64", "--iters", "1", "--device", "cpu", "--timer", "wall", "--only", "wk"])
    assert [r["mode"] for r in rows] == ["bf16", "fp8"]
    errs = {r["mode"]: (r["y"], r["dx"], r["dw"]) for r in rows}
    assert max(errs["bf16"]) < 0.02 and max(errs["fp8"]) < 0.08, errs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,transposed", [((37, 200), False), ((200, 37), True), ((1, 16), False),
                                              ((64, 130), True)])
def test_quantize_rowwise_fast_is_bitwise_the_reference(dtype, shape, transposed):
    """The custom ops' quantizer (row amax + one Triton pass deriving the scales, any strides)
    against quantize_rowwise: the same bytes and scales, on contiguous and transposed views, partial
    tiles, an all-zero row, an outlier row and a row whose scale is exactly a power of two."""
    from kernels.fp8.rowwise import quantize_rowwise_fast
    from tests.triton_interpreter import DEVICE

    seed = int(torch.randint(0, 2**30, ()))  # fresh inputs every run
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape[::-1] if transposed else shape, generator=gen).to(DEVICE, dtype)
    x = x.t() if transposed else x
    x[0] = 0.0
    if x.shape[0] > 2:
        x[2] *= 100.0
    if x.shape[0] > 1:
        # amax exactly 448 * 2^-3: the scale is exactly 2^-3 (a correctly rounded division), not 2^-2
        x[1] = x[1].clamp(-40.0, 40.0)
        x[1, 0] = 448.0 * 2.0**-3
    q, s = quantize_rowwise_fast(x, use_triton=True)  # the kernel, on CPU through the interpreter
    q_ref, s_ref = quantize_rowwise(x)
    assert q.is_contiguous() and q.shape == x.shape and s.shape == (x.shape[0], 1)
    assert torch.equal(s, s_ref), f"seed {seed}"
    if x.shape[0] > 1:
        assert s[1].item() == 2.0**-3, f"seed {seed}: scale {s[1].item()} for amax 448 * 2^-3"
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), f"seed {seed}"
