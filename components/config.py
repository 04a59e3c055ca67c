"""Job configuration: a TOML file mapped section by section onto typed dataclasses.

    python train.py --config train_configs/debug_model.toml --training.steps 20 --compile.enable

Every field of every section can be overridden on the command line as ``--section.key value``
(``--section.key=value`` works too; a bool field given alone means true). Values are checked
against the field's type, choices and range before anything is built; any problem raises one
:class:`ConfigError` naming where the value was set (the file, or the command line and its flag),
the key and what is allowed.

Relative input paths (``[model] tokenizer_path``, ``[training] dataset_path``,
``[checkpoint] initial_load_path``) set in the TOML file are looked up in the working directory,
then beside the config file, then in the project folder, so the shipped configs' ``assets/...``
work from any directory; a path given on the command line is relative to the working directory
only. A dataset or tokenizer found nowhere stops the run with the paths tried.
``python train.py --help`` prints every section and field with its default.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration problem, reported to the user as one message (no traceback)."""


# The folder holding train.py and the shipped assets/, the last place a relative path is looked for.
PROJECT_DIR = Path(__file__).resolve().parent.parent
CLI = "command line"
# How a relative input path (a field made with input_path=True) is found; the config reference shows it.
PATH_RULE = ("relative: looked up in the working directory, then beside the config file, then in the project "
             "folder (which holds assets/); from the command line, in the working directory only")


def _field(default: Any, help: str, *, choices: tuple | None = None, ge: float | None = None,
           gt: float | None = None, le: float | None = None, input_path: bool = False) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le,
                                            "input_path": input_path})


def _help(f: dataclasses.Field) -> str:
    return f.metadata["help"] + (f"; {PATH_RULE}" if f.metadata.get("input_path") else "")


@dataclass
class Job:
    description: str = _field("Qwen3-MoE training", "free text, printed at start")
    dump_folder: str = _field("./outputs", "folder for checkpoints, TensorBoard logs and traces")


@dataclass
class Model:
    flavor: str = _field("debug", "size preset", choices=("debug", "qwen3_30b_a3b", "qwen3_235b_a22b"))
    n_layers: int = _field(0, "number of transformer blocks; 0 keeps the flavor's own", ge=0)
    rope_theta: float = _field(1e6, "RoPE base (Qwen3 base models: 1e6; the 235B -2507 release: 5e6)", gt=0)
    tokenizer_path: str = _field("assets/tokenizer/tokenizer.model", "sentencepiece .model file, Hugging Face "
                                 "tokenizer.json, or a folder holding one (e.g. a downloaded Qwen3 release)",
                                 input_path=True)
    attention_backend: str = _field("auto", "SDPA kernel preference: auto lets SDPA choose (cuDNN on the H200 with "
                                    "torch 2.11, faster than flash at seq len 16384: BENCHMARKS.md)",
                                    choices=("auto", "cudnn", "flash", "math"))


@dataclass
class MoE:
    backend: str = _field("grouped_mm", "routed-expert implementation: torch | grouped_mm | mega "
                          "(kernels.moe.available_moe_backends() lists the registered ones)")
    load_balance: str = _field("aux_loss", "aux_loss: Qwen3's router auxiliary loss; expert_bias: "
                               "aux-loss-free bias (DeepSeek-V3); none", choices=("aux_loss", "expert_bias", "none"))
    aux_loss_coef: float = _field(0.001, "weight of the router auxiliary loss in the total loss", ge=0)
    bias_update_rate: float = _field(0.001, "expert_bias step size per optimizer step", ge=0)


@dataclass
class Training:
    dataset_path: str = _field("assets/data/stories", "a .txt (a document per line), .jsonl or .parquet file, a "
                               "folder of them, a folder of pre-tokenized .bin shards (scripts/pretokenize.py), "
                               "or hf:<name> to stream a Hugging Face dataset", input_path=True)
    dataset_text_field: str = _field("text", "JSON-lines field / Parquet column / HF dataset field holding the text")
    dataset_config_name: str = _field("", "hf: datasets only: the dataset's config (subset) name; empty = none")
    dataset_split: str = _field("train", "hf: datasets only: the split to stream")
    seq_len: int = _field(2048, "tokens per sample", ge=1)
    local_batch_size: int = _field(8, "samples per device per micro-batch", ge=1)
    global_batch_size: int = _field(-1, "samples per optimizer step over all ranks; -1 = local_batch_size x "
                                    "data-parallel degree (no accumulation); a multiple of that enables "
                                    "gradient accumulation", ge=-1)
    steps: int = _field(10000, "optimizer steps to train", ge=1)
    max_norm: float = _field(1.0, "gradient-norm clip; 0 disables clipping", ge=0)
    loss_chunk_size: int = _field(0, "0: cross-entropy on the full logits; > 0: output projection + "
                                  "cross-entropy fused in chunks of this many tokens, so the (tokens x vocab) "
                                  "logits are never held whole", ge=0)
    seed: int = _field(0, "random seed for initialisation and data order", ge=0)
    shuffle: bool = _field(True, "visit the samples in an order shuffled from (seed, epoch) every epoch; false "
                           "reads them in stream order, as upstream TorchTitan's loader does (hf: datasets "
                           "always stream in order)")
    deterministic: bool = _field(False, "use deterministic algorithms (slower)")
    gc_freq: int = _field(50, "Python garbage collection: automatic collection is off while training and the "
                          "trainer collects every gc_freq steps (Python's own full passes stall the GPU mid-step, "
                          "often in the optimizer step); 0 leaves Python's automatic collection on", ge=0)
    mixed_precision_param: str = _field("bfloat16", "compute dtype of the forward/backward "
                                        "(parameters and optimizer state stay float32)", choices=("bfloat16", "float32"))
    device: str = _field("auto", "auto picks cuda when available, else cpu", choices=("auto", "cuda", "cpu"))


@dataclass
class Optimizer:
    lr: float = _field(8e-4, "peak learning rate", gt=0)
    beta1: float = _field(0.9, "Adam beta1", ge=0, le=1)
    beta2: float = _field(0.95, "Adam beta2", ge=0, le=1)
    eps: float = _field(1e-8, "Adam epsilon", gt=0)
    weight_decay: float = _field(0.1, "decoupled weight decay (not applied to norms, biases or embeddings)", ge=0)
    implementation: str = _field("auto", "auto: fused on GPU, foreach on CPU; triton: one Triton pass per parameter "
                                 "(kernels/adamw.py; plain or FSDP/EP-sharded parameters; it writes the compute "
                                 "copies, [precision] compute_copies)",
                                 choices=("auto", "fused", "foreach", "for-loop", "triton"))


@dataclass
class LRScheduler:
    warmup_steps: int = _field(200, "linear warmup steps", ge=0)
    decay_ratio: float = _field(1.0, "fraction of the steps (at the end) spent decaying; the rest after "
                                "warmup is constant (WSD); 1.0 decays over all steps after warmup", ge=0, le=1)
    decay_type: str = _field("cosine", "shape of the decay", choices=("linear", "cosine", "sqrt"))
    min_lr_factor: float = _field(0.1, "final lr as a fraction of the peak", ge=0, le=1)


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = _field(1, "DDP-style replicas (HSDP outer dim)", ge=1)
    data_parallel_shard_degree: int = _field(-1, "FSDP shards; -1 = all remaining ranks", ge=-1)
    expert_parallel_degree: int = _field(1, "ranks that split the experts of a layer", ge=1)
    fsdp_reshard_after_forward: str = _field("default", "FSDP2: free gathered parameters after forward (always), "
                                             "keep them for backward (never), or always except the last "
                                             "block's (default)", choices=("default", "always", "never"))
    fsdp_reduce_dtype: str = _field("float32", "dtype of FSDP gradient reduction", choices=("float32", "bfloat16"))
    expert_capacity_factor: float = _field(2.0, "EP: each rank sends every peer C = factor x T x K / ep rows per "
                                           "all-to-all (at most T x min(K, E / ep)), this many times the mean; "
                                           "the empty rows travel too, so the bytes grow with the factor. Slots "
                                           "beyond C go as expert_capacity_overflow says; a factor >= the EP "
                                           "degree never overflows (docs/expert_parallel.md)", gt=0)
    expert_capacity_overflow: str = _field("drop", "a step whose EP slots did not all fit the capacity: drop (the "
                                           "slots that did not fit add nothing to their token's output, as with "
                                           "a GShard / Megatron capacity factor; the step is applied, a warning "
                                           "says so once and the metrics line counts them) or stop (stop before "
                                           "the update: a dropless guarantee)", choices=("drop", "stop"))
    simulate_world_size: int = _field(0, "0 = off; N >= 2: one process (no torchrun) acts as rank 0 of an N-rank "
                                      "job: the real meshes, FSDP2 sharding, EP layout and compile of one rank, "
                                      "with collectives looped back (no communication), for per-rank memory and "
                                      "compute (each metrics line also gives the step without the loopback copies: "
                                      "compute only); data_parallel_shard_degree = -1 resolves against N. "
                                      "Checkpointing must be off (docs/expert_parallel.md)", ge=0)


@dataclass
class ActivationCheckpoint:
    mode: str = _field("none", "recompute activations in backward", choices=("none", "full", "selective"))
    selective_layer_interval: int = _field(2, "with mode = selective, checkpoint every n-th block", ge=1)
    keep: str = _field("none", "ops of a checkpointed block whose outputs are kept instead of recomputed: none "
                       "(the whole block is recomputed, TorchTitan's full AC); attention (the SDPA core); "
                       "attention_and_moe (also the routed experts). Holds what those ops save for backward "
                       "(SDPA's q, k, v, output and log-sum-exp; the experts' saved tensors) through the "
                       "backward to skip their forward in the recomputation", choices=("none", "attention", "attention_and_moe"))
    keep_layers: int = _field(0, "with keep, how many checkpointed blocks keep those ops: the first n, the others "
                              "recomputed whole; fewer holds less memory (per kept block, what keep names), "
                              "0 = every checkpointed block", ge=0)
    keep_moe_layers: int = _field(0, "with keep = attention_and_moe, how many of the keeping blocks also keep the "
                                  "routed experts: the first n, the others keep the attention core only (under "
                                  "expert parallelism the experts hold the exchange's buffers, far more per block "
                                  "than attention); 0 = every keeping block", ge=0)


@dataclass
class Compile:
    enable: bool = _field(False, "torch.compile each transformer block with fullgraph=True")
    backend: str = _field("inductor", "torch.compile backend", choices=("inductor", "aot_eager", "eager"))
    loss: bool = _field(True, "with enable, also compile the loss (cross-entropy over the logits), as TorchTitan "
                        "does: fused, it never makes the logits' float32 copies")


@dataclass
class Precision:
    """What the model computes in, beside ``[training] mixed_precision_param`` (components/precision)."""

    moe: str = _field("none", "expert GEMM precision: fp8_blockwise (DeepSeek-V3 style block scales; backend "
                      "mega) or fp8_rowwise (TorchTitan's rowwise scaled grouped GEMM; backend grouped_mm)",
                      choices=("none", "fp8_blockwise", "fp8_rowwise"))
    fp8_gemm_engine: str = _field("auto", "kernels of moe = fp8_blockwise's GEMMs that have two: gluon "
                                  "(warp-specialized, sm_90 GPUs only), triton, or auto (gluon where it runs)",
                                  choices=("auto", "gluon", "triton"))
    linear: str = _field("none", "dense linear precision: fp8_rowwise runs the attention projections' three GEMMs "
                         "in rowwise-scaled e4m3 (torch._scaled_mm); embedding, norms, router, output head stay "
                         "bf16", choices=("none", "fp8_rowwise"))
    compute_copies: bool = _field(True, "compute with copies of the float32 weights in their compute form (bf16, "
                                  "or the e4m3 copies of moe = fp8_blockwise) made once per optimizer step instead "
                                  "of a cast on every call, where the trainer would cast them itself (the experts in "
                                  "one process under bf16, or under expert parallelism; FSDP's all-gather casts the "
                                  "rest); costs one bf16-sized copy of those weights. With [optimizer] "
                                  "implementation = \"triton\", one process and one micro-batch per step, the "
                                  "optimizer writes the copies in its pass, the dense linears get them too, and "
                                  "they carry the bf16 gradients (docs/fp8.md, components/precision/copies.py)")


@dataclass
class Checkpoint:
    enable: bool = _field(False, "save checkpoints and resume from the newest one")
    folder: str = _field("checkpoint", "checkpoint folder, relative to job.dump_folder")
    interval: int = _field(500, "save every this many steps (and at the last step)", ge=1)
    keep_latest_k: int = _field(0, "keep only the newest k checkpoints; 0 keeps all", ge=0)
    load_step: int = _field(-1, "resume from this step; -1 = the newest complete checkpoint", ge=-1)
    async_mode: str = _field("disabled", "async: write checkpoints in a background thread after staging them in "
                             "CPU memory (the folder appears only once written)", choices=("disabled", "async"))
    initial_load_path: str = _field("", "weights to start from when there is no checkpoint to resume: a folder "
                                    "of HF safetensors or a DCP checkpoint folder; model weights only",
                                    input_path=True)
    initial_load_format: str = _field("hf", "format of initial_load_path", choices=("hf", "dcp"))


@dataclass
class Metrics:
    log_freq: int = _field(10, "print metrics every this many steps", ge=1)
    enable_tensorboard: bool = _field(False, "also write TensorBoard scalars (rank 0 writes them, reduced over "
                                      "the ranks)")
    save_tb_folder: str = _field("tb", "TensorBoard folder, relative to job.dump_folder")
    peak_tflops: float = _field(0.0, "device peak TFLOP/s for MFU; 0 = known GPUs' bf16 dense peak, "
                                "else MFU is not reported", ge=0)
    summary_start_step: int = _field(6, "first step of the closing tokens/s summary window, counted from the run's "
                                     "first step", ge=1)
    summary_end_step: int = _field(20, "last step of the summary window; a shorter run is measured from "
                                   "min(summary_start_step, its middle) to its end, one over 5 x longer from "
                                   "summary_start_step to its end", ge=1)
    log_expert_load: bool = _field(False, "also log per-layer tokens per expert (min/max/mean, max/mean "
                                   "imbalance) at each log step; --debug sets it")


@dataclass
class Profiling:
    enable_profiling: bool = _field(False, "write a torch profiler trace (chrome trace json) of a step window")
    save_traces_folder: str = _field("profile_traces", "trace folder, relative to job.dump_folder")
    profile_start_step: int = _field(5, "first step of the profiled window", ge=1)
    profile_steps: int = _field(2, "steps in the profiled window", ge=1)
    enable_memory_snapshot: bool = _field(False, "record CUDA allocations over the same window and dump a memory "
                                          "snapshot pickle (for pytorch.org/memory_viz); needs CUDA")
    save_memory_snapshot_folder: str = _field("memory_snapshot", "snapshot folder, relative to job.dump_folder")


@dataclass
class Experimental:
    """Features that work and are tested on CPU but have no GPU measurement yet; keys may change."""

    expert_parallel_chunks: int = _field(1, "split each MoE layer's tokens into this many chunks so the all-to-all "
                                         "of one chunk overlaps the expert GEMMs of another (e.g. 2-4 with EP > 1; "
                                         "each chunk has its own capacity; ignored without EP). Overlaps in eager; "
                                         "compiled with inductor, the trainer adds its own comm reordering pass (all "
                                         "dispatches issued first, each combine under the next chunk's experts: "
                                         "parallelisms/compile.py). Unmeasured on multi-GPU yet", ge=1)


# Keys that moved to another section: (old section, key) -> new section, for a clear error.
MOVED_KEYS = {("parallelism", "expert_parallel_chunks"): "experimental"}
# Sections whose keys all moved: old section -> new section.
MOVED_SECTIONS = {"quantize": "precision"}
# Keys that are gone: (section, key) -> what to do instead.
RETIRED_KEYS = {
    ("moe", "cache_expert_weights"): "the compute copies are switched by [precision] compute_copies",
    ("optimizer", "shadow_weights"): "the compute copies are switched by [precision] compute_copies",
    ("model", "name"): "the model family is always Qwen3-MoE; delete the key ([model] flavor picks the size)",
    ("optimizer", "name"): "the optimizer is always AdamW; delete the key ([optimizer] implementation picks the kernel)",
    ("parallelism", "tensor_parallel_degree"): "tensor parallelism is not implemented; delete the key",
    ("parallelism", "context_parallel_degree"): "context parallelism is not implemented; delete the key",
    ("parallelism", "pipeline_parallel_degree"): "pipeline parallelism is not implemented; delete the key",
    ("experimental", "simulate_expert_parallel_degree"): "the one-process expert-parallel proxy was retired; "
                                                          "[parallelism] simulate_world_size runs one rank of an "
                                                          "N-rank job (docs/expert_parallel.md)",
}


def _unknown_key(where: str, section: str, key: str, fields) -> ConfigError:
    if (section, key) in MOVED_KEYS:
        new = MOVED_KEYS[section, key]
        return ConfigError(f"{where}: [{section}] {key} moved to [{new}]: write it as [{new}] {key} "
                           f"(--{new}.{key} on the command line)")
    if (section, key) in RETIRED_KEYS:
        return ConfigError(f"{where}: [{section}] {key} is no longer a setting: {RETIRED_KEYS[section, key]}")
    return ConfigError(f"{where}: unknown key {key!r} in [{section}]; allowed keys: {', '.join(fields)}")


def _unknown_section(where: str, section: str) -> ConfigError:
    if section in MOVED_SECTIONS:
        new = MOVED_SECTIONS[section]
        return ConfigError(f"{where}: section [{section}] was renamed [{new}]: write its keys under [{new}] "
                           f"(--{new}.<key> on the command line)")
    return ConfigError(f"{where}: unknown section [{section}]; allowed sections: {', '.join(_sections())}")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    moe: MoE = field(default_factory=MoE)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    precision: Precision = field(default_factory=Precision)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    experimental: Experimental = field(default_factory=Experimental)


def _sections() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(JobConfig)}


def _section_fields(section_cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section_cls)}


def _field_type(section_cls: type, f: dataclasses.Field) -> type:
    return typing.get_type_hints(section_cls)[f.name]


def _show(where: str, section: str, key: str, value: Any = None) -> str:
    """A key (and its value) as the user wrote it: ``--section.key`` on the command line, else TOML."""
    if where == CLI:
        return f"--{section}.{key}" + ("" if value is None else f" {value!r}")
    return f"[{section}] {key}" + ("" if value is None else f" = {value!r}")


def _check_value(where: str, section: str, key: str, f: dataclasses.Field, ftype: type, value: Any) -> Any:
    """Type- and range-check one value; returns it converted (an int for a float field becomes float)."""
    if ftype is bool:
        ok = isinstance(value, bool)
    elif ftype is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif ftype is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, ftype)
    name = _show(where, section, key, value)
    if not ok:
        raise ConfigError(f"{where}: {name} has the wrong type: expected {ftype.__name__}")
    meta = f.metadata
    if meta.get("choices") is not None and value not in meta["choices"]:
        allowed = ", ".join(repr(c) for c in meta["choices"])
        raise ConfigError(f"{where}: {name} is not allowed; choose one of {allowed}")
    for bound, test, text in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                              ("le", lambda v, b: v <= b, "<=")):
        if meta.get(bound) is not None and not test(value, meta[bound]):
            raise ConfigError(f"{where}: {name} is out of range: must be {text} {meta[bound]}")
    return value


def _apply_section(cfg: JobConfig, where: str, section: str, values: dict[str, Any],
                   sources: dict[tuple[str, str], str]) -> None:
    sections = _sections()
    if section not in sections:
        raise _unknown_section(where, section)
    obj = getattr(cfg, section)
    fields = _section_fields(type(obj))
    for key, value in values.items():
        if key not in fields:
            raise _unknown_key(where, section, key, fields)
        f = fields[key]
        setattr(obj, key, _check_value(where, section, key, f, _field_type(type(obj), f), value))
        sources[section, key] = where


def _parse_cli_value(ftype: type, text: str, flag: str) -> Any:
    try:
        if ftype is bool:
            lowered = text.lower()
            if lowered in ("true", "1", "yes"):
                return True
            if lowered in ("false", "0", "no"):
                return False
            raise ValueError
        if ftype is int:
            return int(text)
        if ftype is float:
            return float(text)
        return text
    except ValueError:
        raise ConfigError(f"command line: {flag} {text!r} is not a valid {ftype.__name__}") from None


def _parse_overrides(args: list[str]) -> list[tuple[str, str, Any]]:
    """``--section.key value`` pairs -> (section, key, typed value), type taken from the dataclass."""
    sections = _sections()
    out = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"command line: unexpected argument {arg!r}; overrides look like --training.steps 20")
        flag, eq, inline = arg[2:].partition("=")
        section, _, key = flag.partition(".")
        if section not in sections:
            if section in MOVED_SECTIONS:
                raise _unknown_section(CLI, section)
            raise ConfigError(f"command line: unknown section in {arg!r}; allowed sections: {', '.join(sections)}")
        section_cls = sections[section].default_factory
        fields = _section_fields(section_cls)
        if key not in fields:
            raise _unknown_key(CLI, section, key, fields)
        ftype = _field_type(section_cls, fields[key])
        if eq:
            text = inline
            i += 1
        elif ftype is bool and (i + 1 == len(args) or args[i + 1].startswith("--")):
            text = "true"
            i += 1
        elif i + 1 < len(args):
            text = args[i + 1]
            i += 2
        else:
            raise ConfigError(f"command line: {arg} needs a value")
        out.append((section, key, _parse_cli_value(ftype, text, "--" + flag)))
    return out


def load_config(config_path: str | None, overrides: list[str] | None = None) -> JobConfig:
    """Defaults, then the TOML file, then command-line overrides; every value checked on the way,
    relative input paths resolved (:data:`PATH_RULE`)."""
    cfg = JobConfig()
    sources: dict[tuple[str, str], str] = {}  # (section, key) -> the config file or CLI, for messages
    if config_path is not None:
        path = Path(config_path)
        if not path.is_file():
            raise ConfigError(f"config file {config_path!r} does not exist (pass --config train_configs/<name>.toml)")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{config_path}: not valid TOML: {e}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{config_path}: top-level key {section!r} must be a [section]; "
                                  f"allowed sections: {', '.join(_sections())}")
            _apply_section(cfg, config_path, section, values, sources)
    for section, key, value in _parse_overrides(overrides or []):
        _apply_section(cfg, CLI, section, {key: value}, sources)
    _check_consistency(cfg, sources)
    _resolve_input_paths(cfg, config_path, sources)
    return cfg


def _where(sources: dict[tuple[str, str], str], *keys: tuple[str, str]) -> str:
    """Where the values of ``keys`` were set, for a message about them together."""
    found = list(dict.fromkeys(sources[k] for k in keys if k in sources))
    return " and ".join(found) or "defaults"


def _check_consistency(cfg: JobConfig, sources: dict[tuple[str, str], str]) -> None:
    """Checks that involve more than one field, blamed on where the fields were set."""
    m = cfg.metrics
    if m.summary_end_step < m.summary_start_step:
        raise ConfigError(f"{_where(sources, ('metrics', 'summary_end_step'), ('metrics', 'summary_start_step'))}: "
                          f"[metrics] summary_end_step ({m.summary_end_step}) must be >= "
                          f"summary_start_step ({m.summary_start_step})")
    t = cfg.training
    if t.global_batch_size == 0:  # the range check already allows only -1 or more
        where = _where(sources, ("training", "global_batch_size"))
        raise ConfigError(f"{where}: {_show(where, 'training', 'global_batch_size', 0)} is not allowed: "
                          f"-1 or >= 1")
    ac = cfg.activation_checkpoint
    if ac.keep != "none" and ac.mode == "none":
        raise ConfigError(f"{_where(sources, ('activation_checkpoint', 'keep'), ('activation_checkpoint', 'mode'))}: "
                          f"[activation_checkpoint] keep = {ac.keep!r} keeps ops of checkpointed blocks, but "
                          f"mode = \"none\" checkpoints nothing; set mode = \"full\" (or \"selective\"), or "
                          f"keep = \"none\"")
    if ac.keep_layers and ac.keep == "none":
        raise ConfigError(f"{_where(sources, ('activation_checkpoint', 'keep_layers'), ('activation_checkpoint', 'keep'))}: "
                          f"[activation_checkpoint] keep_layers = {ac.keep_layers} limits the blocks that keep ops, "
                          f"but keep = \"none\" keeps none; set keep (e.g. \"attention\"), or keep_layers = 0 "
                          "(--activation_checkpoint.keep_layers 0)")
    if ac.keep_moe_layers and ac.keep != "attention_and_moe":
        where = _where(sources, ("activation_checkpoint", "keep_moe_layers"), ("activation_checkpoint", "keep"))
        raise ConfigError(f"{where}: [activation_checkpoint] keep_moe_layers = {ac.keep_moe_layers} says how many "
                          f"blocks keep the routed experts, but keep = {ac.keep!r} keeps no experts; set keep = "
                          "\"attention_and_moe\" (--activation_checkpoint.keep attention_and_moe), or "
                          "keep_moe_layers = 0")
    if ac.keep_layers and ac.keep_moe_layers > ac.keep_layers:
        where = _where(sources, ("activation_checkpoint", "keep_moe_layers"), ("activation_checkpoint", "keep_layers"))
        raise ConfigError(f"{where}: [activation_checkpoint] keep_moe_layers = {ac.keep_moe_layers} is more than "
                          f"keep_layers = {ac.keep_layers}: the experts are kept only in blocks that keep the "
                          "attention core; lower keep_moe_layers or raise keep_layers")
    n = cfg.parallelism.simulate_world_size
    if n:
        where = _where(sources, ("parallelism", "simulate_world_size"))
        if n == 1:
            raise ConfigError(f"{where}: {_show(where, 'parallelism', 'simulate_world_size', 1)} simulates no other "
                              f"rank: use 0 (off, one process) or a world of at least 2 ranks")
        if cfg.checkpoint.enable:
            # A DCP save would hold only rank 0's shards of an N-rank checkpoint.
            raise ConfigError(f"{_where(sources, ('parallelism', 'simulate_world_size'), ('checkpoint', 'enable'))}: "
                              f"a simulated world ([parallelism] simulate_world_size = {n}) cannot save or resume a "
                              f"checkpoint, whose other ranks' shards do not exist; set [checkpoint] enable = false "
                              f"(--checkpoint.enable false; [checkpoint] initial_load_path still loads weights)")
    from kernels.moe import available_moe_backends

    if cfg.moe.backend not in available_moe_backends():
        where = _where(sources, ("moe", "backend"))
        raise ConfigError(f"{where}: {_show(where, 'moe', 'backend', cfg.moe.backend)} is not a registered MoE "
                          f"backend; choose one of {', '.join(available_moe_backends())}")


def _resolve_input_paths(cfg: JobConfig, config_path: str | None, sources: dict[tuple[str, str], str]) -> None:
    """Each relative input path becomes the first of its candidates that exists (:data:`PATH_RULE`);
    a path found in the working directory is left as written. A missing dataset or tokenizer stops
    here with the paths tried; a missing ``initial_load_path`` is reported only by a run that reads it
    (a resumed run does not)."""
    for section in _sections():
        obj = getattr(cfg, section)
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if not f.metadata.get("input_path") or not value or value.startswith("hf:"):
                continue
            where = sources.get((section, f.name), "defaults")
            path = Path(value).expanduser()
            bases = [Path.cwd()]
            if where != CLI:
                bases += ([Path(config_path).resolve().parent] if config_path else []) + [PROJECT_DIR]
            tried = list(dict.fromkeys((base / path).resolve() for base in bases))
            found = next((c for c in tried if c.exists()), None)
            if found is not None:
                if found != tried[0] or value.startswith("~"):
                    setattr(obj, f.name, str(found))
            elif (section, f.name) == ("checkpoint", "initial_load_path"):
                setattr(obj, f.name, str(tried[0]))
            else:
                tried_text = str(tried[0]) if len(tried) == 1 else "tried " + ", ".join(map(str, tried))
                raise ConfigError(f"{where}: {_show(where, section, f.name, value)} not found ({tried_text})")


def config_help() -> str:
    lines = ["usage: train.py --config FILE.toml [--section.key VALUE ...] [--debug]", "",
             "--debug is short for --metrics.log_expert_load.",
             "Every key below can be set in the TOML file or overridden on the command line.", ""]
    for section, sf in _sections().items():
        section_cls = sf.default_factory
        lines.append(f"[{section}]")
        for f in dataclasses.fields(section_cls):
            ftype = _field_type(section_cls, f)
            extra = ""
            if f.metadata.get("choices"):
                extra = f" (one of: {', '.join(map(str, f.metadata['choices']))})"
            lines.append(f"  --{section}.{f.name} {ftype.__name__} = {f.default!r}{extra}")
            lines.append(f"      {_help(f)}")
        lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> JobConfig | None:
    """Command line -> JobConfig; returns None after printing help for ``--help``."""
    if "--help" in argv or "-h" in argv:
        print(config_help())
        return None
    config_path = None
    rest = []
    i = 0
    while i < len(argv):
        if argv[i] == "--debug":  # a shorthand TorchTitan users know
            rest.append("--metrics.log_expert_load")
            i += 1
        elif argv[i] == "--config":
            if i + 1 == len(argv):
                raise ConfigError("command line: --config needs a file path")
            config_path = argv[i + 1]
            i += 2
        elif argv[i].startswith("--config="):
            config_path = argv[i].split("=", 1)[1]
            i += 1
        else:
            rest.append(argv[i])
            i += 1
    return load_config(config_path, rest)


def to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def config_markdown() -> str:
    """The config reference as markdown tables, as docs/config.md shows it (a test keeps them equal)."""
    out = []
    for section, sf in _sections().items():
        section_cls = sf.default_factory
        out += [f"**[{section}]**", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for f in dataclasses.fields(section_cls):
            meaning = _help(f).replace("|", "\\|")
            if f.metadata.get("choices"):
                meaning += " (one of: " + ", ".join(f"`{c}`" for c in f.metadata["choices"]) + ")"
            out.append(f"| `{f.name}` | {_field_type(section_cls, f).__name__} | `{f.default!r}` | {meaning} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(config_markdown())
