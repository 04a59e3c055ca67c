"""Export a training checkpoint (DCP) as a Hugging Face Qwen3-MoE folder (safetensors + config.json)
that ``transformers.AutoModelForCausalLM.from_pretrained`` and this trainer's
``[checkpoint] initial_load_path`` both read.

    python scripts/export_hf.py --checkpoint outputs/debug/checkpoint/step-100 --out exported/ \
        --config train_configs/debug_model.toml [--dtype bfloat16] [--section.key value ...]

The model's shape comes from the config (``[model] flavor``, ``n_layers``, ``rope_theta``) and must
match the checkpoint's ``model.json``. Runs in one process on CPU: the whole model must fit in RAM.
The tokenizer is not copied; put tokenizer.json (and tokenizer_config.json) beside the weights if
the folder is to be used with transformers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict  # noqa: E402

from components.checkpoint import model_identity  # noqa: E402
from components.config import parse_args  # noqa: E402
from components.hf_checkpoint import save_hf_weights  # noqa: E402
from models.qwen3.args import get_model_args  # noqa: E402
from models.qwen3.model import Qwen3MoE  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def export(checkpoint: str | Path, out: str | Path, config_args: list[str], dtype: torch.dtype) -> list[Path]:
    cfg = parse_args(config_args)
    m = cfg.model
    args = get_model_args(m.flavor, n_layers=m.n_layers, rope_theta=m.rope_theta)
    checkpoint = Path(checkpoint)
    if not (checkpoint / ".metadata").is_file():
        raise SystemExit(f"{checkpoint} is not a DCP checkpoint folder (no .metadata); pass a step-<N> folder")
    identity = model_identity(args, m.flavor)
    if (checkpoint / "model.json").is_file():
        saved = json.loads((checkpoint / "model.json").read_text())
        if saved != identity:
            diff = ", ".join(f"{k} saved {saved.get(k)!r} vs configured {identity.get(k)!r}"
                             for k in sorted(set(saved) | set(identity)) if saved.get(k) != identity.get(k))
            raise SystemExit(f"{checkpoint} is of another model: {diff}; pass the config it was trained with")
    model = Qwen3MoE(args, moe_backend="torch", use_expert_bias=cfg.moe.load_balance == "expert_bias")
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(checkpoint))  # reads the model's entries only
    set_model_state_dict(model, state["model"])
    return save_hf_weights(model, out, dtype=dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a step-<N> checkpoint folder")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="dtype of the exported weights")
    args, rest = parser.parse_known_args(argv)
    paths = export(args.checkpoint, args.out, rest, DTYPES[args.dtype])
    print(f"wrote {len(paths)} safetensors shard(s), model.safetensors.index.json and config.json to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
