"""Train a Qwen3-MoE model from a TOML config.

    python train.py --config train_configs/debug_model.toml [--section.key value ...]
    python train.py --help

The loop reads like the algorithm: build, parallelize, then per step: batch, forward, loss,
backward, clip, optimizer step, log, checkpoint. SIGTERM or SIGINT stops it after the step, with a
checkpoint (components/signals.py).
"""

from __future__ import annotations

import functools
import math
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from components.checkpoint import CheckpointError, CheckpointManager, check_output_folders, model_identity
from components.config import ConfigError, JobConfig, parse_args
from components.dataloader import DataError, build_dataloader
from components.loss import build_loss_fn
from components.garbage_collection import GarbageCollection
from components.metrics import METRICS_FILE, MetricsLogger, flops_per_token, format_drops
from components.optimizer import build_lr_scheduler, build_optimizer, folds_grad_scale, lr_factor
from components.precision import Precision
from components.profiling import StepProfiler
from components.signals import GracefulStop, Interrupted, interruptible
from components.tokenizer import TokenizerError, build_tokenizer
from models.moe.router import update_expert_bias
from models.qwen3.args import get_model_args
from models.qwen3.model import Qwen3MoE, count_params
from parallelisms import parallelize_model
from parallelisms.parallel_dims import build_parallel_dims
from parallelisms.expert_parallel import finish_expert_grads
from parallelisms.simulate import loopback_copy_seconds, simulation_line
from parallelisms.utils import clip_grad_norm_, clip_scale, init_distributed, report_error


class NonFiniteLossError(RuntimeError):
    pass


class ExpertCapacityError(RuntimeError):
    pass


def warn(message: str) -> None:
    """A warning line on stderr, from rank 0 only (before the process group exists, by RANK)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"warning: {message}", file=sys.stderr, flush=True)


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("[training] device = \"cuda\" but no CUDA device is available; use \"auto\" or \"cpu\"")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        t, m = cfg.training, cfg.model
        self.model_args = get_model_args(m.flavor, n_layers=m.n_layers, rope_theta=m.rope_theta)
        self.device = resolve_device(t.device)
        world_size = init_distributed(self.device.type, cfg.parallelism.simulate_world_size)
        self.distributed = torch.distributed.is_initialized()
        self.parallel_dims = build_parallel_dims(cfg.parallelism, world_size, self.model_args.num_experts,
                                                 self.device.type)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rank = torch.distributed.get_rank() if self.distributed else 0
        self.log = functools.partial(print, flush=True) if self.rank == 0 else (lambda *a, **k: None)
        if t.seq_len > self.model_args.max_seq_len:
            raise ConfigError(f"[training] seq_len = {t.seq_len} exceeds the model's max_seq_len "
                              f"{self.model_args.max_seq_len}")
        dp = self.parallel_dims.dp_size
        global_bs = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * dp
        if global_bs % (t.local_batch_size * dp):
            raise ConfigError(f"[training] global_batch_size = {global_bs} must be a multiple of local_batch_size "
                              f"({t.local_batch_size}) x data-parallel degree ({dp})")
        self.grad_accum_steps = global_bs // (t.local_batch_size * dp)
        # Everything that can be wrong with the config or the inputs is checked before the model
        # exists; what every module computes with is decided here, once.
        self.precision = Precision(cfg, self.parallel_dims, self.device, self.distributed, self.grad_accum_steps)
        for note in self.precision.warnings:
            warn(note)
        # An unwritable output folder or a disk too small for a checkpoint: now, not at the first save.
        check_output_folders(cfg, count_params(self.model_args)[0])
        # The header comes before the long parts (tokenizing, building the model), which say how long they took.
        self.log(self.describe())
        if cfg.parallelism.simulate_world_size > 1:
            self.log(simulation_line(world_size))

        self.tokenizer = build_tokenizer(m.tokenizer_path)
        if self.tokenizer.vocab_size > self.model_args.vocab_size:
            raise ConfigError(f"[model] tokenizer_path: the tokenizer has {self.tokenizer.vocab_size} tokens, more "
                              f"than the {m.flavor} model's vocab_size {self.model_args.vocab_size}")
        dp_rank = self.parallel_dims.dp_mesh.get_local_rank() if self.distributed else 0
        self.dataloader = build_dataloader(t.dataset_path, self.tokenizer, t.seq_len, t.local_batch_size,
                                           dp_rank=dp_rank, dp_world_size=dp, seed=t.seed,
                                           text_field=t.dataset_text_field, hf_config=t.dataset_config_name,
                                           hf_split=t.dataset_split, log=self.log if self.rank == 0 else None,
                                           shuffle=t.shuffle)

        built = time.perf_counter()
        seed_everything(t.seed, t.deterministic)

        def meta_model(log) -> Qwen3MoE:
            with torch.device("meta"):
                model = Qwen3MoE(self.model_args, moe_backend=self.precision.moe_backend,
                                 use_expert_bias=cfg.moe.load_balance == "expert_bias",
                                 attention_backend=m.attention_backend, moe_args=self.precision.moe_args)
            self.precision.convert(model, log=log)
            return model

        model = meta_model(self.log)
        parallelize_model(model, self.parallel_dims, cfg, self.distributed)
        model.to_empty(device=self.device)
        model.init_weights()
        if self.distributed and self.device.type == "cpu":
            # DTensor's random ops give each shard its own part of one random stream only on CUDA (its
            # RNG tracker); on CPU every rank would draw the same values for its shard (routers with
            # tied expert rows). The shards are cut from the one-process initialization instead.
            full = meta_model(lambda *_: None)
            full.to_empty(device="cpu")
            torch.manual_seed(t.seed)
            full.init_weights()
            set_model_state_dict(model, full.state_dict(), options=StateDictOptions(full_state_dict=True))
            del full
        self.model = model
        self.loss_fn = build_loss_fn(cfg.compile.enable and cfg.compile.loss, cfg.compile.backend)
        self.optimizer = build_optimizer(model, cfg.optimizer, self.device.type)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, t.steps, cfg.lr_scheduler)
        self.precision.apply(model, self.optimizer)
        self.log(f"built the model in {time.perf_counter() - built:.1f}s; {self.precision.describe()}")
        self.checkpoint = CheckpointManager(cfg.checkpoint, cfg.job.dump_folder, model, self.optimizer,
                                            self.lr_scheduler, self.dataloader,
                                            model_identity(self.model_args, m.flavor), run_steps=t.steps,
                                            on_load=self.precision.invalidate)
        self.saved: list[Path] = []  # checkpoints this run wrote
        self._save_started: dict[Path, float] = {}
        self.checkpoint_s = 0.0  # time the loop spent blocked on checkpoint saves
        self._epoch_noted_at: int | None = None  # the step of the last "data repeats" notice
        self.dropped_slots = (0, 0)  # the last step's EP-dropped and routed slots, over all ranks
        self._warned_drops = False
        self.metrics = MetricsLogger(
            cfg.metrics, self.device, flops_per_token(self.model_args, t.seq_len),
            tokens_per_step=t.local_batch_size * t.seq_len * self.grad_accum_steps,
            simulated_world=cfg.parallelism.simulate_world_size,
            # TensorBoard on rank 0 only: the scalars are already reduced over the ranks.
            log_dir=os.path.join(cfg.job.dump_folder, cfg.metrics.save_tb_folder) if self.rank == 0 else None,
            expert_parallel=self.parallel_dims.ep_enabled,
            metrics_path=os.path.join(cfg.job.dump_folder, METRICS_FILE) if self.rank == 0 else None)
        self.amp = self.precision.autocast()

    def describe(self) -> str:
        """The run header: what is trained where; printed before the data is tokenized."""
        total, active = count_params(self.model_args)
        a, d = self.model_args, self.parallel_dims
        return (f"{self.cfg.job.description}: Qwen3-MoE {self.cfg.model.flavor} ({a.n_layers} layers, dim {a.dim}, "
                f"{a.num_experts} experts top-{a.top_k}, {total / 1e6:,.1f}M params, {active / 1e6:,.1f}M active) "
                f"on {self.device}, MoE backend {self.cfg.moe.backend!r}, "
                f"{self.cfg.training.mixed_precision_param}, grad accumulation {self.grad_accum_steps}, "
                f"world {d.world_size} = dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} (EP {d.ep} within)")

    def train_step(self, data_iter) -> tuple[float, float, float]:
        """One optimizer step over ``grad_accum_steps`` micro-batches: (loss, aux_loss, grad_norm),
        the losses averaged over micro-batches and data-parallel ranks."""
        cfg = self.cfg
        # Compute copies that carry the gradients hold the experts' and the linears' in bf16.
        params = [p for p in self.model.parameters() if p.requires_grad] + self.precision.grad_carriers()
        self.precision.refresh()
        # ce, aux, EP-dropped slots, routed slots: summed on device, read once at the end of the step
        # (float64: the slot counts of a large job pass float32's exact integers).
        totals = torch.zeros(4, dtype=torch.float64, device=self.device)
        tokens_per_expert_LE = None
        for _ in range(self.grad_accum_steps):
            inputs_BL, labels_BL = next(data_iter)
            inputs_BL, labels_BL = inputs_BL.to(self.device), labels_BL.to(self.device)
            with self.amp:
                if cfg.training.loss_chunk_size > 0:
                    ce, router_stats_L3E = self.model(inputs_BL, labels_BL, cfg.training.loss_chunk_size)
                else:
                    logits_BLV, router_stats_L3E = self.model(inputs_BL)
                    ce = self.loss_fn(logits_BLV, labels_BL)
                aux = self.model.aux_loss(router_stats_L3E, inputs_BL.numel())
            loss = ce
            if cfg.moe.load_balance == "aux_loss" and cfg.moe.aux_loss_coef > 0:
                loss = ce + cfg.moe.aux_loss_coef * aux
            (loss / self.grad_accum_steps).backward()
            counts = router_stats_L3E[:, 0].detach()
            totals += torch.stack([ce.detach().double(), aux.detach().double(),
                                   router_stats_L3E[:, 2].sum(dtype=torch.float64), counts.sum(dtype=torch.float64)])
            tokens_per_expert_LE = counts if tokens_per_expert_LE is None else tokens_per_expert_LE + counts
        self.tokens_per_expert_LE = tokens_per_expert_LE  # this rank's, for [metrics] log_expert_load

        if self.parallel_dims.ep_enabled:
            finish_expert_grads(self.model, self.parallel_dims.mesh, self.parallel_dims.dp_size)
        max_norm = cfg.training.max_norm if cfg.training.max_norm > 0 else math.inf
        # Fused AdamW (and TritonAdamW) clip inside their kernels (grad_scale divides each gradient
        # as it is read): no separate pass multiplying every gradient in place (2 x 4 bytes per
        # parameter). torch's fused kernel then writes the divided gradient back (4 bytes); Triton's does not.
        fold = folds_grad_scale(self.optimizer) and max_norm != math.inf
        total_norm = clip_grad_norm_(params, max_norm, foreach=self.device.type == "cuda", apply=not fold)
        if fold:
            self.optimizer.grad_scale = clip_scale(total_norm, max_norm)
        grad_norm = total_norm.item()
        if self.distributed:
            group = self.parallel_dims.dp_mesh.get_group()
            torch.distributed.all_reduce(totals, group=group)
            totals[:2] /= self.parallel_dims.dp_size
        loss_value, aux_value = (totals[:2] / self.grad_accum_steps).tolist()
        dropped, routed = (int(v) for v in totals[2:].tolist())
        # Over all data-parallel ranks and micro-batches of the step; read by the metrics.
        self.dropped_slots = (dropped, routed)
        if dropped > 0 and cfg.parallelism.expert_capacity_overflow == "stop":
            raise ExpertCapacityError(self._overflow_message(dropped, routed))
        if not math.isfinite(loss_value) or not math.isfinite(grad_norm):
            raise NonFiniteLossError(
                f"step {self.step}: the loss is {loss_value} and the gradient norm {grad_norm}: training "
                "diverged, so it stops before the optimizer applies the update (no checkpoint is written). "
                "Lower [optimizer] lr, raise [lr_scheduler] warmup_steps, or resume from the last checkpoint.")
        if dropped > 0 and not self._warned_drops:
            self._warned_drops = True
            warn(self._overflow_message(dropped, routed))
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if cfg.moe.load_balance == "expert_bias":
            # A copy: self.tokens_per_expert_LE stays this rank's, which expert_load_line sums itself.
            global_LE = tokens_per_expert_LE.clone()
            if self.distributed:
                torch.distributed.all_reduce(global_LE, group=self.parallel_dims.dp_mesh.get_group())
            for bias_E, counts_E in zip(self.model.expert_biases(), global_LE):
                update_expert_bias(bias_E, counts_E, cfg.moe.bias_update_rate)
        return loss_value, aux_value, grad_norm

    def _overflow_message(self, dropped: int, routed: int) -> str:
        """What it means that ``dropped`` of the step's ``routed`` (token, expert) slots did not fit
        expert parallelism's capacity, under ``[parallelism] expert_capacity_overflow``: the stop's
        error, or the warning of the first step that drops."""
        p = self.cfg.parallelism
        what = (f"step {self.step}: {format_drops(dropped, routed)} did not fit the expert-parallel receive "
                f"buffers ([parallelism] expert_capacity_factor = {p.expert_capacity_factor})")
        never = f"a factor >= the EP degree, {self.parallel_dims.ep}, never overflows"
        if p.expert_capacity_overflow == "stop":
            return (f"{what}; the step is not applied ([parallelism] expert_capacity_overflow = \"stop\"). Raise "
                    f"the factor ({never}) and resume, or set expert_capacity_overflow = \"drop\" to train on "
                    f"without the slots that do not fit.")
        return (f"{what}. They are dropped and the step is applied, as with a GShard / Megatron capacity factor: "
                f"those tokens get nothing from those experts (their other experts and the residual still carry "
                f"them). The metrics line of a step that drops shows how many, the summary the run's total; this "
                f"warning is not repeated. To drop fewer, raise the factor ({never}; the empty rows of larger "
                f"buffers travel in every all-to-all too); to stop instead, set [parallelism] "
                f"expert_capacity_overflow = \"stop\".")

    def expert_load_line(self) -> str:
        """Per-layer expert load of the last step over all data-parallel ranks (collective)."""
        counts_LE = self.tokens_per_expert_LE.detach().clone()
        if self.distributed:
            torch.distributed.all_reduce(counts_LE, group=self.parallel_dims.dp_mesh.get_group())
        return self.metrics.log_expert_load(self.step, counts_LE)

    def train(self) -> int:
        """Train to ``[training] steps``. Returns 0, or the signal (SIGTERM, SIGINT) the run stopped
        for: every rank finishes the same step, a checkpoint of it is saved, and the loop ends."""
        t = self.cfg.training
        log = self.log
        self.step = self.checkpoint.maybe_load()
        if self.step:
            log(f"resumed from the checkpoint of step {self.step}")
        elif self.cfg.checkpoint.initial_load_path:
            log(f"initial weights from {self.cfg.checkpoint.initial_load_path} "
                f"({self.cfg.checkpoint.initial_load_format})")
        self.note_schedule()
        profiler = StepProfiler(self.cfg.profiling, self.cfg.job.dump_folder, self.rank, self.device, log=log)
        data_iter = iter(self.dataloader)
        epoch = self.dataloader.epoch
        stopped_by = 0
        self.metrics.start(self.step + 1)
        self.train_started = time.perf_counter()
        try:
            with GracefulStop(log) as stop, GarbageCollection(t.gc_freq) as collector:
                while self.step < t.steps:
                    self.step += 1
                    profiler.step_start(self.step)
                    collector.step(self.step)
                    lr = self.optimizer.param_groups[0]["lr"]
                    loss, aux, grad_norm = self.train_step(data_iter)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    self.metrics.step_done(self.step, loss, *self.dropped_slots, loopback_s=loopback_copy_seconds())
                    profiler.step_end(self.step)
                    signum = stop.agreed(self.device)  # every rank stops after the same step
                    self.log_step(loss, aux, grad_norm, lr, last=self.step == t.steps or bool(signum))
                    epoch = self.note_epoch(epoch)
                    self.poll_checkpoint()
                    if self.checkpoint.should_save(self.step, t.steps) or (signum and self.cfg.checkpoint.enable):
                        self.save_checkpoint(wait=bool(signum))
                    if signum and self.step < t.steps:
                        stopped_by = signum
                        break
                self.finish_checkpoint()  # the last async save, before the process exits
        finally:
            profiler.close()
        self.train_s = time.perf_counter() - self.train_started
        log(self.metrics.summary(self.outputs(profiler)))
        self.metrics.close()
        return stopped_by

    def log_step(self, loss: float, aux: float, grad_norm: float, lr: float, last: bool) -> None:
        """The metrics line of the first step, every ``log_freq``-th and the ``last`` (collective with
        ``log_expert_load``)."""
        if self.step == 1 or self.step % self.cfg.metrics.log_freq == 0 or last:
            self.log(self.metrics.log(self.step, loss, aux, grad_norm, lr))
            if self.cfg.metrics.log_expert_load:
                self.log(self.expert_load_line())

    def save_checkpoint(self, wait: bool) -> None:
        """Save this step's checkpoint, saying where as it starts and how long it took once written.
        An async save only starts (training goes on while it writes) unless ``wait``."""
        start = time.perf_counter()
        self.finish_checkpoint()  # saves become visible in step order
        path = self.checkpoint.folder / f"step-{self.step}"
        self.log(f"saving checkpoint to {path} ...")
        self._save_started[path] = start
        self.checkpoint.save(self.step)
        self.saved.append(path)
        if wait or self.cfg.checkpoint.async_mode != "async":
            self.finish_checkpoint()
            if path in self._save_started:  # a sync save: finish_checkpoint had nothing pending
                self._checkpoint_written(path)
        else:
            self.log(f"checkpoint {path}: state staged in {time.perf_counter() - start:.1f}s, "
                     "writing in the background")
        self.checkpoint_s += time.perf_counter() - start
        self.metrics.exclude_pause()

    def poll_checkpoint(self) -> None:
        start = time.perf_counter()
        if (done := self.checkpoint.poll()) is not None:
            self._checkpoint_written(done)
            self.checkpoint_s += time.perf_counter() - start

    def finish_checkpoint(self) -> None:
        """Wait for the async save in flight, if any (collective)."""
        if (done := self.checkpoint.wait()) is not None:
            self._checkpoint_written(done)

    def _checkpoint_written(self, path: Path) -> None:
        took = time.perf_counter() - self._save_started.pop(path)
        self.log(f"checkpoint {path} saved in {took:.1f}s")

    def note_schedule(self) -> None:
        """One-line notices about the learning-rate schedule this run follows."""
        t, sched = self.cfg.training, self.cfg.lr_scheduler
        if sched.warmup_steps > t.steps:
            self.log(f"note: [lr_scheduler] warmup_steps = {sched.warmup_steps} is more than [training] steps = "
                     f"{t.steps}: the warmup is cut to {t.steps} steps, so the lr rises over the whole run and "
                     "never reaches its peak")
        saved = self.checkpoint.resumed_run_steps
        if self.step and saved is not None and saved != t.steps:
            now = self.optimizer.param_groups[0]["lr"]
            new = self.lr_scheduler.base_lrs[0] * lr_factor(self.step + 1, t.steps, sched)
            self.log(f"note: the checkpoint of step {self.step} was saved by a run of {saved} steps and this run "
                     f"has [training] steps = {t.steps}: the lr schedule moves to the {t.steps}-step curve (from "
                     f"{now:.2e} on the old one to {new:.2e} after the next step)")

    def note_epoch(self, epoch: int) -> int:
        """Say when this rank's data runs out and repeats (at most once per ``log_freq`` steps, for
        tiny datasets); returns the data's current epoch."""
        if self.dataloader.epoch != epoch:
            epoch = self.dataloader.epoch
            if self._epoch_noted_at is None or self.step - self._epoch_noted_at >= self.cfg.metrics.log_freq:
                self._epoch_noted_at = self.step
                self.log(f"note: the dataset was used up by step {self.step}: the data repeats from here (epoch "
                         f"{epoch + 1})")
        return epoch

    def outputs(self, profiler: StepProfiler) -> list[str]:
        """What this run wrote, for the closing summary."""
        out = []
        kept = [p for p in self.saved if p.is_dir()]  # keep_latest_k may have removed older ones
        if len(kept) > 3:
            out.append(f"{len(kept)} checkpoints in {kept[0].parent} (newest {kept[-1].name})")
        elif kept:
            out.append(f"checkpoint{'s' if len(kept) > 1 else ''} {', '.join(str(p) for p in kept)}")
        elif not self.cfg.checkpoint.enable:
            out.append("no checkpoint ([checkpoint] enable = false)")
        if self.metrics.writer is not None:
            out.append(f"TensorBoard {self.metrics.log_dir}")
        if self.metrics.metrics_path is not None:
            out.append(f"metrics {self.metrics.metrics_path} (loss curve: python -m bench.loss_curves "
                       f"{self.cfg.job.dump_folder})")
        out += [f"profile {p.parent}" for p in profiler.written]
        return out

    def end_line(self, started: float, stopped_by: int) -> str:
        """The closing line: how the run ended and where its time went since ``started`` (process start)."""
        total = time.perf_counter() - started
        timings = (f"{total:.1f}s (startup {self.train_started - started:.1f}s, training {self.train_s:.1f}s, of "
                   f"which checkpoint saves {self.checkpoint_s:.1f}s)")
        if not stopped_by:
            return f"done in {timings}"
        if self.cfg.checkpoint.enable:
            where = f"checkpoint {self.saved[-1]} saved; run the same command to resume"
        else:
            where = ("no checkpoint was written ([checkpoint] enable = false; --checkpoint.enable true saves one "
                     "on a signal, to resume from)")
        return (f"stopped by {signal.Signals(stopped_by).name} after step {self.step} in {timings}: {where} "
                f"(exit code {128 + stopped_by})")


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    try:
        # Until the train loop takes them over, SIGTERM and SIGINT end the run with a line, not a traceback.
        with interruptible():
            cfg = parse_args(argv)
            if cfg is None:
                return 0
            trainer = Trainer(cfg)
            stopped_by = trainer.train()
            trainer.log(trainer.end_line(started, stopped_by))
            return 128 + stopped_by if stopped_by else 0
    except (ConfigError, FileNotFoundError, CheckpointError, NotImplementedError, DataError, TokenizerError) as e:
        report_error(str(e))  # once per job under torchrun, not once per rank
        return 2
    except (NonFiniteLossError, ExpertCapacityError) as e:
        report_error(str(e))
        return 1
    except Interrupted as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"stopped by {signal.Signals(e.signum).name} outside the training loop: nothing to save "
                  f"(exit code {128 + e.signum})", file=sys.stderr)
        return 128 + e.signum
    finally:
        # Destroy the process groups while the interpreter is whole: left to finalization, gloo
        # groups can abort the process at exit (see tests/multiprocess.py).
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
