"""Export a training checkpoint (DCP) as a Hugging Face Qwen3-MoE folder (safetensors + config.json)
that ``transformers.AutoModelForCausalLM.from_pretrained`` and this trainer's
``[checkpoint] initial_load_path`` both read.

    python scripts/export_hf.py --checkpoint outputs/debug/checkpoint/step-100 --out exported/ \
        --config train_configs/debug_model.toml [--dtype bfloat16] [--overwrite] [--section.key value ...]

    torchrun --nproc_per_node 8 scripts/export_hf.py ... --parallelism.expert_parallel_degree 8

The model's shape comes from the config (``[model] flavor``, ``n_layers``, ``rope_theta``) and must
match the checkpoint's ``model.json``. In one process the whole model is held in RAM. Under
torchrun (on CPU, over gloo) the model is sharded by the config's ``[parallelism]`` degrees (any
layout: DCP reshards the checkpoint), each rank reads and writes only its shards, and the ranks
then assemble the output files together, so each holds about 1/world of the model; the output
folder must be on a filesystem every rank sees. An output folder that already holds files is
refused unless ``--overwrite`` is given (which replaces the previous export's safetensors, index
and config.json, and keeps other files such as a tokenizer). The tokenizer is not copied; put
tokenizer.json (and tokenizer_config.json) beside the weights if the folder is to be used with
transformers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict  # noqa: E402

from components.checkpoint import CheckpointError, check_identity, model_identity  # noqa: E402
from components.config import ConfigError, parse_args  # noqa: E402
from components.dcp_utils import quiet_single_process_dcp  # noqa: E402
from components.hf_checkpoint import INDEX_FILE, HFCheckpointError, save_hf_weights  # noqa: E402
from models.qwen3.args import get_model_args  # noqa: E402
from models.qwen3.model import Qwen3MoE  # noqa: E402
from parallelisms.parallel_dims import build_parallel_dims  # noqa: E402
from parallelisms.utils import init_distributed  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class ExportError(ValueError):
    """An export that cannot be done as asked; the message says why and what to pass instead."""


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file, not a folder; pass a folder to write the export into")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"--out {out} already holds files; pass --overwrite to replace the export in it, "
                          f"or choose an empty or new folder")


def _remove_previous_export(out: Path) -> None:
    """What an export writes (an interrupted one's sharded/ included); other files stay."""
    for path in [*out.glob("*.safetensors"), out / INDEX_FILE, out / "config.json"]:
        path.unlink(missing_ok=True)
    shutil.rmtree(out / "sharded", ignore_errors=True)


def export(checkpoint: str | Path, out: str | Path, config_args: list[str], dtype: torch.dtype,
           overwrite: bool = False) -> list[Path]:
    cfg = parse_args(config_args)
    m = cfg.model
    args = get_model_args(m.flavor, n_layers=m.n_layers, rope_theta=m.rope_theta)
    checkpoint, out = Path(checkpoint), Path(out)
    if not (checkpoint / ".metadata").is_file():
        raise ExportError(f"{checkpoint} is not a DCP checkpoint folder (no .metadata); pass a step-<N> folder")
    if (checkpoint / "model.json").is_file():
        check_identity(checkpoint, model_identity(args, m.flavor), "pass the config it was trained with")
    _check_out(out, overwrite)
    world = init_distributed("cpu")
    distributed = torch.distributed.is_initialized()
    dims = build_parallel_dims(cfg.parallelism, world, args.num_experts) if distributed else None
    with torch.device("meta"):
        model = Qwen3MoE(args, moe_backend="torch", use_expert_bias=cfg.moe.load_balance == "expert_bias")
    if distributed:
        from parallelisms.expert_parallel import apply_ep
        from parallelisms.fsdp import apply_fsdp

        if dims.ep_enabled:
            apply_ep(model, dims.mesh, cfg.parallelism.expert_capacity_factor, torch.float32)
        apply_fsdp(model, dims, cfg.parallelism, "float32")
    model.to_empty(device="cpu")
    state = {"model": get_model_state_dict(model)}
    with quiet_single_process_dcp():
        dcp.load(state, checkpoint_id=str(checkpoint))  # reads the model's entries only (this rank's shards)
    set_model_state_dict(model, state["model"])
    if overwrite and out.is_dir() and (not distributed or torch.distributed.get_rank() == 0):
        _remove_previous_export(out)
    if distributed:
        torch.distributed.barrier()
    return save_hf_weights(model, out, dtype=dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a step-<N> checkpoint folder")
    parser.add_argument("--out", required=True, help="output folder (new or empty, unless --overwrite)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="dtype of the exported weights")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the export already in --out (its safetensors, index and config.json)")
    args, rest = parser.parse_known_args(argv)
    try:
        paths = export(args.checkpoint, args.out, rest, DTYPES[args.dtype], overwrite=args.overwrite)
    except (ExportError, CheckpointError, ConfigError, HFCheckpointError) as e:
        # Under torchrun every rank finds the same problem; rank 0 alone says it.
        raise SystemExit(f"error: {e}" if os.environ.get("RANK", "0") == "0" else 1) from None
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"wrote {len(paths)} safetensors shard(s), model.safetensors.index.json and config.json to {args.out}")
    return 0


if __name__ == "__main__":
    try:
        code = main()
    finally:
        # Destroy the process group while the interpreter is whole (see tests/multiprocess.py).
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    sys.exit(code)
