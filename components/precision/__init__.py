"""The precision room: what every module computes with, decided once from the config and the
parallel layout.

    precision = Precision(cfg, dims, device, grad_accum_steps)   # before the model exists; checks
    model = Qwen3MoE(args, moe_backend=precision.moe_backend, moe_args=precision.moe_args, ...)
    precision.convert(model)                                       # the meta model: FP8 linears
    ... parallelize, materialize, build the optimizer ...
    precision.apply(model, optimizer)                              # the compute copies
    each step: precision.refresh(); the clip norm over params + precision.grad_carriers()
    after a checkpoint load: precision.invalidate()

Decided here and nowhere else:

- the experts' backend for ``[moe] backend`` at ``[precision] moe`` and the arguments it takes
  (``kernels/moe/__init__.py``: ``BackendArgs``, the FP8 options and GEMM engine), whether that
  backend can run on this machine;
- the attention projections' precision (``[precision] linear``: ``float8.py``);
- the compute copies (``[precision] compute_copies``, ``copies.py``): which modules get them (the
  experts where the trainer casts them itself, the dense linears where the optimizer writes them),
  in bf16 or e4m3, whether the optimizer writes them and whether they carry the gradients.

The layout comes from :class:`~parallelisms.parallel_dims.ParallelDims`, never from the model's
attributes, and nothing here writes into a module after :meth:`Precision.apply`.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Callable

import torch
import torch.nn as nn

from components.config import ConfigError, JobConfig
from components.precision.copies import (EXPERT_WEIGHTS, ComputeLinear, attach_to_optimizer, expert_copy_mode,
                                         grad_carriers, invalidate_copies, make_compute_copies, refresh_copies)
from components.precision.float8 import convert_to_float8
from kernels.moe import BackendArgs, available_moe_backends, get_moe_backend, resolve_moe_backend
from models.moe.router import TokenChoiceTopKRouter
from parallelisms.parallel_dims import ParallelDims


class Precision:
    """The precision plan of one run (module docstring). Attributes, for the log and the tests:

    moe_backend, moe_args: the experts' registered backend and its arguments.
    compute_dtype: bf16 or float32 (``[training] mixed_precision_param``).
    expert_copies: the experts' compute copies, "bf16", "fp8_blockwise" or None.
    carry_grads: the copies carry the bf16 gradients and the optimizer writes them (the Triton
        AdamW, one process, one micro-batch per step); the dense linears get copies too.
    fp8_engine: the engine the FP8 experts' GEMMs run on ("gluon" / "triton"), or None.
    """

    def __init__(self, cfg: JobConfig, dims: ParallelDims, device: torch.device, distributed: bool,
                 grad_accum_steps: int):
        """``distributed``: the model is spread over a process group (FSDP2 casts what it gathers);
        else one process computes under bf16 autocast."""
        p, t = cfg.precision, cfg.training
        on_gpu = device.type == "cuda"
        try:
            self.moe_backend = resolve_moe_backend(cfg.moe.backend, p.moe)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.moe_backend not in available_moe_backends():
            raise ConfigError(f"[precision] moe = {p.moe!r} with [moe] backend = {cfg.moe.backend!r} (backend "
                              f"{self.moe_backend!r}) is not implemented yet; set [precision] moe = \"none\" (bf16)")
        self.warnings = _check_backend_runs(self.moe_backend, cfg.moe.backend, p.moe, on_gpu)
        self.fp8_engine = None
        self.moe_args = BackendArgs()
        if self.moe_backend == "mega_fp8":
            from kernels.fp8.engine import gluon_unavailable, resolve_engine
            from kernels.moe.mega_fp8 import MegaFP8Options

            if p.fp8_gemm_engine == "gluon" and (reason := gluon_unavailable(device)):
                raise ConfigError(f"[precision] fp8_gemm_engine = \"gluon\" cannot run: {reason}; use \"auto\" "
                                  "(Gluon where it runs, else Triton) or \"triton\"")
            self.moe_args = BackendArgs(fp8_options=MegaFP8Options(engine=p.fp8_gemm_engine))
            self.fp8_engine = resolve_engine(p.fp8_gemm_engine, device)
            self._engine_note = (f" ({gluon_unavailable(device)})"
                                 if self.fp8_engine == "triton" and p.fp8_gemm_engine == "auto" else "")
        self.linear = p.linear
        self.compute_dtype = torch.bfloat16 if t.mixed_precision_param == "bfloat16" else torch.float32
        bf16 = self.compute_dtype == torch.bfloat16
        self._distributed, self._device_type = distributed, device.type

        # The experts' copies stand where the trainer would cast them itself: one process under
        # autocast, or expert parallelism's dispatch; FSDP's all-gather casts the other experts.
        self._copy_dtype = None
        experts_whole = True
        if p.compute_copies and bf16 and (not distributed or dims.ep_enabled):
            self._copy_dtype = torch.bfloat16
            experts_whole = dims.dp_shard_mod_ep == 1
        self.expert_copies = expert_copy_mode(self.moe_backend, self._copy_dtype, experts_whole)
        self.carry_grads = (p.compute_copies and cfg.optimizer.implementation == "triton" and not distributed
                            and bf16 and grad_accum_steps == 1)
        if self.moe_backend == "mega_fp8" and self.expert_copies != "fp8_blockwise" and on_gpu:
            self.warnings.append(
                "[precision] moe = \"fp8_blockwise\": the experts' e4m3 copies are made on every call here (they are "
                "made once per step only where each rank holds whole experts under bf16: one process, or expert "
                "parallelism without expert-FSDP sharding, with [precision] compute_copies), and per-call "
                "quantization was measured slower than bf16 experts (BENCHMARKS.md); [precision] moe = \"none\" "
                "runs them in bf16")
        self._model: nn.Module | None = None
        self._has_copies = False
        self.copied_linears: list[nn.Module] = []
        self.copies_in_optimizer = 0

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context of the forward: bf16 autocast in one process; a distributed model is cast by
        FSDP's mixed-precision policy instead (and float32 runs cast nothing)."""
        if self.compute_dtype == torch.bfloat16 and not self._distributed:
            return torch.autocast(self._device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def convert(self, model: nn.Module, log: Callable[[str], None] = print) -> None:
        """On the meta-device model, before the parallelisms: the FP8 attention projections."""
        convert_to_float8(model, self.linear, log=log)

    def apply(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """On the materialized, parallelized model and its optimizer: make the compute copies, hand
        the optimizer those it writes and the gradients they carry. The last step that changes a
        module before the first forward."""
        self._model = model
        made = make_compute_copies(model, self.expert_copies, self._copy_dtype, self.moe_args.fp8_options,
                                   linears=self.carry_grads, skip=(TokenChoiceTopKRouter,))
        self.copied_linears = [m for m in model.modules() if isinstance(m, ComputeLinear)]
        if made:
            # For eager forwards outside the step (which refreshes the copies itself); registered
            # before the optimizer's own hook, which marks the copies it wrote current.
            optimizer.register_step_post_hook(lambda *_: invalidate_copies(model))
            taken = attach_to_optimizer(model, optimizer, carry_grads=self.carry_grads)
            self.copies_in_optimizer = sum(c.params == EXPERT_WEIGHTS for c in taken)
        self._has_copies = bool(made)

    def refresh(self) -> None:
        """At the start of every optimizer step, outside the compiled graph: remake every copy that
        is not current (an optimizer step or a checkpoint load changed the weights since; their
        versions cannot tell, ``copies.py``)."""
        if self._has_copies:
            refresh_copies(self._model)

    def invalidate(self) -> None:
        """After the weights changed outside the optimizer (a checkpoint load)."""
        if self._model is not None:
            invalidate_copies(self._model)

    def grad_carriers(self) -> list[torch.Tensor]:
        """The copies whose ``.grad`` hold gradients in the parameters' stead (the clip norm counts them)."""
        return grad_carriers(self._model) if self._model is not None else []

    def describe(self) -> str:
        """One log line: what the experts and the linears compute with."""
        parts = [f"{self.compute_dtype}".replace("torch.", ""), f"experts {self.moe_backend!r}"]
        if self.fp8_engine is not None:
            parts.append(f"FP8 GEMMs on {self.fp8_engine}{self._engine_note}")
        parts.append(f"expert compute copies {self.expert_copies or 'off'}")
        if self.carry_grads:
            parts.append(f"written by the optimizer, carrying the gradients (and {len(self.copied_linears)} linears')")
        if self.linear != "none":
            parts.append(f"attention projections {self.linear}")
        return "precision: " + ", ".join(parts)


def _check_backend_runs(name: str, backend: str, quantize: str, on_gpu: bool) -> list[str]:
    """The registered MoE backend ``name`` (``[moe] backend`` at ``[precision] moe``) has its package
    and a device it runs on; returns the warnings for a run that will be slow."""
    chosen = f"[moe] backend = {backend!r}" + (f" with [precision] moe = {quantize!r}" if quantize != "none" else "")
    on_cpu_use = "on CPU use [moe] backend = \"grouped_mm\" (or \"torch\")" + (
        " with [precision] moe = \"none\"" if quantize != "none" else "")
    if name == "torchtitan":
        try:
            get_moe_backend(name)
        except ImportError:
            raise ConfigError(f"{chosen} runs upstream TorchTitan's expert code, which is not installed: "
                              f"pip install \".[baseline]\" (torchtitan==0.2.2, torchao==0.16.0)"
                              + ("" if on_gpu else f"; it also needs a CUDA device: {on_cpu_use}")) from None
        if not on_gpu:
            raise ConfigError(f"{chosen} needs a CUDA device (upstream's MoE does not run on CPU); {on_cpu_use}")
    if name in ("mega", "mega_fp8"):
        if importlib.util.find_spec("triton") is None:
            raise ConfigError(f"{chosen} runs Triton kernels, and triton is not installed: pip install \".[kernels]\"")
        if not on_gpu:
            from kernels.common.triton_utils import interpreting

            if not interpreting():
                raise ConfigError(f"{chosen} runs Triton kernels on a CUDA GPU, and this run is on CPU; {on_cpu_use}. "
                                  f"(Triton's CPU interpreter runs these kernels for the tests only: a step of the "
                                  f"debug model takes many minutes in it)")
            return [f"{chosen} runs in Triton's CPU interpreter (TRITON_INTERPRET=1), which is meant for the tests: "
                    f"only tiny runs finish (a step of the debug model takes many minutes)"]
    return []
