"""The precision room (components/precision): what the experts and the linears compute with,
decided from the config and the parallel layout alone, and refused before any work when it cannot
run here."""

import pytest
import torch

from components.config import ConfigError, JobConfig, parse_args
from components.precision import Precision
from kernels.moe import BackendArgs
from parallelisms.parallel_dims import ParallelDims
from train import main

ONE = ParallelDims(1, 1, 1, 1)


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    """The decisions are read as on the CPU test machine, where Triton's interpreter stands in for a
    GPU (only the precision room reads it here: no kernel runs), on a GPU machine too."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _precision(*args: str, dims: ParallelDims = ONE, device: str = "cpu", distributed: bool = False,
               accum: int = 1) -> Precision:
    cfg = parse_args(["--config", "train_configs/debug_model.toml", *args])
    return Precision(cfg, dims, torch.device(device), distributed, accum)


BF16 = ["--training.mixed_precision_param", "bfloat16"]
MEGA_FP8 = ["--moe.backend", "mega", "--precision.moe", "fp8_blockwise"]


@pytest.mark.parametrize("args,dims,distributed,accum,copies,carry", [
    ([], ONE, False, 1, None, False),  # float32: nothing to cast, no copies
    (BF16, ONE, False, 1, "bf16", False),
    (BF16 + ["--optimizer.implementation", "triton"], ONE, False, 1, "bf16", True),
    (BF16 + ["--optimizer.implementation", "triton"], ONE, False, 2, "bf16", False),  # accumulation: float32 grads
    (BF16 + ["--precision.compute_copies", "false", "--optimizer.implementation", "triton"], ONE, False, 1, None,
     False),
    (BF16, ParallelDims(1, 4, 1, 4), True, 1, None, False),  # FSDP's all-gather casts the experts
    (BF16, ParallelDims(1, 4, 2, 4), True, 1, "bf16", False),  # EP's dispatch casts them: copies instead
    (BF16 + ["--optimizer.implementation", "triton"], ParallelDims(1, 4, 2, 4), True, 1, "bf16", False),
], ids=["float32", "bf16", "bf16-triton", "bf16-triton-accum2", "off", "fsdp", "ep", "ep-triton"])
def test_compute_copies_follow_the_layout(args, dims, distributed, accum, copies, carry):
    p = _precision(*args, dims=dims, distributed=distributed, accum=accum)
    assert (p.expert_copies, p.carry_grads) == (copies, carry)
    assert p.moe_args == BackendArgs() and p.fp8_engine is None


@pytest.mark.parametrize("dims,copies_flag,device,copies,warned", [
    (ONE, "true", "cuda", "fp8_blockwise", False),
    (ParallelDims(1, 8, 8, 8), "true", "cuda", "fp8_blockwise", False),  # whole experts per rank
    (ParallelDims(1, 32, 8, 32), "true", "cuda", "bf16", True),  # expert-FSDP shards: per-call FP8
    (ONE, "false", "cuda", None, True),
    (ONE, "false", "cpu", None, False),  # the CPU interpreter says nothing about speed
], ids=["one-process", "ep8-whole", "ep8-shards", "off", "cpu"])
def test_fp8_experts_warn_only_when_quantized_per_call(dims, copies_flag, device, copies, warned):
    p = _precision(*BF16, *MEGA_FP8, "--precision.compute_copies", copies_flag, dims=dims, device=device,
                   distributed=dims.world_size > 1)
    assert p.moe_backend == "mega_fp8" and p.expert_copies == copies
    assert any("made on every call" in w for w in p.warnings) == warned


def test_fp8_gemm_engine_key():
    """``[precision] fp8_gemm_engine``: "gluon" where it cannot run stops at start saying why; the
    chosen options reach the experts as their backend arguments (no other backend takes them), and
    the log line names the engine."""
    from models.moe.moe import GroupedExperts

    with pytest.raises(ConfigError, match="fp8_gemm_engine = \"gluon\" cannot run: the Triton interpreter"):
        _precision(*BF16, *MEGA_FP8, "--precision.fp8_gemm_engine", "gluon")
    p = _precision(*BF16, *MEGA_FP8)
    assert p.moe_args.fp8_options.engine == "auto" and p.fp8_engine == "triton"
    assert "FP8 GEMMs on triton (the Triton interpreter runs (TRITON_INTERPRET=1)" in p.describe()
    experts = GroupedExperts(128, 128, 2, p.moe_backend, p.moe_args)
    assert experts.args is p.moe_args and experts.backend.name == "mega_fp8"
    with pytest.raises(ValueError, match="MoE backend 'mega' does not take BackendArgs.fp8_options"):
        GroupedExperts(128, 128, 2, "mega", p.moe_args)


@pytest.mark.parametrize("quantize", ["none", "fp8_blockwise"])
def test_mega_on_cpu_is_refused_outside_the_interpreter(monkeypatch, capsys, quantize):
    """A CPU training run of the mega kernels stops at once with the backends that run there; under
    the interpreter the tests switch on (TRITON_INTERPRET=1) it runs, with a warning."""
    args = ["--config", "train_configs/debug_model.toml", "--moe.backend", "mega", "--precision.moe", quantize,
            "--training.device", "cpu"]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: [moe] backend = 'mega'"), err
    assert "on CPU use [moe] backend = \"grouped_mm\"" in err and "for the tests only" in err
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    p = _precision("--moe.backend", "mega", "--precision.moe", quantize, *BF16)
    assert any("Triton's CPU interpreter (TRITON_INTERPRET=1), which is meant for the tests" in w
               for w in p.warnings)


def test_moved_and_retired_keys_say_where_they_went():
    with pytest.raises(ConfigError, match=r"section \[quantize\] was renamed \[precision\]: write its keys under "
                                          r"\[precision\] \(--precision.<key> on the command line\)"):
        parse_args(["--quantize.moe", "fp8_blockwise"])
    for key in ("moe.cache_expert_weights", "optimizer.shadow_weights"):
        with pytest.raises(ConfigError, match=r"is no longer a setting: the compute copies are switched by "
                                              r"\[precision\] compute_copies"):
            parse_args([f"--{key}", "false"])
    with pytest.raises(ConfigError, match=r"\[experimental\] simulate_expert_parallel_degree is no longer a setting: "
                                          r"the one-process expert-parallel proxy was retired"):
        parse_args(["--experimental.simulate_expert_parallel_degree", "8"])
    assert JobConfig().precision.compute_copies is True
