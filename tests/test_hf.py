"""Hugging Face interop: our Qwen3-MoE against transformers' own Qwen3MoeForCausalLM on a tiny
random config built here (nothing is downloaded)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from components.hf_checkpoint import (  # noqa: E402
    HFCheckpointError,
    check_hf_config,
    hf_config_to_args,
    load_hf_weights,
    read_hf_config,
    read_hf_state_dict,
    save_hf_weights,
)
from models.qwen3.model import Qwen3MoE  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
            max_position_embeddings=128, rms_norm_eps=1e-6)


def hf_model(rope_theta: float = 10000.0):
    config = transformers.Qwen3MoeConfig(**TINY, rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    # HF initialises norms to one; random norms make sure every weight reaches the right place.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def our_model(config: dict, backend: str = "torch") -> Qwen3MoE:
    model = Qwen3MoE(hf_config_to_args(config), moe_backend=backend)
    model.init_weights()
    return model.eval()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    model = hf_model(rope_theta=50000.0)
    model.save_pretrained(folder)
    return folder, model


def test_saved_layout_is_per_expert(hf_folder):
    folder, _ = hf_folder
    keys = set(read_hf_state_dict(folder))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in keys and "lm_head.weight" in keys
    assert not any(k.endswith("gate_up_proj") for k in keys)


def test_logits_match_transformers(hf_folder):
    folder, hf = hf_folder
    ours = our_model(read_hf_config(folder))
    assert ours.args.rope_theta == 50000.0 and ours.args.num_experts == 4
    load_hf_weights(ours, folder)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
        got, stats = ours(tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert stats[:, 0].sum().item() == 2 * 2 * 24 * 2  # layers x B x L x top-k routed slots


def test_fused_in_memory_layout_loads_too(hf_folder, tmp_path):
    """transformers >= 5 holds experts fused (gate_up_proj (E, 2F, D), down_proj (E, D, F)); a
    folder written in that layout loads to the same model."""
    from safetensors.torch import save_file

    folder, hf = hf_folder
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if not any(k.endswith("gate_up_proj") for k in sd):
        pytest.skip("this transformers version holds experts per expert in memory")
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    a, b = our_model(read_hf_config(folder)), our_model(read_hf_config(folder))
    load_hf_weights(a, folder)
    load_hf_weights(b, tmp_path)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_export_import_round_trip_is_exact(hf_folder, tmp_path):
    folder, hf = hf_folder
    config = read_hf_config(folder)
    src = our_model(config)  # random weights of its own, not the HF ones
    paths = save_hf_weights(src, tmp_path / "out", dtype=torch.float32, max_shard_bytes=40_000)
    assert len(paths) > 2  # sharded, with an index
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in paths}
    dst = our_model(config)
    load_hf_weights(dst, tmp_path / "out")
    for (name, x), (_, y) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert torch.equal(x, y), name
    # transformers reads the export: same logits as ours.
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(src(tokens)[0], back(tokens).logits, rtol=1e-5, atol=1e-5)


def test_export_in_bf16_matches_a_bf16_cast(hf_folder, tmp_path):
    folder, _ = hf_folder
    src = our_model(read_hf_config(folder))
    save_hf_weights(src, tmp_path, dtype=torch.bfloat16)
    sd = read_hf_state_dict(tmp_path)
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    torch.testing.assert_close(sd["model.layers.0.mlp.experts.2.up_proj.weight"],
                               src.layers["0"].moe.experts.w3[2].detach().to(torch.bfloat16), rtol=0, atol=0)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_config_mismatch_is_named(hf_folder):
    folder, _ = hf_folder
    config = read_hf_config(folder)
    args = hf_config_to_args(config)
    check_hf_config(config, args, where="x")
    import dataclasses

    with pytest.raises(HFCheckpointError, match=r"num_hidden_layers = 2 vs n_layers = 3, num_experts = 4 vs "
                                                r"num_experts = 8"):
        check_hf_config(config, dataclasses.replace(args, n_layers=3, num_experts=8), where="x")
    with pytest.raises(HFCheckpointError, match=r"mlp_only_layers = \[1\]"):
        check_hf_config({**config, "mlp_only_layers": [1]}, args, where="x")
    with pytest.raises(HFCheckpointError, match="model_type is 'llama'"):
        check_hf_config({**config, "model_type": "llama"}, args, where="x")


def test_bad_folders(hf_folder, tmp_path):
    folder, _ = hf_folder
    model = our_model(read_hf_config(folder))
    with pytest.raises(HFCheckpointError, match="config.json not found"):
        load_hf_weights(model, tmp_path / "nothing")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(HFCheckpointError, match="holds neither model.safetensors.index.json nor model.safetensors"):
        load_hf_weights(model, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(HFCheckpointError, match="is not a readable safetensors file"):
        load_hf_weights(model, tmp_path)
    from safetensors.torch import save_file

    sd = read_hf_state_dict(folder)
    save_file({k: v for k, v in sd.items() if "experts.3." not in k}, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match=r"layer 0 gate_proj \(w1\): experts \[3\] are missing"):
        load_hf_weights(model, tmp_path)
    save_file({**sd, "model.layers.0.mlp.shared_expert.gate_proj.weight": torch.zeros(2, 2)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match="no place for: model.layers.0.mlp.shared_expert"):
        load_hf_weights(model, tmp_path)


def _load_job(rank: int, world: int, hf_dir: str, dump_folder: str) -> dict | None:
    """Every rank of the gloo pool (tests/multiprocess.py) loads the HF folder into an EP 2 trainer;
    rank 0 returns the full state gathered back."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from components.config import parse_args
    from train import Trainer

    trainer = Trainer(parse_args([
        "--config", "train_configs/debug_model.toml", "--model.n_layers", "2", "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--training.device", "cpu", "--job.dump_folder", dump_folder,
        "--parallelism.expert_parallel_degree", "2", "--checkpoint.initial_load_path", hf_dir]))
    assert trainer.checkpoint.maybe_load() == 0
    sd = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() for k, v in sd.items()} if rank == 0 else None


@pytest.mark.integration
@pytest.mark.skipif(__import__("sys").platform != "linux", reason="multi-process tests use gloo on Linux")
def test_load_into_fsdp_with_expert_parallel(tmp_path):
    """Two ranks, FSDP over both and the experts split 2 ways (DTensors): the loaded weights,
    gathered back, are exactly the exported ones."""
    from components.config import parse_args
    from tests.utils import run_job
    from train import Trainer

    # On CPU like the gloo workers (on a GPU machine the default device would put `want` on cuda).
    src = Trainer(parse_args(["--config", "train_configs/debug_model.toml", "--model.n_layers", "2",
                              "--training.seq_len", "32", "--training.seed", "11", "--training.device", "cpu",
                              "--job.dump_folder", str(tmp_path / "src")]))
    save_hf_weights(src.model, tmp_path / "hf", dtype=torch.float32)
    got = run_job(2, _load_job, hf_dir=str(tmp_path / "hf"), dump_folder=str(tmp_path / "out"))
    want = src.model.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
