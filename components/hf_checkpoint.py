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

Loading and saving go through torch's distributed-checkpoint Hugging Face storage
(``HuggingFaceStorageReader`` / ``HuggingFaceStorageWriter``): each rank reads from the safetensors
files only the slices of its own FSDP / EP shards, straight into its parameters, and on export
writes only its shards (then every rank assembles some of the output files). Per-expert HF tensors
map onto rows of our stacked (E, ...) expert weights: each rank names the experts it holds, one
view of its local shard per expert. No rank holds the whole model. A folder in the fused in-memory
layout (``gate_up_proj``) is read whole on rank 0 and broadcast instead: released checkpoints never
use it.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from components.dcp_utils import is_main, quiet_single_process_dcp
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


def _hf_name(key: str) -> str | None:
    """The HF name of our state-dict entry ``key``; for stacked experts a template with ``{j}`` for
    the expert; None for the expert-bias buffer (no HF counterpart)."""
    top = {v: k for k, v in _TOP_KEYS.items()}
    if key in top:
        return top[key]
    layer_keys = {v: k for k, v in _LAYER_KEYS.items()}
    proj = {v: k for k, v in _EXPERT_PROJ.items()}
    _, layer, rest = key.split(".", 2)
    if rest in layer_keys:
        return f"model.layers.{layer}.{layer_keys[rest]}"
    if rest.startswith("moe.experts.") and rest[len("moe.experts."):] in proj:
        return f"model.layers.{layer}.mlp.experts.{{j}}.{proj[rest[len('moe.experts.'):]]}.weight"
    if rest == "moe.router.expert_bias":
        return None
    raise HFCheckpointError(f"no Hugging Face name for parameter {key!r}")


def titan_to_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our full state dict -> HF names, experts split per expert (the released layout)."""
    out = {}
    for key, t in sd.items():
        name = _hf_name(key)
        if name is None:
            continue
        if "{j}" in name:
            for j in range(t.shape[0]):
                out[name.format(j=j)] = t[j]
        else:
            out[name] = t
    return out


# --- files ---------------------------------------------------------------------------------------


def _weight_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a HF model folder (``model.safetensors.index.json``'s shards, or a
    single ``model.safetensors``) and the index's weight map (None without an index)."""
    if not folder.is_dir():
        raise HFCheckpointError(f"Hugging Face model folder not found: {folder} ([checkpoint] initial_load_path)")
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise HFCheckpointError(f"{index} is not a safetensors index (no weight_map): {e}") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
    elif (folder / SINGLE_FILE).is_file():
        weight_map, files = None, [folder / SINGLE_FILE]
    else:
        raise HFCheckpointError(f"{folder} holds neither {INDEX_FILE} nor {SINGLE_FILE}")
    for path in files:
        if not path.is_file():
            raise HFCheckpointError(f"{path}, listed in {INDEX_FILE}, is missing")
    return files, weight_map


def read_hf_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a HF model folder: ``model.safetensors.index.json`` + its shards, or a single
    ``model.safetensors``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    files, weight_map = _weight_files(folder)
    sd: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            sd.update(load_file(str(path)))
        except (SafetensorError, OSError) as e:
            raise HFCheckpointError(f"{path} is not a readable safetensors file: {e}") from None
    if weight_map is not None and set(weight_map) != set(sd):
        missing = sorted(set(weight_map) - set(sd))[:5]
        raise HFCheckpointError(f"{folder / INDEX_FILE}: tensors listed but not found in the shards: {missing}")
    return sd


def read_hf_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of a HF model folder, from the safetensors headers alone."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    files, weight_map = _weight_files(folder)
    # The storage reader reads every *.safetensors file in the folder, listed or not.
    stray = sorted(p.name for p in folder.glob("*.safetensors") if p not in files)
    if stray:
        raise HFCheckpointError(f"{folder}: {', '.join(stray[:4])} not part of the model (not in {INDEX_FILE}); "
                                f"move them out of the folder")
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if key in shapes:
                        raise HFCheckpointError(f"{folder}: tensor {key} is stored twice (again in {path.name})")
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        except (SafetensorError, OSError) as e:
            raise HFCheckpointError(f"{path} is not a readable safetensors file: {e}") from None
    if weight_map is not None and not set(weight_map) <= set(shapes):
        missing = sorted(set(weight_map) - set(shapes))[:5]
        raise HFCheckpointError(f"{folder / INDEX_FILE}: tensors listed but not found in the shards: {missing}")
    return shapes


def _expert_views(t: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(expert j, destination) for each expert of the stacked expert weight ``t`` (E, X, Y) that
    this rank holds rows of: views of the local shard, as DTensors of the global (X, Y) where the
    rank holds part of an expert's matrix (expert-FSDP under EP shards dim 1)."""
    if not isinstance(t, DTensor):
        return [(j, t[j]) for j in range(t.shape[0])]
    local = t.to_local()
    [chunk] = t.__create_chunk_list__()  # this rank's block of the global tensor, as DCP sees it
    whole = tuple(chunk.sizes[1:]) == tuple(t.shape[1:])
    # Mesh dims that split the experts hand each rank other keys; for one expert's matrix they repeat.
    placements = [Replicate() if isinstance(p, Shard) and p.dim == 0 else Shard(p.dim - 1) if isinstance(p, Shard)
                  else p for p in t.placements]
    shape = torch.Size(t.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    views = []
    for k in range(chunk.sizes[0]):
        view = local[k]
        if not whole:
            view = DTensor.from_local(view, t.device_mesh, placements, run_check=False, shape=shape, stride=stride)
        views.append((chunk.offsets[0] + k, view))
    return views


@torch.no_grad()
def load_hf_weights(model: nn.Module, folder: str | Path) -> None:
    """Load a HF Qwen3-MoE folder into ``model`` (plain, FSDP- or EP-sharded). Checks the folder's
    config.json against ``model.args`` and the tensors' names and shapes against the model first.
    Each rank reads only the slices of its own shards. Collective when distributed: call on every rank."""
    folder = Path(folder)
    args: Qwen3MoEArgs = model.args
    check_hf_config(read_hf_config(folder), args, where=str(folder / "config.json"))
    shapes = read_hf_shapes(folder)  # every rank reads the same headers, so every rank raises alike
    if any(_FUSED_KEY.match(k) for k in shapes):
        _load_through_rank0(model, folder, args)
        return
    meta = {k: torch.empty(shape, device="meta") for k, shape in shapes.items()}
    _check_against_model(hf_to_titan(meta, args, where=str(folder)), model, folder, args)
    targets: dict[str, torch.Tensor] = {}
    tied = None
    for key, t in get_model_state_dict(model).items():
        name = _hf_name(key)
        if name is None:  # the expert-bias buffer has no HF counterpart: it starts at zero
            (t.to_local() if isinstance(t, DTensor) else t).zero_()
        elif "{j}" in name:
            targets.update((name.format(j=j), view) for j, view in _expert_views(t))
        elif name == "lm_head.weight" and name not in shapes:
            tied = t
        else:
            targets[name] = t
    with quiet_single_process_dcp():
        dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(folder)))
        if tied is not None:  # a tied checkpoint: the output projection is the embedding
            dcp.load({"model.embed_tokens.weight": tied}, storage_reader=HuggingFaceStorageReader(str(folder)))


def _load_through_rank0(model: nn.Module, folder: Path, args: Qwen3MoEArgs) -> None:
    """Rank 0 reads the whole folder and the weights are broadcast and sharded (the fused layout)."""
    distributed = torch.distributed.is_initialized()
    full: dict[str, torch.Tensor] = {}
    error = None
    if is_main():
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
    expected = _check_against_model(full, model, folder, args)
    for key, (_, dtype) in expected.items():
        full[key] = full[key].to(dtype)  # e.g. released bf16 -> float32 master weights
    return full


def _check_against_model(full: dict[str, torch.Tensor], model: nn.Module, folder: Path, args: Qwen3MoEArgs
                         ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Refuse tensors the model lacks, misses or holds in another shape (``full``: our names, any
    device, meta included); adds the zero expert bias. Returns the model's shapes and dtypes."""
    # The model's own state dict names every tensor it needs (shapes global, nothing gathered).
    expected = _model_keys_and_dtypes(model)
    for key in expected:
        if key not in full and key.endswith("moe.router.expert_bias"):
            full[key] = torch.zeros(args.num_experts, dtype=torch.float32)
    missing = sorted(set(expected) - set(full))
    if missing:
        raise HFCheckpointError(f"{folder}: tensors missing for {', '.join(missing[:8])}"
                                + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    extra = sorted(set(full) - set(expected))
    if extra:
        raise HFCheckpointError(f"{folder}: tensors this model has no place for (as {', '.join(extra[:8])})"
                                + (f" and {len(extra) - 8} more" if len(extra) > 8 else ""))
    for key, (shape, _) in expected.items():
        if tuple(full[key].shape) != shape:
            raise HFCheckpointError(f"{folder}: {key} has shape {tuple(full[key].shape)}, the model needs {shape}")
    return expected


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
    ``model.safetensors.index.json`` and ``config.json``. Collective when distributed: each rank
    writes its own shards under ``folder/sharded`` (cast to ``dtype``), then every rank assembles
    some of the output files from them (a shared filesystem), so no rank holds the whole model.
    Returns the shard paths on rank 0."""
    # torch's own assembly of DCP-sharded safetensors, spread over the ranks (torch 2.11 to 2.13).
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

    folder = Path(folder)
    sources: dict[str, torch.Tensor] = {}
    nbytes: dict[str, int] = {}  # of every HF tensor, held here or not
    itemsize = torch.empty((), dtype=dtype).element_size()
    for key, t in get_model_state_dict(model).items():
        name = _hf_name(key)
        if name is None:
            continue
        # A DTensor casts its local shard only; an expert's cast is a tensor of its own, which the
        # writer would otherwise copy out of the stacked storage.
        if "{j}" in name:
            sources.update((name.format(j=j), view.to(dtype)) for j, view in _expert_views(t))
            nbytes.update((name.format(j=j), math.prod(t.shape[1:]) * itemsize) for j in range(t.shape[0]))
        else:
            sources[name] = t.to(dtype)
            nbytes[name] = t.numel() * itemsize
    file_of, n = _file_indices(nbytes, max_shard_bytes)
    distributed = torch.distributed.is_initialized()
    staging = folder / "sharded"
    if is_main():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # an interrupted export's shards would be assembled too
    if not distributed:
        with quiet_single_process_dcp():
            dcp.save(sources, storage_writer=HuggingFaceStorageWriter(str(folder), fqn_to_index_mapping=file_of))
    else:
        torch.distributed.barrier()
        dcp.save(sources, storage_writer=HuggingFaceStorageWriter(str(staging), fqn_to_index_mapping=file_of,
                                                                  save_distributed=True))
        consolidate_safetensors_files_on_every_rank(str(staging), str(folder), file_of)  # ends in a barrier
        if is_main():
            shutil.rmtree(staging)
    if not is_main():
        return []
    (folder / "config.json").write_text(json.dumps(args_to_hf_config(model.args, dtype), indent=2))
    return [folder / f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _file_indices(nbytes: dict[str, int], max_shard_bytes: int) -> tuple[dict[str, int], int]:
    """The output file (1..n) of each HF tensor: layer by layer, so a file holds whole layers where
    it can, and no file over ``max_shard_bytes`` unless one tensor is."""
    file_of: dict[str, int] = {}
    index, size = 1, 0
    for key in sorted(nbytes, key=_hf_sort_key):
        if size and size + nbytes[key] > max_shard_bytes:
            index, size = index + 1, 0
        file_of[key] = index
        size += nbytes[key]
    return file_of, index


def _hf_sort_key(key: str) -> tuple:
    m = re.match(r"model\.layers\.(\d+)\.(.*)", key)
    if m:
        expert = re.match(r"mlp\.experts\.(\d+)\.(.*)", m.group(2))
        return (1, int(m.group(1)), (int(expert.group(1)), expert.group(2)) if expert else (-1, m.group(2)))
    return (0 if "embed" in key else 2, 0, (0, key))
