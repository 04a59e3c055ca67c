"""Hugging Face interop: Qwen3-MoE weights as released (safetensors) <-> this project's model.

    config = read_hf_config("Qwen3-30B-A3B")                  # the folder's config.json
    check_hf_config(config, model.args, where="...")          # refuses another shape, naming the field
    load_hf_weights(model, "Qwen3-30B-A3B")                   # any parallel layout (FSDP / EP DTensors)
    save_hf_weights(model, "exported/", dtype=torch.bfloat16) # safetensors shards + index + config.json

Key layout (``i`` layer, ``j`` expert; HF Linear weights are (out, in), as are ours):

    HF (released / ``save_pretrained``)                 this project (TorchTitan layout)
    model.embed_tokens.weight                          tok_embeddings.weight
    model.layers.i.input_layernorm.weight              layers.i.attention_norm.weight
    model.layers.i.self_attn.{q,k,v,o}_proj.weight     layers.i.attention.w{q,k,v,o}.weight
    model.layers.i.self_attn.{q,k}_norm.weight         layers.i.attention.{q,k}_norm.weight
    model.layers.i.post_attention_layernorm.weight     layers.i.ffn_norm.weight
    model.layers.i.mlp.gate.weight            (E, D)   layers.i.moe.router.gate.weight
    model.layers.i.mlp.experts.j.gate_proj.weight (F, D)  layers.i.moe.experts.w1[j]   w1: (E, F, D)
    model.layers.i.mlp.experts.j.up_proj.weight   (F, D)  layers.i.moe.experts.w3[j]   w3: (E, F, D)
    model.layers.i.mlp.experts.j.down_proj.weight (D, F)  layers.i.moe.experts.w2[j]   w2: (E, D, F)
    model.norm.weight                                  norm.weight
    lm_head.weight                                     output.weight

Recent ``transformers`` versions hold the experts fused in memory (``mlp.experts.gate_up_proj``
(E, 2F, D), gate rows first, and ``mlp.experts.down_proj`` (E, D, F)) but write the per-expert
layout above; the loader accepts both, the exporter writes the per-expert one. The expert-bias
buffer of ``[moe] load_balance = "expert_bias"`` has no HF counterpart: it starts at zero on import
and is not exported.

Loading materialises the full state dict on CPU (on rank 0 only when distributed, then broadcast
and sharded by ``set_model_state_dict``), so the host of rank 0 needs the checkpoint's size in RAM.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from models.qwen3.args import Qwen3MoEArgs

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_LAYER_KEYS = {  # HF suffix under model.layers.i. -> ours under layers.i.
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "mlp.gate.weight": "moe.router.gate.weight",
}
_TOP_KEYS = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
             "lm_head.weight": "output.weight"}
_EXPERT_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class HFCheckpointError(RuntimeError):
    """A Hugging Face checkpoint that cannot be loaded into this model; the message says why."""


# --- config.json ---------------------------------------------------------------------------------


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise HFCheckpointError(f"{path} not found: a Hugging Face model folder holds config.json and "
                                f"*.safetensors ([checkpoint] initial_load_path)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{path} is not valid JSON: {e}") from None


def _rope_theta(config: dict[str, Any]) -> float:
    if "rope_theta" in config:
        return float(config["rope_theta"])
    # transformers >= 5 writes the RoPE settings as a group.
    return float((config.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def _num_experts(config: dict[str, Any]) -> int:
    return int(config["num_experts"] if "num_experts" in config else config["num_local_experts"])


def hf_config_to_args(config: dict[str, Any], max_seq_len: int | None = None) -> Qwen3MoEArgs:
    """Our model args for a Qwen3-MoE ``config.json`` (a HF model of any size, e.g. a test's)."""
    _check_supported(config, "config.json")
    return Qwen3MoEArgs(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
        n_kv_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        vocab_size=config["vocab_size"], moe_inter_dim=config["moe_intermediate_size"],
        num_experts=_num_experts(config), top_k=config["num_experts_per_tok"],
        norm_topk_prob=bool(config.get("norm_topk_prob", False)), norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(config), max_seq_len=max_seq_len or int(config.get("max_position_embeddings", 40960)))


def _check_supported(config: dict[str, Any], where: str) -> None:
    """Features of the HF Qwen3-MoE class that this model does not have."""
    problems = []
    if config.get("model_type", "qwen3_moe") != "qwen3_moe":
        problems.append(f"model_type is {config.get('model_type')!r}, not 'qwen3_moe'")
    if config.get("mlp_only_layers"):
        problems.append(f"mlp_only_layers = {config['mlp_only_layers']} (dense layers; every layer here is MoE)")
    if config.get("decoder_sparse_step", 1) != 1:
        problems.append(f"decoder_sparse_step = {config['decoder_sparse_step']} (must be 1: every layer MoE)")
    if config.get("attention_bias", False):
        problems.append("attention_bias = true (this model's attention has no biases)")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {config['hidden_act']!r} (experts here are SwiGLU with silu)")
    if config.get("use_sliding_window", False):
        problems.append("use_sliding_window = true (attention here is full causal)")
    if problems:
        raise HFCheckpointError(f"{where}: not loadable into this Qwen3-MoE: " + "; ".join(problems))


def check_hf_config(config: dict[str, Any], args: Qwen3MoEArgs, where: str) -> None:
    """Refuse a HF config whose shape differs from ``args`` (the configured flavor and n_layers),
    naming every differing field."""
    _check_supported(config, where)
    theirs = hf_config_to_args(config, max_seq_len=args.max_seq_len)
    names = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
             "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "vocab_size": "vocab_size",
             "moe_inter_dim": "moe_intermediate_size", "num_experts": "num_experts", "top_k": "num_experts_per_tok",
             "norm_topk_prob": "norm_topk_prob", "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta"}
    diffs = [f"{hf} = {getattr(theirs, ours)!r} vs {ours} = {getattr(args, ours)!r}"
             for ours, hf in names.items() if getattr(theirs, ours) != getattr(args, ours)]
    if diffs:
        raise HFCheckpointError(
            f"{where} describes another model than the one configured: " + ", ".join(diffs) +
            " (HF name = its value vs this run's model args = value); choose the matching [model] flavor, "
            "n_layers and rope_theta")


def args_to_hf_config(args: Qwen3MoEArgs, dtype: torch.dtype) -> dict[str, Any]:
    """A ``config.json`` for ``Qwen3MoeForCausalLM`` with this model's shape."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim, "vocab_size": args.vocab_size,
        "moe_intermediate_size": args.moe_inter_dim, "num_experts": args.num_experts,
        "num_experts_per_tok": args.top_k, "norm_topk_prob": args.norm_topk_prob, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "max_position_embeddings": args.max_seq_len,
        # No dense MLP layers exist; intermediate_size is required by the HF class but unused.
        "intermediate_size": args.moe_inter_dim * args.top_k, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "use_sliding_window": False, "sliding_window": None, "output_router_logits": False,
        "router_aux_loss_coef": 0.001, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


# --- key and layout conversion -------------------------------------------------------------------


def hf_to_titan(hf_sd: dict[str, torch.Tensor], args: Qwen3MoEArgs, where: str = "checkpoint"
                ) -> dict[str, torch.Tensor]:
    """HF names and per-expert (or fused) tensors -> our full state dict (experts stacked)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    unexpected = []
    E, F = args.num_experts, args.moe_inter_dim
    for key, t in hf_sd.items():
        if key in _TOP_KEYS:
            out[_TOP_KEYS[key]] = t
        elif m := _EXPERT_KEY.match(key):
            layer, j, proj = int(m.group(1)), int(m.group(2)), m.group(3)
            experts.setdefault((layer, _EXPERT_PROJ[proj]), {})[j] = t
        elif m := _FUSED_KEY.match(key):
            prefix = f"layers.{m.group(1)}.moe.experts."
            if m.group(2) == "gate_up_proj":  # (E, 2F, D): the gate's F rows, then the up projection's
                out[prefix + "w1"], out[prefix + "w3"] = t[:, :F], t[:, F:]
            else:
                out[prefix + "w2"] = t
        elif (m := _LAYER_KEY.match(key)) and m.group(2) in _LAYER_KEYS:
            out[f"layers.{m.group(1)}.{_LAYER_KEYS[m.group(2)]}"] = t
        else:
            unexpected.append(key)
    if unexpected:
        raise HFCheckpointError(f"{where}: tensors this Qwen3-MoE has no place for: {', '.join(sorted(unexpected)[:8])}"
                                + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""))
    hf_proj = {v: k for k, v in _EXPERT_PROJ.items()}
    for (layer, name), per_expert in sorted(experts.items()):
        missing = sorted(set(range(E)) - set(per_expert))
        if missing:
            raise HFCheckpointError(f"{where}: layer {layer} {hf_proj[name]} ({name}): experts {missing[:8]} are missing "
                                    f"(the model has {E} experts)")
        out[f"layers.{layer}.moe.experts.{name}"] = torch.stack([per_expert[j] for j in range(E)])
    if "output.weight" not in out and "tok_embeddings.weight" in out:  # a tied checkpoint
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def titan_to_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our full state dict -> HF names, experts split per expert (the released layout)."""
    top = {v: k for k, v in _TOP_KEYS.items()}
    layer_keys = {v: k for k, v in _LAYER_KEYS.items()}
    proj = {v: k for k, v in _EXPERT_PROJ.items()}
    out = {}
    for key, t in sd.items():
        if key in top:
            out[top[key]] = t
            continue
        _, layer, rest = key.split(".", 2)
        if rest in layer_keys:
            out[f"model.layers.{layer}.{layer_keys[rest]}"] = t
        elif rest.startswith("moe.experts.") and rest[len("moe.experts."):] in proj:
            name = proj[rest[len("moe.experts."):]]
            for j in range(t.shape[0]):
                out[f"model.layers.{layer}.mlp.experts.{j}.{name}.weight"] = t[j]
        elif rest == "moe.router.expert_bias":
            continue  # no HF counterpart
        else:
            raise HFCheckpointError(f"no Hugging Face name for parameter {key!r}")
    return out


# --- files ---------------------------------------------------------------------------------------


def read_hf_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a HF model folder: ``model.safetensors.index.json`` + its shards, or a single
    ``model.safetensors``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    if not folder.is_dir():
        raise HFCheckpointError(f"Hugging Face model folder not found: {folder} ([checkpoint] initial_load_path)")
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise HFCheckpointError(f"{index} is not a safetensors index (no weight_map): {e}") from None
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE_FILE).is_file():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise HFCheckpointError(f"{folder} holds neither {INDEX_FILE} nor {SINGLE_FILE}")
    sd: dict[str, torch.Tensor] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise HFCheckpointError(f"{path}, listed in {INDEX_FILE}, is missing")
        try:
            sd.update(load_file(str(path)))
        except (SafetensorError, OSError) as e:
            raise HFCheckpointError(f"{path} is not a readable safetensors file: {e}") from None
    if weight_map is not None and set(weight_map) != set(sd):
        missing = sorted(set(weight_map) - set(sd))[:5]
        raise HFCheckpointError(f"{index}: tensors listed but not found in the shards: {missing}")
    return sd


def _is_main() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


@torch.no_grad()
def load_hf_weights(model: nn.Module, folder: str | Path) -> None:
    """Load a HF Qwen3-MoE folder into ``model`` (plain, FSDP- or EP-sharded). Checks the folder's
    config.json against ``model.args`` first. Collective when distributed: call on every rank."""
    folder = Path(folder)
    args: Qwen3MoEArgs = model.args
    check_hf_config(read_hf_config(folder), args, where=str(folder / "config.json"))
    distributed = torch.distributed.is_initialized()
    full: dict[str, torch.Tensor] = {}
    error = None
    if _is_main():
        try:
            full = _read_full_state(model, folder, args)
        except HFCheckpointError as e:
            error = str(e)
    if distributed:  # every rank raises, rather than the others waiting for rank 0's broadcast
        box = [error]
        torch.distributed.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise HFCheckpointError(error)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                               broadcast_from_rank0=distributed))


def _read_full_state(model: nn.Module, folder: Path, args: Qwen3MoEArgs) -> dict[str, torch.Tensor]:
    full = hf_to_titan(read_hf_state_dict(folder), args, where=str(folder))
    # The model's own state dict names every tensor it needs (shapes global, nothing gathered).
    expected = _model_keys_and_dtypes(model)
    for key in expected:
        if key not in full and key.endswith("moe.router.expert_bias"):
            full[key] = torch.zeros(args.num_experts, dtype=torch.float32)
    missing = sorted(set(expected) - set(full))
    if missing:
        raise HFCheckpointError(f"{folder}: tensors missing for {', '.join(missing[:8])}"
                                + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    for key, (shape, dtype) in expected.items():
        if tuple(full[key].shape) != shape:
            raise HFCheckpointError(f"{folder}: {key} has shape {tuple(full[key].shape)}, the model needs {shape}")
        full[key] = full[key].to(dtype)  # e.g. released bf16 -> float32 master weights
    return full


def _model_keys_and_dtypes(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Full (unsharded) shape and dtype of every state-dict entry, without gathering anything."""
    out = {}
    for key, t in model.state_dict().items():
        shape = tuple(t.shape)  # a DTensor reports its global shape
        out[key.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")] = (shape, t.dtype)
    return out


@torch.no_grad()
def save_hf_weights(model: nn.Module, folder: str | Path, dtype: torch.dtype = torch.bfloat16,
                    max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write ``model`` as a HF Qwen3-MoE folder: ``model-0000i-of-0000n.safetensors`` shards,
    ``model.safetensors.index.json`` and ``config.json``. Collective when distributed (the full
    state dict is gathered to rank 0 on CPU, which writes); returns the shard paths on rank 0."""
    from safetensors.torch import save_file

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not _is_main():
        return []
    hf = {k: v.to(dtype).contiguous() for k, v in titan_to_hf(sd).items()}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(hf, key=_hf_sort_key):  # layer by layer, so a shard holds whole layers where it can
        nbytes = hf[key].numel() * hf[key].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = hf[key]
        size += nbytes
    n = len(shards)
    weight_map, paths = {}, []
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        paths.append(folder / name)
    total = sum(t.numel() * t.element_size() for t in hf.values())
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2, sort_keys=True))
    (folder / "config.json").write_text(json.dumps(args_to_hf_config(model.args, dtype), indent=2))
    return paths


def _hf_sort_key(key: str) -> tuple:
    m = re.match(r"model\.layers\.(\d+)\.(.*)", key)
    if m:
        expert = re.match(r"mlp\.experts\.(\d+)\.(.*)", m.group(2))
        return (1, int(m.group(1)), (int(expert.group(1)), expert.group(2)) if expert else (-1, m.group(2)))
    return (0 if "embed" in key else 2, 0, (0, key))
