"""Head to head with upstream TorchTitan on one GPU: the same model, data, tokenizer and settings.

    python -m bench.compare --model qwen3_30b_a3b --layers 4 --seq-len 16384          # ~8 min on an H200
    python -m bench.compare --model qwen3_235b_a22b --layers 1 --seq-len 16384
    python -m bench.compare --layers 48 --gpus 8 --ep 8 --only titan_fp8,ours_mega_fp8   # 8 GPUs
    python -m bench.compare --layers 48 --simulate-world 8 --ep 8    # one rank of that job, one GPU
    python -m bench.compare ... --profile          # + GPU time by part of each run (bench.step_breakdown)
    python -m bench.compare ... --only titan_bf16,ours_mega --steps 20 --out outputs/compare
    python -m bench.compare ... --only titan_bf16,ours_mega --variant keep_attn="--activation_checkpoint.keep attention"
    python -m bench.compare ... --titan-variant titan_no_ac="--activation_checkpoint.mode none"   # upstream's modes
    python -m bench.compare ... --dry-run          # write the configs and data, print the commands
    python -m bench.compare --write-tokenizer      # regenerate assets/tokenizer/tokenizer.json

Runs, one after another, each in its own process with a timeout and its log kept in
``<out>/logs/<run>.log``:

* ``titan_bf16``, ``titan_fp8``: upstream TorchTitan 0.2.2's own trainer (``torchtitan.train``
  under ``torchrun`` with one process) from a TOML this script writes: model ``qwen3``, a
  reduced-depth flavor registered by ``bench/torchtitan_flavors.py`` through
  ``--experimental.custom_import``, local batch 1, full activation checkpointing, compile (model
  and loss), bf16 autocast; FP8 is its ``quantize.grouped_mm.float8`` converter on the experts
  (torchao 0.16 rowwise ``_scaled_grouped_mm``; skipped with a note when torchao is missing).
* ``ours_torchtitan``, ``ours_grouped_mm``, ``ours_mega``: ``train.py`` with the same shape, seq len,
  batch, activation checkpointing, compile and optimizer hyperparameters, one process (bf16
  autocast, as upstream on one GPU), and the three MoE backends. The AdamW is ours in Triton with
  the compute copies on one GPU (``[optimizer] implementation = "triton"``;
  ``--variant name="--optimizer.implementation auto"`` runs torch's fused one, as upstream does), torch's fused one under torchrun. ``ours_grouped_mm_fp8`` runs ``grouped_mm`` with
  ``[precision] moe = fp8_rowwise`` (TorchTitan's FP8 method), ``ours_mega_fp8`` runs ``mega`` with
  ``[precision] moe = fp8_blockwise``.

Both trainers read the same tokenizer (``assets/tokenizer/tokenizer.json``: the project's
sentencepiece model converted with identical ids, see ``sentencepiece_to_hf``) and the same data
(``assets/data/stories/corpus.txt`` written as a JSON-lines folder, one ``{"text": line}`` a line,
into ``<out>/data``). Documents are opened with BOS and closed with EOS by both. Differences that
remain, all outside the timed work: our loader visits samples in a seeded shuffled order, upstream's
in file order; initial weights come from each trainer's own init; upstream's router keeps an
expert-bias buffer it never updates for Qwen3 (0.2.2), so ours runs with ``--moe.load_balance none``
by default (``--load-balance`` changes it).

``--simulate-world N`` (with ``--gpus 1``) times one rank of an N-rank job on the one GPU: each
run is one plain process acting as rank 0 of N with the collectives looped back, upstream through
``bench/titan_simulated.py`` and ours through ``[parallelism] simulate_world_size``, both with the
same FSDP over N and EP ``--ep``. Times exclude communication; the report marks such runs ``simulated``.

Reported per run, over steps 6-20 (``--window``): mean tokens/s per GPU (mean of the per-step
figures), mean step time (ours: as logged; upstream: tokens per step / its tps, since it logs no
step time), peak memory (upstream logs max *reserved*, ours max *allocated*: both as each logs
it), MFU (both count FLOPs the same way: 6 x active non-embedding parameters + 12 x layers x heads
x head_dim x seq len; peak 989 / 989.5 TFLOP/s on H100/H200), final loss, and the ratio of tokens/s
to upstream's best run (bf16 or FP8, whichever is faster) and to upstream's bf16. Written to
``<out>/compare.json``, ``<out>/compare.md`` (a table for BENCHMARKS.md with the date, GPU,
versions and exact commands) and ``<out>/compare.png`` (matplotlib, else PIL, else skipped).

Wheels for the GPU machine (no network there; torch, triton, numpy, pandas, pyarrow, xxhash,
tokenizers, huggingface-hub, fsspec and matplotlib are already installed): see bench/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "assets" / "data" / "stories" / "corpus.txt"
TOKENIZER_DIR = ROOT / "assets" / "tokenizer"
SP_MODEL = TOKENIZER_DIR / "tokenizer.model"

# Our flavor -> (upstream 0.2.2 flavor, its rope_theta). Ours takes rope_theta from the config, so
# the benchmark passes upstream's value to keep the two models identical.
MODELS = {
    "qwen3_30b_a3b": ("30B-A3B", 1e6),
    "qwen3_235b_a22b": ("235B-A22B", 5e6),
}

# Settings both trainers get (upstream's defaults differ: lr 8e-4, warmup 200, linear decay to 0).
LR, WARMUP_STEPS, MIN_LR_FACTOR, WEIGHT_DECAY, MAX_NORM, SEED = 3e-4, 5, 0.1, 0.1, 1.0, 0

# --------------------------------------------------------------------------------------------
# Tokenizer: the project's sentencepiece BPE as a Hugging Face tokenizer.json with the same ids
# --------------------------------------------------------------------------------------------

WHITESPACE = "\u2581"  # sentencepiece's visible space


def sentencepiece_to_hf(model_path: str | Path = SP_MODEL):
    """The sentencepiece BPE model at ``model_path`` as a ``tokenizers.Tokenizer`` giving the same ids.

    Sentencepiece BPE encodes by replacing spaces with U+2581, putting one U+2581 in front of the
    text (its dummy prefix), splitting into characters and repeatedly merging the adjacent pair
    whose concatenation is the highest-scored piece; characters outside the vocabulary become their
    UTF-8 byte pieces. The ``tokenizers`` BPE model merges by rank instead, so every split of every
    piece into two pieces becomes a merge ranked by the piece's score. No pre-tokenizer: the
    normaliser does the prefix and the spaces, which keeps runs of spaces exactly as sentencepiece
    does. Special pieces (pad, unk, BOS, EOS) become special added tokens; byte pieces are used only
    by the byte fallback. Only identity normalisation is supported (the project's model has it).
    """
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_path).read_bytes())
    norm = proto.normalizer_spec
    if proto.trainer_spec.model_type != sentencepiece_model_pb2.TrainerSpec.BPE:
        raise ValueError(f"{model_path}: only sentencepiece BPE models can be converted")
    if norm.name != "identity" or norm.remove_extra_whitespaces or not norm.add_dummy_prefix:
        raise ValueError(f"{model_path}: conversion assumes identity normalisation with the dummy prefix "
                         f"and spaces kept as written (got {norm.name!r})")
    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    normal = {sp.id_to_piece(i): sp.get_score(i) for i in range(sp.get_piece_size())
              if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i))}
    ranked = []
    for piece, score in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                # Higher score merges first; ties (none in a trained model) by id, then by split.
                ranked.append((-score, vocab[piece], cut, left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=sp.id_to_piece(sp.unk_id()),
                               byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(WHITESPACE), normalizers.Replace(" ", WHITESPACE)])
    tok.decoder = decoders.Sequence([decoders.Replace(WHITESPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(sp.id_to_piece(i), special=True, normalized=False)
                            for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)])
    return tok


def tokenizer_config(model_path: str | Path = SP_MODEL) -> dict[str, Any]:
    """tokenizer_config.json naming the special tokens, read by both trainers. add_bos/add_eos are
    false: each data loader asks for BOS and EOS per document itself."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    return {"bos_token": sp.id_to_piece(sp.bos_id()), "eos_token": sp.id_to_piece(sp.eos_id()),
            "pad_token": sp.id_to_piece(sp.pad_id()), "unk_token": sp.id_to_piece(sp.unk_id()),
            "add_bos_token": False, "add_eos_token": False, "model_max_length": 1 << 20,
            "tokenizer_class": "PreTrainedTokenizerFast"}


def write_tokenizer(out_dir: Path = TOKENIZER_DIR, model_path: Path = SP_MODEL) -> list[Path]:
    """Write tokenizer.json and tokenizer_config.json (deterministic bytes for the same inputs)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok_path, cfg_path = out_dir / "tokenizer.json", out_dir / "tokenizer_config.json"
    tok_path.write_text(sentencepiece_to_hf(model_path).to_str(pretty=True) + "\n", encoding="utf-8")
    cfg_path.write_text(json.dumps(tokenizer_config(model_path), indent=2) + "\n", encoding="utf-8")
    return [tok_path, cfg_path]


def write_jsonl_data(out_dir: Path, corpus: Path = CORPUS) -> Path:
    """The corpus (one document a line) as a JSON-lines folder both trainers read."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "corpus.jsonl"
    with corpus.open(encoding="utf-8") as src, path.open("w", encoding="utf-8") as dst:
        for line in src:
            line = line.rstrip("\n")
            if line:
                dst.write(json.dumps({"text": line}, ensure_ascii=False) + "\n")
    return out_dir


# --------------------------------------------------------------------------------------------
# The runs
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    name: str            # short id, used for --only and the log file
    label: str           # table row
    trainer: str         # "torchtitan" (upstream) or "ours"
    precision: str       # "bf16" or "fp8"
    cmd: list[str]
    skip: str = ""       # why the run is not made, if it is not


@dataclasses.dataclass
class Setting:
    model: str
    layers: int
    seq_len: int
    steps: int
    out: Path
    load_balance: str = "none"
    attention_backend: str = ""   # ours only; empty = the config's default
    window: tuple[int, int] = (6, 20)
    gpus: int = 1                 # processes (GPUs) of every run: FSDP over all of them
    ep: int = 1                   # expert-parallel degree within them
    profile: bool = False         # profile steps after the timed ones (see profile_args)
    simulate_world: int = 0       # N >= 2: one process per run as rank 0 of N (no communication)

    @property
    def world(self) -> int:
        """The ranks the parallel layout is laid out over: the simulated world, or the GPUs."""
        return self.simulate_world or self.gpus

    @property
    def titan_flavor(self) -> str:
        return f"{MODELS[self.model][0]}-{self.layers}L"

    @property
    def rope_theta(self) -> float:
        return MODELS[self.model][1]


def torchtitan_toml(s: Setting, *, data_dir: Path, tokenizer_dir: Path = TOKENIZER_DIR) -> str:
    """Upstream TorchTitan 0.2.2's job config for the setting (FP8 is added on the command line)."""
    def q(v: Any) -> str:
        return json.dumps(str(v))

    ranks = f"rank 0 of {s.simulate_world} simulated" if s.simulate_world else f"{s.gpus} GPU(s)"
    return f"""# Written by bench/compare.py: upstream TorchTitan 0.2.2, the head-to-head setting ({ranks}).
[job]
description = {q(f"Qwen3 {MODELS[s.model][0]} shape, {s.layers} layers, {ranks}, EP {s.ep} (bench.compare)")}
dump_folder = {q(s.out / "torchtitan")}

[model]
name = "qwen3"
flavor = {q(s.titan_flavor)}
hf_assets_path = {q(tokenizer_dir)}

[experimental]
custom_import = "bench.torchtitan_flavors"

[training]
dataset = "c4_test"
dataset_path = {q(data_dir)}
local_batch_size = 1
seq_len = {s.seq_len}
steps = {s.steps}
max_norm = {MAX_NORM}
mixed_precision_param = "bfloat16"

[optimizer]
name = "AdamW"
lr = {LR}
eps = 1e-8
weight_decay = {WEIGHT_DECAY}

[lr_scheduler]
warmup_steps = {WARMUP_STEPS}
decay_type = "cosine"
min_lr_factor = {MIN_LR_FACTOR}

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
expert_parallel_degree = {s.ep}

[activation_checkpoint]
mode = "full"

[compile]
enable = true
components = ["model", "loss"]

[checkpoint]
enable = false

[metrics]
log_freq = 1
disable_color_printing = false

[debug]
seed = {SEED}
"""


TITAN_FP8_ARGS = ["--model.converters", "quantize.grouped_mm.float8", "--quantize.grouped_mm.float8.fqns", "experts"]


def plan(s: Setting, *, toml_path: Path, data_dir: Path, python: str = sys.executable,
         ours_extra: list[str] = (), titan_extra: list[str] = (),
         variants: list[tuple[str, list[str]]] = (), titan_variants: list[tuple[str, list[str]]] = ()) -> list[Run]:
    """Every run of the comparison, in the order they are made; ``variants`` (name, arguments) are
    ``ours_mega`` with those arguments added, run last (ablations in the same call and table);
    ``titan_variants`` are ``titan_bf16`` with upstream's arguments added (its other activation
    checkpointing modes, say), run after upstream's own runs."""
    # A simulated world runs each trainer as one plain process, rank 0 of N (bench/titan_simulated.py
    # for upstream, [parallelism] simulate_world_size for ours).
    titan_launch = ([python, "-m", "bench.titan_simulated", str(s.simulate_world)] if s.simulate_world else
                    [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(s.gpus),
                     "-m", "torchtitan.train"])
    titan = [*titan_launch, "--job.config_file", str(toml_path), *titan_extra]
    no_titan = "" if _has("torchtitan") else "torchtitan is not installed (pip install \".[baseline]\")"
    no_torchao = no_titan or ("" if _has("torchao") else "torchao is not installed (FP8 needs torchao==0.16.0)")
    # One GPU: a plain process (bf16 autocast); several: torchrun, FSDP over all ranks (+ EP).
    launch = ([python, "train.py"] if s.gpus == 1 else
              [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(s.gpus), "train.py"])
    ours = [*launch, "--config", "train_configs/qwen3_30b_a3b_1gpu.toml",
            "--job.dump_folder", str(s.out / "ours"),
            "--model.flavor", s.model, "--model.n_layers", str(s.layers), "--model.rope_theta", repr(s.rope_theta),
            "--model.tokenizer_path", str(TOKENIZER_DIR / "tokenizer.json"),
            "--training.dataset_path", str(data_dir), "--training.dataset_text_field", "text",
            "--training.seq_len", str(s.seq_len), "--training.local_batch_size", "1",
            "--training.global_batch_size", "-1", "--training.steps", str(s.steps),
            "--training.max_norm", repr(MAX_NORM), "--training.seed", str(SEED),
            "--training.mixed_precision_param", "bfloat16", "--training.device", "cuda",
            "--optimizer.lr", repr(LR), "--optimizer.eps", "1e-8", "--optimizer.weight_decay", repr(WEIGHT_DECAY),
            # Ours in Triton (writing the compute copies) in one process; torch's fused AdamW over FSDP's DTensors.
            "--optimizer.implementation", "triton" if s.world == 1 else "auto",
            "--lr_scheduler.warmup_steps", str(WARMUP_STEPS), "--lr_scheduler.decay_type", "cosine",
            "--lr_scheduler.decay_ratio", "1.0", "--lr_scheduler.min_lr_factor", repr(MIN_LR_FACTOR),
            # Upstream's full AC, everything recomputed (the config's keep is a --variant here).
            "--activation_checkpoint.mode", "full", "--activation_checkpoint.keep", "none", "--compile.enable", "true",
            "--moe.load_balance", s.load_balance, "--metrics.log_freq", "1",
            "--parallelism.expert_parallel_degree", str(s.ep),
            "--metrics.summary_start_step", str(s.window[0]), "--metrics.summary_end_step", str(s.window[1])]
    if s.simulate_world:
        ours += ["--parallelism.simulate_world_size", str(s.simulate_world)]
    if s.attention_backend:
        ours += ["--model.attention_backend", s.attention_backend]
    if s.profile:
        titan += profile_args(s, "torchtitan")
        ours += profile_args(s, "ours")
    no_titan_backend = "" if _has("torchtitan") else "our 'torchtitan' backend needs the torchtitan package"
    return [
        Run("titan_bf16", "TorchTitan 0.2.2, bf16", "torchtitan", "bf16", titan, skip=no_titan),
        Run("titan_fp8", "TorchTitan 0.2.2, FP8 experts (torchao rowwise)", "torchtitan", "fp8",
            titan + TITAN_FP8_ARGS, skip=no_torchao),
    ] + [
        Run(name, f"TorchTitan 0.2.2, `{shlex.join(args)}`", "torchtitan",
            "fp8" if "quantize.grouped_mm.float8" in args else "bf16", titan + args,
            skip=no_torchao if "quantize.grouped_mm.float8" in args else no_titan)
        for name, args in titan_variants
    ] + [
        Run("ours_torchtitan", "ours, `torchtitan` backend, bf16", "ours", "bf16",
            ours + ["--moe.backend", "torchtitan", *ours_extra], skip=no_titan_backend),
        Run("ours_grouped_mm", "ours, `grouped_mm` backend, bf16", "ours", "bf16",
            ours + ["--moe.backend", "grouped_mm", *ours_extra]),
        Run("ours_mega", "ours, `mega` backend, bf16", "ours", "bf16", ours + ["--moe.backend", "mega", *ours_extra]),
        Run("ours_grouped_mm_fp8", "ours, `grouped_mm` backend, FP8 experts (rowwise, TorchTitan's method)",
            "ours", "fp8", ours + ["--moe.backend", "grouped_mm", "--precision.moe", "fp8_rowwise", *ours_extra]),
        Run("ours_mega_fp8", "ours, `mega` backend, FP8 experts (blockwise)", "ours", "fp8",
            ours + ["--moe.backend", "mega", "--precision.moe", "fp8_blockwise", *ours_extra]),
    ] + [
        Run(name, f"ours, `{_variant_backend(args)}` backend, `{shlex.join(args)}`", "ours",
            "fp8" if any("fp8" in a for a in args) else "bf16",
            ours + ["--moe.backend", "mega", *ours_extra, *args])
        for name, args in variants
    ]


def _variant_backend(args: list[str]) -> str:
    """The MoE backend a variant runs: ``mega`` unless its arguments name another (the last wins)."""
    backend = "mega"
    for flag, value in zip(args, args[1:]):
        if flag == "--moe.backend":
            backend = value
    return backend


def parse_variant(text: str, flag: str = "--variant") -> tuple[str, list[str]]:
    """``NAME=ARGS`` -> (NAME, ARGS split like a shell): a run of ``ours_mega`` plus ARGS (which may
    name another backend: the trainer takes the last value of a repeated key), or for
    ``--titan-variant`` of ``titan_bf16`` plus upstream's ARGS."""
    name, sep, args = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_]+", name) or not args.strip():
        example = ("titan_sac_op='--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op'"
                   if flag == "--titan-variant" else "keep_attn='--activation_checkpoint.keep attention'")
        raise ValueError(f"{flag} {text!r}: expected NAME=ARGS, NAME letters, digits and _ (it names the log "
                         f"file), ARGS {'upstream' if flag == '--titan-variant' else 'our'} trainer's arguments, "
                         f"e.g. {example}")
    return name, shlex.split(args)


# Profiled steps come after --steps, so the timed window is untouched. Both trainers run the same
# number of steps (their cosine schedules, which span the whole run, stay equal): upstream's
# profiler schedule (wait, warmup 3, active 1 at step profile_freq) profiles the last one, ours the
# last two.
PROFILED_STEPS = {"ours": 2, "torchtitan": 1}
PROFILE_EXTRA_STEPS = 4


def profile_args(s: Setting, trainer: str) -> list[str]:
    """Arguments that make a run profile steps after its timed ones (a later key wins over the
    earlier --training.steps in both trainers)."""
    last = s.steps + PROFILE_EXTRA_STEPS
    if trainer == "ours":
        return ["--training.steps", str(last), "--profiling.enable_profiling", "true",
                "--profiling.profile_start_step", str(last - PROFILED_STEPS["ours"] + 1),
                "--profiling.profile_steps", str(PROFILED_STEPS["ours"])]
    return ["--training.steps", str(last), "--profiling.enable_profiling", "--profiling.profile_freq", str(last)]


def take_trace(s: Setting, trainer: str) -> Path | None:
    """The rank-0 trace the last run of ``trainer`` wrote (and no older one), or None."""
    root = s.out / ("ours" if trainer == "ours" else "torchtitan") / "profile_traces"
    traces = sorted(root.glob("*/rank0_trace.json"), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    return traces[-1] if traces else None


def profile_breakdown(s: Setting, run: Run, out: Path) -> dict[str, Any]:
    """``bench.step_breakdown`` of the run's trace, written to <out>/breakdown/<run>.md/.json; the
    trace folder is removed afterwards (traces are large, and the next run must not read it)."""
    from bench import step_breakdown

    trace = take_trace(s, run.trainer)
    if trace is None:
        return {"breakdown_error": "no trace written"}
    try:
        report = step_breakdown.breakdown(json.loads(trace.read_text()), PROFILED_STEPS[run.trainer])
    except (ValueError, json.JSONDecodeError) as e:
        return {"breakdown_error": str(e)}
    finally:
        shutil.rmtree(trace.parent.parent, ignore_errors=True)
    folder = out / "breakdown"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{run.name}.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (folder / f"{run.name}.md").write_text(f"# {run.label}\n\n" + step_breakdown.markdown(report) + "\n",
                                           encoding="utf-8")
    return {"breakdown": {k: report[k] for k in ("wall_ms", "busy_ms", "idle_ms", "comm_exposed_ms", "parts_ms")}}


def breakdown_table(results: list[dict[str, Any]]) -> str:
    """Per-part GPU ms per step, one column per profiled run."""
    from bench.step_breakdown import PARTS

    runs = [r for r in results if "breakdown" in r]
    if not runs:
        return ""
    lines = ["| ms / step | " + " | ".join(r["name"] for r in runs) + " |",
             "| --- |" + " ---: |" * len(runs)]
    for part in PARTS:
        lines.append(f"| {part} | " + " | ".join(f"{r['breakdown']['parts_ms'][part]:.1f}" for r in runs) + " |")
    for key in ("idle_ms", "comm_exposed_ms", "wall_ms"):
        lines.append(f"| {key[:-3].replace('_', ' ')} | " + " | ".join(f"{r['breakdown'][key]:.1f}" for r in runs) + " |")
    return "\n".join(lines)


def _has(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def preflight(env: dict[str, str], python: str = sys.executable) -> dict[str, str]:
    """Import checks for upstream's trainer and its FP8 path in a child process with the runs'
    environment (CUDA stays uninitialised here): ``{"titan": why not, "titan_fp8": why not}``,
    empty strings where the imports work. A missing or mismatched wheel then shows up as one
    line in the report instead of a traceback in a log."""
    checks = {"titan": "import torchtitan.train, bench.torchtitan_flavors",
              "titan_fp8": "import torchao.prototype.moe_training.conversion_utils"}
    result = {}
    for key, code in checks.items():
        proc = subprocess.run([python, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        result[key] = "" if proc.returncode == 0 else "import failed: " + (failure_reason(proc.stderr) or "see stderr")
    return result


def run_env() -> dict[str, str]:
    """The environment both trainers run in: this one (NVLink multicast settings included), with
    upstream's data loader kept off the network and the repo root importable for custom_import."""
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])))
    # NVLink multicast stays off on shared hosts (it can put a host's GPUs out of service).
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        env.setdefault(key, value)
    return env


def run_one(run: Run, log_path: Path, timeout_s: float, env: dict[str, str]) -> dict[str, Any]:
    """Run ``run.cmd`` from the repo root, output to ``log_path``; its own process group, so a
    timeout also ends torchrun's worker and compile subprocesses."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log_path.open("w", encoding="utf-8") as log:
        log.write("$ " + shlex.join(run.cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(run.cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
    return {"returncode": rc, "timed_out": timed_out, "wall_s": round(time.perf_counter() - start, 1)}


# --------------------------------------------------------------------------------------------
# Log parsing and the summary
# --------------------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_KEY_VALUE = re.compile(r"([a-z_]+):\s*(-?[\d,]*\.?\d+(?:[eE][-+]?\d+)?|nan|inf|-inf|n/a)")


def parse_step_lines(text: str) -> dict[int, dict[str, float]]:
    """Per-step metrics from a log of either trainer: ``{step: {loss, tps, memory_gib, ...}}``.

    Upstream TorchTitan 0.2.2 prints (with ANSI colours, after its logger prefix)
    ``step: 6  loss:  7.12345  grad_norm:  1.2345  memory: 56.80GiB(40.63%)  tps: 50,135  tflops: 324.00
    mfu: 32.70%``; ours prints ``step:     6  loss: ...  aux_loss: ...  grad_norm: ...  lr: ...
    memory:  68.80GiB  tps: 61,018  step_time: 0.269s  tflops: 394.00  mfu: 39.8%``. A line counts
    when it has ``tps:``; validation lines and our expert-load lines are skipped. A step logged twice
    keeps the last line.
    """
    steps: dict[int, dict[str, float]] = {}
    for raw in text.splitlines():
        line = _ANSI.sub("", raw)
        if "tps:" not in line or "validate step:" in line:
            continue
        m = re.search(r"\bstep:\s*(\d+)\s", line)
        if not m:
            continue
        values: dict[str, float] = {}
        for key, value in _KEY_VALUE.findall(line[m.end():]):
            if value == "n/a":
                continue
            values[{"memory": "memory_gib"}.get(key, key)] = float(value.replace(",", ""))
        if "tps" in values:
            steps[int(m.group(1))] = values
    return steps


def summarize(steps: dict[int, dict[str, float]], tokens_per_step: int,
              window: tuple[int, int] = (6, 20)) -> dict[str, Any]:
    """Means over the step window (or every step after the first, if the run stopped before the
    window), peak memory over all steps and the loss at the window's last step (or the last step
    logged, if earlier): steps run after the window (profiled ones) do not move it."""
    lo, hi = window
    chosen = [s for s in sorted(steps) if lo <= s <= hi]
    note = ""
    if not chosen:
        chosen = sorted(steps)[1:] or sorted(steps)
        note = f"window {lo}-{hi} not reached"
    if not chosen:
        return {"steps_logged": 0}
    tps = [steps[s]["tps"] for s in chosen]
    step_time = [steps[s].get("step_time", tokens_per_step / steps[s]["tps"]) for s in chosen]
    mfu = [steps[s]["mfu"] for s in chosen if "mfu" in steps[s]]
    tflops = [steps[s]["tflops"] for s in chosen if "tflops" in steps[s]]
    memory = [v["memory_gib"] for v in steps.values() if "memory_gib" in v]
    last = hi if hi in steps else max(steps)
    return {
        "steps_logged": len(steps), "window": [chosen[0], chosen[-1]], "window_note": note,
        "tokens_per_s": sum(tps) / len(tps),
        "step_time_s": sum(step_time) / len(step_time),
        "tflops": sum(tflops) / len(tflops) if tflops else None,
        "mfu_pct": sum(mfu) / len(mfu) if mfu else None,
        "peak_memory_gib": max(memory) if memory else None,
        "final_step": last, "final_loss": steps[last].get("loss"),
    }


def summarize_log(text: str, tokens_per_step: int, window: tuple[int, int]) -> dict[str, Any]:
    """:func:`summarize` of a trainer's log, with ``simulated``: the line that says the run simulates
    rank 0 of a larger world (its times exclude the collectives), else None."""
    simulated = next((line for line in _ANSI.sub("", text).splitlines() if line.startswith("simulating rank 0 of ")),
                     None)
    return {**summarize(parse_step_lines(text), tokens_per_step, window), "simulated": simulated}


def add_ratios(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Give each measured result ``vs_titan_best`` and ``vs_titan_bf16`` (tokens/s ratios) and
    return the baselines used."""
    measured = [r for r in results if r.get("status") == "ok" and r.get("tokens_per_s")]
    titan = [r for r in measured if r["trainer"] == "torchtitan"]
    best = max(titan, key=lambda r: r["tokens_per_s"], default=None)
    bf16 = next((r for r in titan if r["precision"] == "bf16"), None)
    for r in measured:
        r["vs_titan_best"] = r["tokens_per_s"] / best["tokens_per_s"] if best else None
        r["vs_titan_bf16"] = r["tokens_per_s"] / bf16["tokens_per_s"] if bf16 else None
    ours = [r for r in measured if r["trainer"] == "ours"]
    ours_best = max(ours, key=lambda r: r["tokens_per_s"], default=None)
    ours_bf16 = max((r for r in ours if r["precision"] == "bf16"), key=lambda r: r["tokens_per_s"], default=None)
    # --repeat: the best-vs-best ratio within each round (the two runs adjacent in time).
    oe, te = ((r or {}).get("tokens_per_s_each") for r in (ours_best, best))
    each = [o / t for o, t in zip(oe, te)] if oe and te and len(oe) == len(te) else None
    return {
        "titan_best": best and best["name"], "titan_bf16": bf16 and bf16["name"],
        "ours_best": ours_best and ours_best["name"],
        "ours_best_vs_titan_best": ours_best["vs_titan_best"] if ours_best and best else None,
        "ours_best_vs_titan_best_each": each,
        "same_precision_bf16": ours_bf16["vs_titan_bf16"] if ours_bf16 and bf16 else None,
    }


def combine_repeats(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """One report entry from a run's repetitions (``--repeat``): all ok -> the means of tokens/s, step
    time and MFU, the max of peak memory, the first repetition's loss and breakdown, each
    repetition's tokens/s in ``tokens_per_s_each``; otherwise the first repetition that was not ok
    (its status says which). Repetitions not run (``--budget`` spent, or not yet: partial reports)
    are left out when another one ran."""
    ran = [e for e in entries if e.get("status") not in (None, "not run")]
    entries = ran or entries[:1]
    if len(entries) == 1:
        return entries[0]
    bad = next((e for e in entries if e.get("status") != "ok"), None)
    if bad is not None:
        i = entries.index(bad)
        out = dict(bad)
        if out.get("status") not in ("skipped", "dry run"):
            out["status"] = f"{bad.get('status')} (repetition {i + 1} of {len(entries)})"
        return out
    out = dict(entries[0])

    def mean(key):
        vals = [e[key] for e in entries if e.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    out.update(tokens_per_s=mean("tokens_per_s"), step_time_s=mean("step_time_s"), mfu_pct=mean("mfu_pct"),
               tflops=mean("tflops"), tokens_per_s_each=[e["tokens_per_s"] for e in entries],
               logs=[e.get("log") for e in entries])
    mems = [e["peak_memory_gib"] for e in entries if e.get("peak_memory_gib") is not None]
    out["peak_memory_gib"] = max(mems) if mems else None
    return out


def failure_reason(text: str) -> str:
    """The last line of a log that names an error (a traceback's last line, ``error: ...``), shortened."""
    for line in reversed(_ANSI.sub("", text).splitlines()):
        line = line.strip()
        if re.search(r"(Error|Exception|error:|OutOfMemory|Killed)", line) and not line.startswith("File "):
            return line[:200]
    return ""


def status_of(run_info: dict[str, Any], log_text: str, summary: dict[str, Any]) -> str:
    if run_info.get("timed_out"):
        return "timed out"
    if "not implemented" in log_text and not summary.get("steps_logged"):
        return "not implemented"
    if run_info.get("returncode") != 0:
        return "failed"
    return "ok" if summary.get("steps_logged") else "no steps logged"


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def _fmt(v: Any, spec: str, suffix: str = "") -> str:
    return "" if v is None else f"{v:{spec}}{suffix}"


def markdown(report: dict[str, Any]) -> str:
    s, env = report["setting"], report["environment"]
    lines = [
        f"## Head to head with upstream TorchTitan — {report['date']}, one {env.get('gpu', '?')}",
        "",
        f"`{report['command']}`: Qwen3 {s['titan_flavor'].rsplit('-', 1)[0]} shape with {s['layers']} layers "
        f"(both trainers build {report['params']['total']:,} parameters, {report['params']['active']:,} active), "
        f"seq len {s['seq_len']}, batch 1, full activation checkpointing, compile, bf16 autocast, one process; "
        f"same tokenizer and data (`assets/tokenizer/tokenizer.json`, the shipped corpus as JSON lines); "
        f"means over steps {s['window'][0]}-{s['window'][1]} of {s['steps']}. Software: torch {env.get('torch')}, "
        f"triton {env.get('triton')}, torchtitan {env.get('torchtitan')}, torchao {env.get('torchao')}, "
        f"driver {env.get('driver', '?')}, commit {env.get('commit', '?')}.",
        "",
        "| run | tokens/s per GPU | vs TorchTitan best | vs TorchTitan bf16 | step time | MFU | peak memory | "
        f"loss at step {s['window'][1]} | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["results"]:
        ok = r["status"] == "ok"
        status = r["status"] + (f": {r['skip']}" if r.get("skip") else "")
        if r.get("reason"):
            status += f": {r['reason'].replace('|', '/')}"
        if ok and r.get("window_note"):
            status += f" ({r['window_note']})"
        if ok and r.get("simulated"):
            status += " (simulated rank 0: collectives excluded)"
        tps = _fmt(r.get("tokens_per_s"), ",.0f") if ok else ""
        if ok and r.get("tokens_per_s_each"):
            tps += f" ({min(r['tokens_per_s_each']):,.0f}-{max(r['tokens_per_s_each']):,.0f})"
        lines.append(" | ".join([
            f"| {r['label']}", tps,
            _fmt(r.get("vs_titan_best"), ".3f", "x") if ok else "", _fmt(r.get("vs_titan_bf16"), ".3f", "x") if ok else "",
            _fmt(r.get("step_time_s"), ".3f", " s") if ok else "", _fmt(r.get("mfu_pct"), ".1f", "%") if ok else "",
            _fmt(r.get("peak_memory_gib"), ".1f", " GiB") if ok else "",
            _fmt(r.get("final_loss"), ".3f") if ok else "", status]) + " |")
    ratios = report["ratios"]
    lines += [""]
    if ratios.get("ours_best_vs_titan_best") is not None:
        lines.append(f"Best of ours ({ratios['ours_best']}) against TorchTitan's best ({ratios['titan_best']}): "
                     f"**{ratios['ours_best_vs_titan_best']:.3f}x**; same precision (our best bf16 against "
                     f"TorchTitan bf16): {_fmt(ratios.get('same_precision_bf16'), '.3f', 'x') or 'n/a'}.")
    if report.get("repeat", 1) > 1:
        each = ratios.get("ours_best_vs_titan_best_each")
        lines.append(f"Each run ran {report['repeat']} times, interleaved (every run once, then again): tokens/s is "
                     f"the mean of the repetitions' means, in brackets their min-max"
                     + (f"; best against best per round: {', '.join(f'{x:.3f}x' for x in each)}." if each else "."))
    lines += [
        "Peak memory is as each trainer logs it: TorchTitan's max *reserved*, ours max *allocated*. "
        "Step time for TorchTitan is tokens per step / its tps (it logs no step time). MFU: both count "
        "6 x active non-embedding parameters + 12 x layers x heads x head_dim x seq len.",
        "",
        f"Commands (from the repo root; logs in `{report['out']}/logs/`):",
        "",
        "```bash",
    ]
    for r in report["results"]:
        lines.append(f"# {r['name']}")
        lines.append(r["command"])
    lines += ["```", ""]
    return "\n".join(lines)


def bar_chart(report: dict[str, Any], path: Path) -> str:
    """tokens/s per GPU per run as a horizontal bar chart; returns a note on how (or whether) it was drawn."""
    rows = [(r["label"], r["tokens_per_s"], r["trainer"]) for r in report["results"]
            if r["status"] == "ok" and r.get("tokens_per_s")]
    if not rows:
        return "no measured runs, no chart"
    title = (f"Qwen3 {report['setting']['titan_flavor']}, seq {report['setting']['seq_len']}, "
             f"{report['environment'].get('gpu', '')}:\ntokens/s per GPU")
    colors = {"torchtitan": (128, 128, 128), "ours": (31, 119, 180)}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.5))
        y = list(range(len(rows)))[::-1]
        ax.barh(y, [v for _, v, _ in rows], color=[tuple(c / 255 for c in colors[t]) for *_, t in rows])
        # Variant labels carry their arguments: wrapped, so tight_layout can fit them and the title.
        ax.set_yticks(y, [textwrap.fill(label.replace("`", ""), 44) for label, *_ in rows])
        for yi, (_, v, _) in zip(y, rows):
            ax.text(v, yi, f" {v:,.0f}", va="center")
        ax.set_xlabel("tokens/s per GPU (mean of steps 6-20)")
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0, max(v for _, v, _ in rows) * 1.2)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return "matplotlib"
    except ImportError:
        pass
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return "neither matplotlib nor PIL is installed: no chart"
    width, bar_h, left, top = 900, 28, 330, 40
    img = Image.new("RGB", (width, top + len(rows) * (bar_h + 10) + 20), "white")
    draw = ImageDraw.Draw(img)
    draw.text((10, 10), title, fill="black")
    top_value = max(v for _, v, _ in rows) * 1.15
    for i, (label, v, trainer) in enumerate(rows):
        y0 = top + i * (bar_h + 10)
        x1 = left + int((width - left - 20) * v / top_value)
        draw.text((10, y0 + 8), label.replace("`", ""), fill="black")
        draw.rectangle([left, y0, x1, y0 + bar_h], fill=colors[trainer])
        draw.text((x1 + 4, y0 + 8), f"{v:,.0f}", fill="black")
    img.save(path)
    return "PIL"


def environment() -> dict[str, Any]:
    """Versions and the GPU, without initialising CUDA in this process (the runs need all of it)."""
    env: dict[str, Any] = {"python": sys.version.split()[0]}
    for pkg in ("torch", "triton", "torchtitan", "torchao", "tokenizers", "datasets"):
        try:
            env[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            env[pkg] = "not installed"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()[0]
        env["gpu"], env["driver"] = (x.strip() for x in out.split(","))
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        env["gpu"] = "no GPU found by nvidia-smi"
    if os.environ.get("BENCH_COMMIT"):
        # A copy of the tree on another machine may carry a stale .git (seen on the lent GPU
        # machine): the caller names the commit it sent.
        env["commit"] = os.environ["BENCH_COMMIT"]
        return env
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        env["commit"] = commit + (" (with uncommitted changes)" if dirty else "") if commit else "?"
    except (OSError, subprocess.SubprocessError):
        env["commit"] = "?"
    return env


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=tuple(MODELS), default="qwen3_30b_a3b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--gpus", type=int, default=1, help="GPUs (processes) per run, FSDP over all")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree within --gpus (or --simulate-world)")
    p.add_argument("--simulate-world", type=int, default=0, metavar="N",
                   help="run each trainer as one process acting as rank 0 of N ranks, collectives looped back "
                        "(one rank's compute and memory, no communication; docs/expert_parallel.md); needs --gpus 1")
    p.add_argument("--profile", action="store_true", help="profile steps after the timed ones and write each "
                   "run's GPU time by part (bench.step_breakdown) to <out>/breakdown/ and breakdown.md")
    p.add_argument("--window", default="6-20", help="steps averaged, e.g. 6-20")
    p.add_argument("--out", type=Path, default=None, help="default outputs/compare/<model>_<layers>L")
    p.add_argument("--only", default="", help="comma-separated run names (titan_bf16, titan_fp8, ours_torchtitan, "
                   "ours_grouped_mm, ours_mega, ours_grouped_mm_fp8, ours_mega_fp8); default all")
    p.add_argument("--skip", default="", help="comma-separated run names to leave out")
    p.add_argument("--timeout", type=float, default=240, help="seconds per run")
    p.add_argument("--budget", type=float, default=0, help="seconds for all runs; runs that would start with "
                   "less than 30 s left are reported as not run (0 = no limit)")
    p.add_argument("--load-balance", default="none", choices=("none", "aux_loss", "expert_bias"),
                   help="ours: [moe] load_balance (upstream 0.2.2 does none for Qwen3)")
    p.add_argument("--attention-backend", default="", help="ours: [model] attention_backend (default: the config's)")
    p.add_argument("--ours-args", default="", help="extra arguments for our trainer, one string")
    p.add_argument("--titan-args", default="", help="extra arguments for TorchTitan's trainer, one string")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                   help="an extra run NAME: ours_mega with ARGS added (repeatable), e.g. "
                        "no_copies='--precision.compute_copies false'")
    p.add_argument("--titan-variant", action="append", default=[], metavar="NAME=ARGS",
                   help="an extra run NAME: titan_bf16 with upstream's ARGS added (repeatable), e.g. "
                        "titan_no_ac='--activation_checkpoint.mode none'")
    p.add_argument("--repeat", type=int, default=1, help="run the selected runs this many times, interleaved "
                   "(a, b, a, b, ...); the report gives each run's mean tokens/s with its min-max and the "
                   "best-vs-best ratio of each round (upstream's tokens/s moves a few %% between calls)")
    p.add_argument("--reuse", action="store_true", help="keep the result of a run whose log in --out already "
                   "covers the window with the same command (to split the runs over several calls)")
    p.add_argument("--dry-run", action="store_true", help="write the TOML and data, print the commands, run nothing")
    p.add_argument("--write-tokenizer", action="store_true",
                   help="(re)write assets/tokenizer/tokenizer.json + tokenizer_config.json and exit")
    args = p.parse_args(argv)
    if args.model not in MODELS:
        p.error(f"unknown model {args.model}")
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat} must be >= 1")
    if args.simulate_world:
        if args.simulate_world < 2 or args.gpus != 1:
            p.error(f"--simulate-world {args.simulate_world} needs N >= 2 and --gpus 1 (one process per run)")
        if args.ep < 1 or args.simulate_world % args.ep:
            p.error(f"--ep {args.ep} must be >= 1 and divide --simulate-world {args.simulate_world}")
    elif args.gpus < 1 or args.ep < 1 or args.gpus % args.ep:
        p.error(f"--ep {args.ep} must be >= 1 and divide --gpus {args.gpus}")
    return args


def display(cmd: list[str]) -> str:
    """A run's command as a person would type it from the repo root (``python``, relative paths)."""
    parts = ["python" if c == sys.executable else c for c in cmd]
    return shlex.join(parts).replace(str(ROOT) + os.sep, "")


def write_report(report: dict[str, Any], out: Path, chart: bool) -> str:
    report["ratios"] = add_ratios(report["results"])
    (out / "compare.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "compare.md").write_text(markdown(report), encoding="utf-8")
    return bar_chart(report, out / "compare.png") if chart else "no chart"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.write_tokenizer:
        for path in write_tokenizer():
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    lo, hi = (int(x) for x in args.window.split("-"))
    out = (args.out or ROOT / "outputs" / "compare" / f"{args.model}_{args.layers}L"
           f"{f'_{args.gpus}gpu_ep{args.ep}' if args.gpus > 1 else ''}"
           f"{f'_sim{args.simulate_world}_ep{args.ep}' if args.simulate_world else ''}").resolve()
    setting = Setting(args.model, args.layers, args.seq_len, args.steps, out, args.load_balance,
                      args.attention_backend, (lo, hi), args.gpus, args.ep, args.profile, args.simulate_world)
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        write_tokenizer()
    data_dir = write_jsonl_data(out / "data")
    toml_path = out / "torchtitan.toml"
    toml_path.write_text(torchtitan_toml(setting, data_dir=data_dir), encoding="utf-8")
    try:
        variants = [parse_variant(v) for v in args.variant]
        titan_variants = [parse_variant(v, "--titan-variant") for v in args.titan_variant]
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    runs = plan(setting, toml_path=toml_path, data_dir=data_dir, ours_extra=shlex.split(args.ours_args),
                titan_extra=shlex.split(args.titan_args), variants=variants, titan_variants=titan_variants)
    known = [r.name for r in runs]
    if len(set(known)) != len(known):
        print(f"--variant names must differ from each other and from the runs {', '.join(known[:7])}", file=sys.stderr)
        return 2
    only, skip = ({x for x in v.split(",") if x} for v in (args.only, args.skip))
    if unknown := (only | skip) - set(known):
        print(f"unknown run names: {', '.join(sorted(unknown))}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    runs = [r for r in runs if (not only or r.name in only) and r.name not in skip]

    env = run_env()
    from models.qwen3.args import get_model_args
    from models.qwen3.model import count_params

    total, active = count_params(get_model_args(args.model, n_layers=args.layers))
    command = "python -m bench.compare " + shlex.join(argv)
    report: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command, "out": display([str(out)]),
        "setting": {**dataclasses.asdict(setting), "out": str(out), "titan_flavor": setting.titan_flavor,
                    "rope_theta": setting.rope_theta},
        "params": {"total": total, "active": active},
        "environment": environment(), "results": [],
    }
    print(f"{command}\nout: {out}\nTorchTitan config: {toml_path}", flush=True)
    if not args.dry_run and any(r.trainer == "torchtitan" and not r.skip for r in runs):
        why = preflight(env)
        for r in runs:
            if r.trainer == "torchtitan" and not r.skip:
                r.skip = why["titan"] or (why["titan_fp8"] if r.precision == "fp8" else "")
    deadline = time.monotonic() + args.budget if args.budget else None
    report["repeat"] = args.repeat
    reps: dict[str, list[dict[str, Any]]] = {run.name: [] for run in runs}
    for i, run in ((i, run) for i in range(args.repeat) for run in runs):
        entry: dict[str, Any] = {"name": run.name, "label": run.label, "trainer": run.trainer,
                                 "precision": run.precision, "command": display(run.cmd), "skip": run.skip}
        reps[run.name].append(entry)
        report["results"] = [combine_repeats(e) for e in reps.values() if e]
        log_path = out / "logs" / (f"{run.name}.log" if i == 0 else f"{run.name}.rep{i + 1}.log")
        if args.reuse and log_path.is_file():
            text = log_path.read_text(encoding="utf-8", errors="replace")
            summary = summarize_log(text, args.seq_len, (lo, hi))
            if summary.get("steps_logged") and not summary.get("window_note") and text.startswith("$ " + shlex.join(run.cmd)):
                entry.update(summary, log=display([str(log_path)]), status="ok", reused=True, skip="")
                print(f"[{run.name}] reused {log_path}: {summary['tokens_per_s']:,.0f} tokens/s", flush=True)
                continue
        left = deadline - time.monotonic() if deadline else args.timeout
        if run.skip or args.dry_run or left < 30:
            entry["status"] = "skipped" if run.skip else "dry run" if args.dry_run else "not run"
            if left < 30 and not run.skip and not args.dry_run:
                entry["skip"] = "--budget spent"
            print(f"[{run.name}] {entry['status']}{': ' + entry['skip'] if entry['skip'] else ''}\n  "
                  f"{entry['command']}", flush=True)
            continue
        timeout = min(args.timeout, left)
        print(f"[{run.name}] running (timeout {timeout:.0f}s), log {log_path}", flush=True)
        info = run_one(run, log_path, timeout, env)
        text = log_path.read_text(encoding="utf-8", errors="replace")
        summary = summarize_log(text, args.seq_len, (lo, hi))
        entry.update(info, **summary, log=display([str(log_path)]), status=status_of(info, text, summary))
        if entry["status"] != "ok":
            entry["reason"] = failure_reason(text)
            entry["log_tail"] = text.splitlines()[-15:]
        if setting.profile and i == 0:  # one profile per run: the first repetition's
            entry.update(profile_breakdown(setting, run, out))
        print(f"[{run.name}] {entry['status']} in {info['wall_s']}s"
              + (f": {summary['tokens_per_s']:,.0f} tokens/s, {summary['step_time_s']:.3f} s/step, "
                 f"loss {summary['final_loss']}" if entry["status"] == "ok" else f": {entry['reason']}"), flush=True)
        report["results"] = [combine_repeats(e) for e in reps.values() if e]
        write_report(report, out, chart=False)  # partial results survive a run that kills us

    report["results"] = [combine_repeats(e) for e in reps.values() if e]
    chart = write_report(report, out, chart=not args.dry_run)
    print(markdown(report))
    if table := breakdown_table(report["results"]):
        (out / "breakdown.md").write_text(table + "\n", encoding="utf-8")
        print(f"\nGPU time by part (bench.step_breakdown of the profiled steps):\n{table}")
    print(f"wrote {out / 'compare.json'}, {out / 'compare.md'}; chart: {chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
