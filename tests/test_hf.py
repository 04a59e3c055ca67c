"""Hugging Face interop: our Qwen3-MoE against transformers' own Qwen3MoeForCausalLM on a tiny
random config built here (nothing is downloaded)."""

from __future__ import annotations

import json
import os

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


class _CountingFile:
    """A ``safe_open`` handle that adds the bytes of every tensor slice read through it to ``counter``."""

    def __init__(self, f, counter: list[int]):
        self.f, self.counter = f, counter

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def get_slice(self, key):
        return _CountingSlice(self.f.get_slice(key), self.counter)

    def __getattr__(self, name):
        return getattr(self.f, name)


class _CountingSlice:
    def __init__(self, s, counter: list[int]):
        self.s, self.counter = s, counter

    def __getitem__(self, index):
        t = self.s[index]
        self.counter[0] += t.nbytes
        return t

    def __getattr__(self, name):
        return getattr(self.s, name)


def test_tied_checkpoint_and_stray_files(hf_folder, tmp_path):
    """A folder without lm_head.weight (tied embeddings) loads the embedding as the output
    projection; a safetensors file outside the index is refused (the reader would read it too),
    and so is a truncated one, from its header, before anything is read."""
    from safetensors.torch import save_file

    folder, _ = hf_folder
    sd = read_hf_state_dict(folder)
    save_file({k: v for k, v in sd.items() if k != "lm_head.weight"}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    model = our_model(read_hf_config(folder))
    load_hf_weights(model, tmp_path)
    assert torch.equal(model.output.weight, sd["model.embed_tokens.weight"])
    assert torch.equal(model.layers["1"].moe.experts.w2[3], sd["model.layers.1.mlp.experts.3.down_proj.weight"])
    save_file({"x": torch.zeros(1)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(HFCheckpointError, match=r"extra.safetensors not part of the model .* move them out"):
        load_hf_weights(model, tmp_path)
    (tmp_path / "extra.safetensors").unlink()
    os.truncate(tmp_path / "model.safetensors", (tmp_path / "model.safetensors").stat().st_size - 100)
    with pytest.raises(HFCheckpointError, match=r"model.safetensors is not a readable safetensors file: .*not fully"):
        load_hf_weights(model, tmp_path)


def test_export_script_refuses_to_overwrite(tmp_path):
    """scripts/export_hf.py writes into a new folder (files 0644 under umask 022, not 0600); a
    folder with files is refused with one line unless --overwrite, which replaces the previous
    export's files and keeps the others."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from components.dcp_utils import quiet_single_process_dcp
    from tests.utils import debug_model, load_script

    model = debug_model(n_layers=1)
    with quiet_single_process_dcp():
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(tmp_path / "step-1"))
    export_hf = load_script("export_hf")
    argv = ["--checkpoint", str(tmp_path / "step-1"), "--out", str(tmp_path / "out"), "--dtype", "float32",
            "--config", "train_configs/debug_model.toml", "--model.n_layers", "1"]
    assert export_hf.main(argv) == 0
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask) and len(modes) == 3
    with pytest.raises(SystemExit, match=r"^error: --out .*out already holds files; pass --overwrite"):
        export_hf.main(argv)
    (tmp_path / "out" / "tokenizer.json").write_text("{}")
    (tmp_path / "out" / "model-00009-of-00009.safetensors").write_bytes(b"stale")
    assert export_hf.main(argv + ["--overwrite"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json", "tokenizer.json"]
    back = debug_model(n_layers=1, init=False)
    back.to_empty(device="cpu")
    load_hf_weights(back, tmp_path / "out")
    for (name, x), (_, y) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(x, y), name


def _load_and_export_job(rank: int, world: int, hf_dir: str, dump_folder: str, out_dir: str) -> dict | None:
    """Every rank of the gloo pool (tests/multiprocess.py): an EP 2 trainer (x FSDP 2 at 4 ranks)
    starts from the HF folder (the per-rank path, counting the bytes each rank reads from the
    safetensors files); the same folder through the rank-0 path; then a sharded checkpoint of it
    exported by scripts/export_hf.py on all ranks. Rank 0 returns both loads gathered back and
    every rank's bytes read and written."""
    from pathlib import Path

    import safetensors
    import safetensors.torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from components.config import parse_args
    from components.hf_checkpoint import _load_through_rank0
    from tests.utils import full_state, load_script
    from train import Trainer

    layout = ["--config", "train_configs/debug_model.toml", "--model.n_layers", "2",
              "--parallelism.expert_parallel_degree", "2"]
    trainer = Trainer(parse_args([*layout, "--training.seq_len", "32", "--training.local_batch_size", "2",
                                  "--training.device", "cpu", "--job.dump_folder", dump_folder,
                                  "--checkpoint.enable", "--checkpoint.initial_load_path", hf_dir]))
    counter, real_open = [0], safetensors.safe_open
    safetensors.safe_open = lambda *a, **k: _CountingFile(real_open(*a, **k), counter)
    try:
        assert trainer.checkpoint.maybe_load() == 0  # [checkpoint] initial_load_format = "hf", the default
    finally:
        safetensors.safe_open = real_open
    per_rank = full_state(trainer.model)
    with torch.no_grad():
        for p in trainer.model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).zero_()
    _load_through_rank0(trainer.model, Path(hf_dir), trainer.model.args)
    rank0 = full_state(trainer.model)
    trainer.checkpoint.save(1)
    written, real_save = [0], safetensors.torch.save

    def counting_save(tensors, *args, **kwargs):  # what DCP's writer serializes on this rank
        written[0] += sum(t.nbytes for t in tensors.values())
        return real_save(tensors, *args, **kwargs)

    safetensors.torch.save = counting_save
    try:
        load_script("export_hf").export(f"{dump_folder}/checkpoint/step-1", out_dir, layout, torch.float32)
    finally:
        safetensors.torch.save = real_save
    counts = [None] * world
    dist.all_gather_object(counts, (counter[0], written[0]))
    # Many output files: each rank assembles some of them.
    paths = save_hf_weights(trainer.model, f"{out_dir}-many", dtype=torch.float32, max_shard_bytes=1_000_000)
    return {"per_rank": per_rank, "rank0": rank0, "counts": counts, "paths": paths} if rank == 0 else None


@pytest.mark.integration
@pytest.mark.skipif(__import__("sys").platform != "linux", reason="multi-process tests use gloo on Linux")
@pytest.mark.parametrize("world", [2, 4], ids=["ep2", "ep2_x_fsdp2"])
def test_per_rank_load_and_sharded_export(world, tmp_path):
    """2 ranks (EP 2) and 4 (EP 2 x expert-FSDP 2; FSDP 4 for the rest): each rank reads its share
    of the safetensors bytes and nothing twice, the weights are exactly the rank-0 path's, and the
    sharded export writes exactly those weights, each rank its share (mode 0644 under umask 022)."""
    from components.config import parse_args
    from components.hf_checkpoint import titan_to_hf
    from tests.utils import run_job
    from train import Trainer

    # On CPU like the gloo workers (on a GPU machine the default device would put `want` on cuda).
    src = Trainer(parse_args(["--config", "train_configs/debug_model.toml", "--model.n_layers", "2",
                              "--training.seq_len", "32", "--training.seed", "11", "--training.device", "cpu",
                              "--job.dump_folder", str(tmp_path / "src")]))
    save_hf_weights(src.model, tmp_path / "hf", dtype=torch.bfloat16)  # as released: bf16 into float32 weights
    want = {k: v.to(torch.bfloat16).float() for k, v in src.model.state_dict().items()}
    got = run_job(world, _load_and_export_job, hf_dir=str(tmp_path / "hf"), dump_folder=str(tmp_path / "run"),
                  out_dir=str(tmp_path / "out"))
    assert set(got["per_rank"]) == set(got["rank0"]) == set(want)
    for k in want:
        assert torch.equal(got["per_rank"][k], want[k]), k
        assert torch.equal(got["rank0"][k], want[k]), k
    # Every tensor of the debug model splits evenly over the ranks (experts: E / ep x F / (world / ep);
    # the rest: dim 0 / world), so each rank reads exactly 1/world of the bytes; the rank-0 path reads
    # them all on rank 0. The sum shows that no slice is read twice.
    read, written = zip(*got["counts"])
    total = sum(t.nbytes for t in read_hf_state_dict(tmp_path / "hf").values())
    assert sum(read) == total and max(read) <= total / world, (read, total)
    # The sharded export likewise: each rank serializes its own shards (float32: twice the bytes).
    assert sum(written) == 2 * total and max(written) <= 2 * total / world, (written, total)
    expected = titan_to_hf(want)
    assert len(got["paths"]) > world
    for out in (tmp_path / "out", tmp_path / "out-many"):
        exported = read_hf_state_dict(out)
        assert set(exported) == set(expected)
        for k, v in expected.items():
            assert torch.equal(exported[k], v), k
        assert not (out / "sharded").exists()
    assert sorted(p.name for p in (tmp_path / "out-many").glob("*.safetensors")) == [p.name for p in got["paths"]]
    umask = os.umask(0)
    os.umask(umask)
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()} == {
        p.name: 0o666 & ~umask for p in (tmp_path / "out").iterdir()}
