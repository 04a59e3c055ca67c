"""kernels/adamw.py's step that writes the FP8 experts' e4m3 copies (``adamw_fp8_weight_step_``,
``TritonAdamW.attach_fp8_weights``) against the elementwise step followed by the expert weight
cache's refresh (``QuantizedExpertWeights.quantize(..., round_bf16=True)``), bitwise; and the trainer
with ``[optimizer] fp8_weights_in_step``."""

from __future__ import annotations

import pytest
import torch

from kernels.adamw import TritonAdamW, _adamw_fp8_weight_kernel, adamw_fp8_weight_step_, adamw_step_
from kernels.moe.mega_fp8.weights import TENSOR_FIELDS, WEIGHTS, QuantizedExpertWeights
from tests.triton_interpreter import DEVICE, HAS_CUDA, skip_unless_runnable

skip_unless_runnable(_adamw_fp8_weight_kernel, "kernels.adamw")

SEED = int(torch.randint(0, 2**30, ()))  # fresh inputs every run; failures name it


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _expert_weights(E: int, F: int, D: int, seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(SEED + seed)
    shapes = [(E, F, D), (E, F, D), (E, D, F)]
    ws = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    ws[2][0, :128, :128] = 0.0  # an all-zero block (with zero gradients below): the amax floor's scale
    return [torch.nn.Parameter(w.to(DEVICE)) for w in ws]


def _grad(shape, seed: int, zero_block: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED + seed)
    # Magnitudes over several decades along the rows, as a deep model's gradients.
    g = torch.randn(shape, generator=gen) * torch.logspace(-5, -1, shape[-1])
    if zero_block:
        g[0, :128, :128] = 0
    return g.to(DEVICE)


# (E, F, D, pow2 scales, gradient dtype, grad_scale). The shapes of one layer's w1, w3 (E, F, D) and
# w2 (E, D, F); F = 192, D = 200 leave partial blocks and padding columns in w13t.
CASES = [
    pytest.param(3, 256, 128, False, torch.float32, None, id="E3-F256-D128"),
    pytest.param(3, 192, 200, True, torch.bfloat16, 2.0, id="E3-F192-D200-partial-blocks-pow2-bf16grad-scaled"),
    pytest.param(8, 1536, 2048, False, torch.float32, 1.5, id="E8-F1536-D2048",
                 marks=pytest.mark.skipif(not HAS_CUDA, reason="a realistic shape: needs a CUDA GPU")),
]


@pytest.mark.parametrize("E,F,D,pow2,grad_dtype,grad_scale", CASES)
def test_step_writing_fp8_copies_is_the_step_then_the_refresh(E, F, D, pow2, grad_dtype, grad_scale):
    """Three steps (lr changing each step, weight decay on) of one layer's w1, w3, w2: parameters and
    moments bitwise those of the elementwise step (adamw_step_), and all ten e4m3 / scale tensors
    bitwise the refresh's from the updated float32 weights (rounded to bf16 inside it)."""
    fused, plain = _expert_weights(E, F, D, 0), _expert_weights(E, F, D, 0)
    moments = [[torch.zeros_like(p) for p in fused + plain] for _ in range(2)]
    copies = QuantizedExpertWeights.empty(E, F, D, DEVICE, pow2)
    outputs = copies.outputs()
    scale = torch.tensor([grad_scale], device=DEVICE) if grad_scale is not None else None
    for step in range(1, 4):
        kw = dict(lr=3e-2 / step, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step, grad_scale=scale)
        for i, (name, a, b) in enumerate(zip(WEIGHTS, fused, plain)):
            g = _grad(a.shape, 10 * step + i, zero_block=name == "w2").to(grad_dtype)
            adamw_fp8_weight_step_(a.data, g, moments[0][i], moments[1][i], **outputs[name], pow2_scales=pow2, **kw)
            adamw_step_(b.data, g, moments[0][3 + i], moments[1][3 + i], **kw)
            assert torch.equal(a, b), f"seed {SEED}: {name} at step {step}"
            for m in moments:
                assert torch.equal(m[i], m[3 + i]), f"seed {SEED}: {name}'s moments at step {step}"
        want = QuantizedExpertWeights.quantize(*plain, pow2, round_bf16=True)
        for field, got, exp in zip(TENSOR_FIELDS, copies.tensors(), want.tensors()):
            assert torch.equal(_bytes(got), _bytes(exp)), f"seed {SEED}: {field} at step {step}"
    # The rounding to bf16 matters at these values: without it some bytes would differ.
    unrounded = QuantizedExpertWeights.quantize(*plain, pow2, round_bf16=False)
    assert not all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(copies.tensors(), unrounded.tensors()))


def test_a_step_without_the_gradient_leaves_the_copies():
    (w,) = _expert_weights(1, 128, 128, 1)[:1]
    copies = QuantizedExpertWeights.quantize(w.detach(), w.detach(), w.detach().mT.contiguous(), round_bf16=True)
    before = [t.clone() for t in copies.tensors()]
    opt = TritonAdamW([w])
    opt.attach_fp8_weights(w, copies.outputs()["w1"])
    opt.step()  # no gradient: nothing written
    assert all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(copies.tensors(), before))


def test_attach_fp8_weights_refuses_what_it_cannot_write():
    w = torch.nn.Parameter(torch.zeros(2, 128, 256, device=DEVICE))
    flat = torch.nn.Parameter(torch.zeros(128, 256, device=DEVICE))
    opt = TritonAdamW([w, flat])
    outputs = QuantizedExpertWeights.empty(2, 128, 256, DEVICE).outputs()
    with pytest.raises(ValueError, match="not one this optimizer updates"):
        opt.attach_fp8_weights(torch.nn.Parameter(w.detach().clone()), outputs["w1"])
    with pytest.raises(ValueError, match=r"an \(E, N, K\) expert weight"):
        opt.attach_fp8_weights(flat, outputs["w1"])
    with pytest.raises(ValueError, match=r"attach_fp8_weights: q must be a contiguous"):
        opt.attach_fp8_weights(w, outputs["w2"])  # w2's layouts are (E, D, F)
    opt.attach_fp8_weights(w, outputs["w1"])
    with pytest.raises(ValueError, match="already has a copy written in the step"):
        opt.attach_shadow(w, torch.zeros(w.shape, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match=r"adamw_fp8_weight_step_: the parameter must be an \(E, N, K\)"):
        adamw_fp8_weight_step_(flat.detach(), flat.detach(), flat.detach(), flat.detach(), **outputs["w1"], lr=1e-3,
                               beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1)


def test_fp8_weights_in_step_stops_where_it_cannot_apply():
    """Each setting it cannot run with stops the run at start, naming what to change."""
    from components.config import ConfigError, parse_args
    from tests.utils import DEBUG_CONFIG
    from train import check_fp8_weights_in_step

    ok = ["--optimizer.implementation", "triton", "--moe.backend", "mega", "--quantize.moe", "fp8_blockwise",
          "--training.mixed_precision_param", "bfloat16", "--optimizer.fp8_weights_in_step"]
    check_fp8_weights_in_step(parse_args([*DEBUG_CONFIG, *ok]), distributed=False)
    check_fp8_weights_in_step(parse_args(DEBUG_CONFIG), distributed=True)  # off (the default): nothing to check
    for extra, distributed, message in [
        (["--optimizer.implementation", "foreach"], False, 'needs \\[optimizer\\] implementation = "triton"'),
        (["--quantize.moe", "none"], False, 'moe = "fp8_blockwise"'),
        (["--moe.cache_expert_weights", "false"], False, "cache_expert_weights = true"),
        (["--training.mixed_precision_param", "float32"], False, 'mixed_precision_param = "bfloat16"'),
        ([], True, "one process only"),
    ]:
        with pytest.raises(ConfigError, match=message + ".*fp8_weights_in_step = false"):
            check_fp8_weights_in_step(parse_args([*DEBUG_CONFIG, *ok, *extra]), distributed)


@pytest.mark.integration
def test_trainer_writes_fp8_copies_in_the_optimizer_step(tmp_path, monkeypatch):
    """The debug model with FP8 experts, one process, the Triton AdamW: with the key on, the optimizer
    writes the expert weight cache (no refresh runs; no bf16 copy of the experts is written) and
    training is bitwise the run with it off, which refreshes the cache before the second step."""
    from components.compute_weights import ComputeWeights
    from tests.utils import make_trainer, run_losses

    calls = []
    real_refresh = ComputeWeights.refresh
    monkeypatch.setattr(ComputeWeights, "refresh", lambda self, owner: (calls.append(self), real_refresh(self, owner)))

    def run(in_step: bool):
        calls.clear()
        trainer = make_trainer(tmp_path, "--optimizer.implementation", "triton", "--moe.backend", "mega",
                               "--quantize.moe", "fp8_blockwise", "--training.mixed_precision_param", "bfloat16",
                               "--model.n_layers", "1", "--training.seq_len", "16", "--training.local_batch_size",
                               "1", "--training.device", DEVICE, "--training.max_norm", "0.5",
                               "--optimizer.fp8_weights_in_step", str(in_step).lower())
        losses = run_losses(trainer, 2)
        experts = trainer.model.layers["0"].moe.experts
        params = [getattr(experts, n) for n in WEIGHTS]
        if in_step:  # current after the last step (off, the next step would refresh them)
            fresh = QuantizedExpertWeights.quantize(*(p.detach() for p in params), round_bf16=True)
            for got, want in zip(experts.compute_weights.quantized.tensors(), fresh.tensors()):
                assert torch.equal(_bytes(got), _bytes(want))
            assert not experts.compute_weights.is_stale(experts)
        assert not any(id(p) in trainer.optimizer._shadows for p in params)
        state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        return trainer, losses, state, len(calls)

    trainer, losses, state, refreshes = run(True)
    assert trainer.weight_cache_mode == "fp8_blockwise" and trainer.caches_in_optimizer == 1
    assert refreshes == 0
    plain, plain_losses, plain_state, plain_refreshes = run(False)
    assert plain.caches_in_optimizer == 0 and plain_refreshes == 1
    assert losses == plain_losses
    for k, v in plain_state.items():
        assert torch.equal(state[k], v), k


def test_optimizer_benchmark_fp8_experts_runs():
    """bench/optimizer.py's --fp8-experts rows at a tiny shape (CPU: interpreter, wall clock); the
    benchmark itself checks the two paths bitwise."""
    from bench import optimizer
    from bench.timing import time_ms, wall_ms

    rows = optimizer.fp8_expert_rows(2, 128, 128, 1, DEVICE, time_ms if HAS_CUDA else wall_ms, ((64, 8), (32, 4)))
    assert [name for name, *_ in rows][-2:] == ["AdamW step writing the e4m3 copies, 64 rows x 8 warps",
                                               "AdamW step writing the e4m3 copies, 32 rows x 4 warps"]



_COMPILE_SM90 = """
import os, re, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from kernels.adamw import FP8_ROWS, FP8_WARPS, _adamw_fp8_weight_kernel as fn

f32, u8 = torch.empty(1), torch.empty(1, dtype=torch.uint8)
args = dict(p_ptr=f32, g_ptr=torch.empty(1, dtype=torch.bfloat16), m_ptr=f32, v_ptr=f32, scale_ptr=f32, q_ptr=u8,
            s_ptr=f32, qt_ptr=u8, st_ptr=f32, N=768, K=2048, LDT=768, QT_COL0=0, QT_COLS=768, LDST=6, ST_COL0=0,
            lr=1e-4, wd=0.1, beta1=0.9, beta2=0.95, eps=1e-8, step_size=1e-3, bc2_sqrt=0.5)
consts = dict(HAS_SCALE=True, POW2=False, SOFT=False, TRANS=True, ROWS=FP8_ROWS)
names = list(fn.arg_names)
signature = {n: "constexpr" if n in consts else mangle_type(args[n]) for n in names}
src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": FP8_WARPS})
cubin = os.path.join(tempfile.mkdtemp(), "k.cubin")
open(cubin, "wb").write(kernel.asm["cubin"])
sass = subprocess.run([sys.argv[1], "-sass", cubin], capture_output=True, text=True, check=True).stdout
res = subprocess.run([sys.argv[1], "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
regs, stack = re.search(r"REG:(\\d+) STACK:(\\d+)", res).groups()
print("regs", regs, "stack", stack, "local", bool(re.search(r"\\b(LDL|STL)\\b", sass)))
"""


def test_compiles_for_sm90_without_spills():
    """The default launch (FP8_ROWS rows, FP8_WARPS warps) compiled for sm_90 with Triton's own ptxas,
    on any machine (in a process without the interpreter): no register spills; a whole 128 x 128
    block per step spilled at any warp count."""
    import os
    import subprocess
    import sys

    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("triton ships no cuobjdump here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _COMPILE_SM90, cuobjdump], capture_output=True, text=True,
                         timeout=300, cwd=root, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    _, regs, _, stack, _, local = out.stdout.split()
    assert int(stack) == 0 and local == "False" and int(regs) <= 255, out.stdout
