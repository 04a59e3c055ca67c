"""Helpers shared by the test modules: one place for the small trainer runs, the multi-process
(gloo) runs and their single-process references, and the Triton-interpreter guard.

- Trainer runs: :data:`DEBUG_CONFIG`, :data:`SMALL`, :func:`trainer_args`, :func:`make_trainer`,
  :func:`run_losses`, :func:`logged_steps`, :data:`SHORT`, :func:`short_run_losses`,
  :func:`assert_steps_close` (``train.main``'s logged steps against a reference run's).
- The debug model without the trainer: :func:`debug_model`.
- Distributed runs (tests/test_distributed.py's protocol): :data:`DIST_BASE`, :func:`global_batches`,
  :func:`batch_iter`, :func:`run_steps` (which can record :func:`full_grads` before each clip),
  :func:`full_state`, :func:`load_full_state`, :func:`assert_same_training`, :func:`assert_same_grads`;
  the pool of gloo workers: :func:`run_job` (tests/multiprocess.py).
- Files: :func:`write_file`, :func:`load_script`.
- Kernel inputs: :func:`random_seed`, :func:`rel_error`, :func:`make_routing`; MoE backends'
  inputs and gradients: :data:`MOE_CASES`, :func:`make_inputs`, :func:`run_with_grads`.
- Triton: :data:`HAS_CUDA`, :data:`DEVICE`, :func:`skip_unless_runnable` (tests/triton_interpreter.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.multiprocess import close_pools, free_port, run_job  # noqa: F401  (re-exported)
from tests.triton_interpreter import DEVICE, HAS_CUDA, skip_unless_runnable  # noqa: F401  (re-exported)

ROOT = Path(__file__).resolve().parent.parent
DEBUG_CONFIG = ["--config", "train_configs/debug_model.toml"]

# --------------------------------------------------------------------------------------------------
# Small single-process trainer runs
# --------------------------------------------------------------------------------------------------

# The debug model cut to 2 layers, 4 x 64 tokens a step, every step logged.
SMALL = ["--model.n_layers", "2", "--training.seq_len", "64", "--training.local_batch_size", "4",
         "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2"]


def trainer_args(dump_folder, *extra: str, base: list[str] = SMALL) -> list[str]:
    return [*DEBUG_CONFIG, "--job.dump_folder", str(dump_folder), *base, *extra]


def make_trainer(tmp_path, *extra: str, base: list[str] = SMALL):
    """A Trainer of the debug model (``base`` then ``extra`` over train_configs/debug_model.toml)
    writing under ``tmp_path``."""
    from components.config import parse_args
    from train import Trainer

    return Trainer(parse_args(trainer_args(tmp_path, *extra, base=base)))


def run_losses(trainer, steps: int | None = None) -> list[float]:
    """Train ``steps`` steps (default ``[training] steps``, which also sets the lr schedule) on the
    trainer's own dataloader; the per-step losses."""
    losses = []
    data_iter = iter(trainer.dataloader)
    trainer.step = 0
    while trainer.step < (trainer.cfg.training.steps if steps is None else steps):
        trainer.step += 1
        losses.append(trainer.train_step(data_iter)[0])
    return losses


# 3 steps of the 1-layer debug model, 2 x 32 tokens a step (SMALL's other settings).
SHORT = ["--training.steps", "3", "--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size", "2"]


def short_run_losses(tmp_path, *extra: str) -> list[float]:
    """Losses of the :data:`SHORT` run through the trainer."""
    return run_losses(make_trainer(tmp_path, *SHORT, *extra))


def debug_model(n_layers: int = 2, moe_backend: str = "grouped_mm", expert_bias: bool = False,
                init: bool = True, **overrides):
    """The debug flavor (``overrides``: Qwen3MoEArgs fields) built on the meta device; with ``init``
    materialized on the CPU and initialized from seed 0."""
    from models.qwen3.args import get_model_args
    from models.qwen3.model import Qwen3MoE

    args = dataclasses.replace(get_model_args("debug", n_layers=n_layers), **overrides)
    if init:
        torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen3MoE(args, moe_backend=moe_backend, use_expert_bias=expert_bias)
    if init:
        model.to_empty(device="cpu")
        model.init_weights()
    return model


_STEP_LINE = re.compile(r"^step:\s+(\d+)\s+loss:\s+(\S+)\s+aux_loss:\s+(\S+)\s+grad_norm:\s+(\S+)\s+lr:\s+(\S+)\s+"
                        r"memory:\s+(\S+)GiB\s+tps:\s+(\S+)\s+step_time:\s+(\S+)s", re.M)


def logged_steps(out: str) -> dict[int, dict[str, float]]:
    """The trainer's metrics lines (components/metrics.py ``MetricsLogger.log``) by step."""
    steps = {}
    for m in _STEP_LINE.finditer(out):
        steps[int(m.group(1))] = {
            "loss": float(m.group(2)), "aux_loss": float(m.group(3)), "grad_norm": float(m.group(4)),
            "lr": float(m.group(5)), "memory_gib": float(m.group(6)), "tps": float(m.group(7).replace(",", "")),
            "step_time": float(m.group(8))}
    return steps


def assert_steps_close(got_out: str, want_out: str, steps: int, rel: float) -> None:
    """Two runs' logged steps 1..``steps`` (their stdout) agree in loss and gradient norm within
    ``rel``; the differences are printed (pytest -s shows them)."""
    got, want = logged_steps(got_out), logged_steps(want_out)
    assert sorted(got) == sorted(want) == list(range(1, steps + 1)), (got_out, want_out)
    diffs = {(step, key): abs(got[step][key] - want[step][key]) / abs(want[step][key])
             for step in want for key in ("loss", "grad_norm")}
    print("relative differences from the reference run:", {k: f"{v:.1e}" for k, v in diffs.items()})
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] < rel, f"step {worst[0]} {worst[1]}: {got[worst[0]][worst[1]]} vs {want[worst[0]][worst[1]]}"


# --------------------------------------------------------------------------------------------------
# Multi-process runs against one process (tests/test_distributed.py's protocol)
# --------------------------------------------------------------------------------------------------

LOCAL_BS, SEQ, STEPS = 2, 32, 3
DIST_BASE = [*DEBUG_CONFIG, "--model.n_layers", "2", "--training.seq_len", str(SEQ),
             "--training.local_batch_size", str(LOCAL_BS), "--lr_scheduler.warmup_steps", "1",
             "--training.device", "cpu", "--training.mixed_precision_param", "float32"]


def global_batches(dp: int, steps: int = STEPS, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2048, (steps, dp * LOCAL_BS, SEQ + 1), generator=gen)


def batch_iter(batches: torch.Tensor, dp_rank: int, dp: int, accumulate: bool):
    """Yields this rank's micro-batch of each step; with ``accumulate`` (one process standing in
    for dp ranks) yields every rank's micro-batch of a step in turn."""
    for step_batch in batches:
        ranks = range(dp) if accumulate else [dp_rank]
        for r in ranks:
            rows = step_batch[r * LOCAL_BS:(r + 1) * LOCAL_BS]
            yield rows[:, :-1], rows[:, 1:]


def full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() for k, v in sd.items()}


def load_full_state(model, state: dict[str, torch.Tensor]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


# Module wrappers (activation checkpointing, torch.compile) put these in parameter names; state-dict
# names leave them out.
_WRAPPER_PREFIX = re.compile(r"(_checkpoint_wrapped_module|_orig_mod)\.")


def full_grads(model) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient whole, on the CPU, by its state-dict name (None where it has
    none); a DTensor gradient is gathered over its mesh, so every rank must call this together."""
    from torch.distributed.tensor import DTensor

    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None:
            g = (g.full_tensor() if isinstance(g, DTensor) else g).detach().to("cpu", copy=True)
        grads[_WRAPPER_PREFIX.sub("", name)] = g
    return grads


@contextlib.contextmanager
def recording_grads(trainer, grads: list):
    """While open, each ``trainer.train_step`` appends :func:`full_grads` to ``grads`` as it calls
    ``clip_grad_norm_``: after backward and every gradient reduction (FSDP's, ``finish_expert_grads``),
    before the clip and the optimizer, which are blind to a gradient's scale."""
    trainer_module = sys.modules[type(trainer).__module__]
    clip = trainer_module.clip_grad_norm_

    def record_then_clip(*args, **kwargs):
        grads.append(full_grads(trainer.model))
        return clip(*args, **kwargs)

    trainer_module.clip_grad_norm_ = record_then_clip
    try:
        yield
    finally:
        trainer_module.clip_grad_norm_ = clip


def run_steps(trainer, batches, dp, accumulate, start_step=0, grads: list | None = None) -> list[float]:
    """Train one step per global batch of ``batches``; the losses. With ``grads`` (a list), each
    step's gradients before the clip are appended to it (:func:`recording_grads`)."""
    dp_rank = trainer.parallel_dims.dp_mesh.get_local_rank() if trainer.distributed else 0
    it = batch_iter(batches, dp_rank, dp, accumulate)
    losses = []
    recorded = len(grads) if grads is not None else 0
    with recording_grads(trainer, grads) if grads is not None else contextlib.nullcontext():
        for step in range(start_step + 1, start_step + len(batches) + 1):
            trainer.step = step
            losses.append(trainer.train_step(it)[0])
    # A trainer that no longer clips through clip_grad_norm_ would leave the gradients unchecked.
    assert grads is None or len(grads) - recorded == len(batches), "train_step did not call clip_grad_norm_ once"
    return losses


def _grad_units(name: str, grad: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The pieces of a gradient compared on their own: each expert's slice of the expert weights
    (an expert that got no tokens has a zero slice; one expert's wrong scale is not diluted by the
    others), every other parameter whole."""
    if ".experts." in name:
        return [(f"{name}[{e}]", g) for e, g in enumerate(grad)]
    return [(name, grad)]


# Bounds on ||g - g_ref|| / ||g_ref|| per gradient piece, >= 100x under a 1.1x scale error and > 25x
# above what tests/test_distributed.py's layouts measure (docs/testing.md): the first step differs only
# in summation order (at most 7.4e-7), later ones also by the parameters' drift after Adam's steps
# (at most 3.6e-5).
GRAD_RTOL_FIRST_STEP, GRAD_RTOL = 1e-4, 1e-3
# The bound on pieces whose reference gradient is zero (an expert that got no tokens); the smallest
# nonzero piece seen has norm 2e-4.
GRAD_ATOL = 1e-9


def assert_same_grads(got: list[dict], want: list[dict], rtol_first_step: float = GRAD_RTOL_FIRST_STEP,
                      rtol: float = GRAD_RTOL, atol: float = GRAD_ATOL) -> None:
    """Every step's gradients (:func:`run_steps`' ``grads``) agree piece by piece
    (:func:`_grad_units`): ||g - g_ref|| <= rtol x ||g_ref|| + atol in float64, ``rtol_first_step``
    at the first step. A piece off by a factor 1 + s fails for any s > rtol; the largest relative
    difference per step is printed (pytest -s shows it)."""
    assert len(got) == len(want), (len(got), len(want))
    worst = []
    for step, (got_step, want_step) in enumerate(zip(got, want), 1):
        bound = rtol_first_step if step == 1 else rtol
        assert got_step.keys() == want_step.keys(), (step, sorted(got_step.keys() ^ want_step.keys()))
        rel_max, failures = 0.0, []
        for name, ref in want_step.items():
            assert ref is not None and got_step[name] is not None, f"step {step}: {name} has no gradient"
            assert got_step[name].shape == ref.shape, (step, name, got_step[name].shape, ref.shape)
            for (unit, g), (_, r) in zip(_grad_units(name, got_step[name]), _grad_units(name, ref)):
                g, r = g.double(), r.double()
                diff, ref_norm = (g - r).norm().item(), r.norm().item()
                rel_max = max(rel_max, diff / ref_norm if ref_norm > 0 else 0.0)
                if not diff <= bound * ref_norm + atol:
                    ratio = g.norm().item() / ref_norm if ref_norm > 0 else math.inf
                    failures.append(f"{unit}: ||g - g_ref|| = {diff:.3e}, ||g_ref|| = {ref_norm:.3e}, "
                                    f"||g|| / ||g_ref|| = {ratio:.4f}")
        worst.append(rel_max)
        assert not failures, (f"step {step}: gradients before the clip differ from the reference's beyond rtol "
                              f"{bound:g}, atol {atol:g} ({len(failures)} pieces):\n  " + "\n  ".join(failures[:12]))
    print("largest relative gradient difference per step:", [f"{w:.1e}" for w in worst])


def assert_same_training(got: dict, want: dict, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Losses, every step's gradients before the clip (:func:`assert_same_grads`) and the parameters
    after the run (``rtol``, ``atol``) agree."""
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), (got["losses"], want["losses"])
    assert_same_grads(got["grads"], want["grads"])
    assert got["state"].keys() == want["state"].keys()
    for name, value in want["state"].items():
        torch.testing.assert_close(got["state"][name], value, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# --------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------


def write_file(folder, name: str, text: str) -> str:
    p = Path(folder) / name
    p.write_text(text)
    return str(p)


def load_script(name: str):
    """scripts/<name>.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"scripts_{name}"] = module  # dataclasses look their module up while executing it
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------------
# Kernel test inputs (the MoE kernels' tests each had a copy of these)
# --------------------------------------------------------------------------------------------------


def random_seed() -> int:
    """Seed torch from os.urandom (fresh inputs every run; put the seed in failure messages);
    ``TEST_SEED=<n>`` replays a failure's seed."""
    seed = int(os.environ.get("TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(seed)
    return seed


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_routing(T: int, K: int, E: int, kind: str, device=DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids_TK int64, topk_weights_TK float32) for a routing pattern named by ``kind``:
    ``random`` (distinct experts per token, as a top-k router gives), ``empty_expert`` (experts 0
    and E-1 receive nothing), ``one_expert`` (every slot on one expert; ids repeat within a token),
    ``empty_slots`` (expert parallelism's padding: some slots are -1)."""
    if kind == "random":
        ids = torch.rand(T, E, device=device).argsort(dim=1)[:, :K]
    elif kind == "empty_expert":
        ids = 1 + torch.rand(T, E - 2, device=device).argsort(dim=1)[:, :K]
    elif kind == "one_expert":
        ids = torch.full((T, K), E // 2, device=device, dtype=torch.int64)
    elif kind == "empty_slots":
        ids = torch.rand(T, E, device=device).argsort(dim=1)[:, :K]
        ids = torch.where(torch.rand(T, K, device=device) < 0.3, -1, ids)
    else:
        raise ValueError(kind)
    weights = torch.randn(T, K, device=device).softmax(dim=-1)
    return ids.contiguous(), weights


def unrouted_routing(T: int, K: int, E: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``make_routing``'s ``empty_slots`` with the first three tokens having no routed slot and the
    fourth all on expert 0; returns (ids, weights, unrouted_T)."""
    ids, weights = make_routing(T, K, E, "empty_slots")
    ids[:3] = -1
    ids[3] = 0
    return ids, weights, (ids < 0).all(dim=1)


def assert_unrouted_rows_unread(run, x, dy, unrouted_T: torch.Tensor, seed: int) -> None:
    """For an op's ``write_empty_rows`` option: ``run(x, dy, write_empty_rows)`` returns (y, (dx, ds, dw1,
    dw3, dw2)). With the rows of tokens that have no routed slot zero and the default, those rows of y
    are zero; with them NaN and ``write_empty_rows=False``, the routed rows of y and dx and every other
    gradient are unchanged bit for bit (so the NaN rows were never read)."""
    y0, grads0 = run(x, dy, True)
    nan_rows = unrouted_T[:, None]
    y1, grads1 = run(x.masked_fill(nan_rows, float("nan")), dy.masked_fill(nan_rows, float("nan")), False)
    routed = ~unrouted_T
    assert torch.equal(y0[unrouted_T], torch.zeros_like(y0[unrouted_T])), f"seed={seed}"
    assert torch.equal(y1[routed], y0[routed]), f"y; seed={seed}"
    assert torch.equal(grads1[0][routed], grads0[0][routed]), f"dx; seed={seed}"
    for name, a, b in zip(("topk_weights", "w1", "w3", "w2"), grads1[1:], grads0[1:]):
        assert torch.isfinite(a).all() and torch.equal(a, b), f"d{name}; seed={seed}"


def _backend_routing(kind: str, T: int, E: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """topk_ids (T, K) with distinct experts per token, shaped by ``kind``."""
    if kind == "random":
        return torch.rand(T, E, generator=gen).argsort(dim=-1)[:, :K]
    if kind == "one_expert_empty":  # expert 0 never chosen
        return 1 + torch.rand(T, E - 1, generator=gen).argsort(dim=-1)[:, :K]
    if kind == "all_on_first":  # every token's first choice is expert 0, the rest random
        rest = 1 + torch.rand(T, E - 1, generator=gen).argsort(dim=-1)[:, : K - 1]
        return torch.cat([torch.zeros(T, 1, dtype=torch.long), rest], dim=1)
    if kind == "with_empty_slots":  # expert parallelism's padding: some slots are -1
        ids = torch.rand(T, E, generator=gen).argsort(dim=-1)[:, :K]
        return torch.where(torch.rand(T, K, generator=gen) < 0.3, -1, ids)
    raise ValueError(kind)


def make_inputs(T, D, F, E, K, kind, dtype=torch.float32, seed=None):
    """(x, topk_ids, topk_weights, w1, w3, w2) on the CPU from one generator (``seed``, else a fresh one)."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    x = torch.randn(T, D, generator=gen, dtype=dtype)
    ids = _backend_routing(kind, T, E, K, gen)
    w = torch.rand(T, K, generator=gen, dtype=torch.float32) + 0.1
    w1 = torch.randn(E, F, D, generator=gen, dtype=dtype) / D**0.5
    w3 = torch.randn(E, F, D, generator=gen, dtype=dtype) / D**0.5
    w2 = torch.randn(E, D, F, generator=gen, dtype=dtype) / F**0.5
    return x, ids, w, w1, w3, w2


def run_with_grads(fn, x, ids, w, w1, w3, w2, dy, dtype):
    """Runs fn with x and the expert weights in ``dtype`` (routing weights stay float32, as the
    router makes them, unless dtype is float64) and returns (y, [dx, dweights, dw1, dw3, dw2])."""
    x_, w1_, w3_, w2_ = (t.detach().to(dtype).requires_grad_() for t in (x, w1, w3, w2))
    w_ = w.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
    y = fn(x_, ids, w_, w1_, w3_, w2_)
    y.backward(dy.to(y.dtype))
    return y.detach(), [t.grad for t in (x_, w_, w1_, w3_, w2_)]


MOE_CASES = [
    # T, D, F, E, K, routing (make_inputs' kinds)
    (33, 16, 24, 4, 2, "random"),
    (17, 16, 24, 8, 1, "random"),  # top-1
    (9, 16, 24, 8, 8, "random"),  # top-8 = every expert
    (20, 16, 24, 6, 2, "one_expert_empty"),
    (15, 16, 24, 5, 2, "all_on_first"),
    (1, 16, 24, 4, 2, "random"),  # a single token
    (25, 16, 24, 4, 2, "with_empty_slots"),
    (12, 16, 24, 4, 1, "with_empty_slots"),
]
