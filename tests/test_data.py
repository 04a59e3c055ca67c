"""Tokenizer, dataloader and the shipped corpus/tokenizer assets.

The dataloader tests use a toy tokenizer whose ids are easy to predict (a document "5 6 7" becomes
[BOS, 15, 16, 17, EOS]), so every expected stream and sample below is computed by hand from the
input text, not by the code under test.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from components.dataloader import PackedTextDataLoader, build_dataloader
from components.tokenizer import SentencePieceTokenizer, build_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_PATH = ROOT / "assets" / "tokenizer" / "tokenizer.model"
CORPUS_DIR = ROOT / "assets" / "data" / "stories"


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"scripts_{name}"] = module  # dataclasses look their module up while executing it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sp_tokenizer() -> SentencePieceTokenizer:
    return build_tokenizer(str(TOKENIZER_PATH))


# --- tokenizer --------------------------------------------------------------------------------


def test_tokenizer_special_ids(sp_tokenizer):
    assert (sp_tokenizer.pad_id, sp_tokenizer.bos_id, sp_tokenizer.eos_id) == (0, 2, 3)
    assert sp_tokenizer.vocab_size == 2048
    ids = sp_tokenizer.encode("Mia had a cat.")
    assert ids[0] == 2 and ids[-1] == 3
    assert 2 not in ids[1:-1] and 3 not in ids[1:-1]
    assert sp_tokenizer.encode("Mia had a cat.", bos=False, eos=False) == ids[1:-1]
    assert sp_tokenizer.encode("Mia", bos=False)[-1] == 3
    assert sp_tokenizer.encode("Mia", eos=False)[0] == 2


@pytest.mark.parametrize("text", [
    "Once upon a time, there was a kind girl named Mia. She had a dog called Biscuit.",
    "  leading, double  spaces,\ttabs and trailing space ",
    "Zoë's café: naïve résumé — 日本語, Ελληνικά, emoji 🐢🍎!",
    "digits 0123456789 and symbols {}[]<>|\\~`^@#$%&*",
])
def test_tokenizer_round_trip(sp_tokenizer, text):
    ids = sp_tokenizer.encode(text, bos=False, eos=False)
    assert sp_tokenizer.decode(ids) == text
    assert 1 not in ids  # byte fallback: nothing becomes <unk>
    assert all(0 <= i < sp_tokenizer.vocab_size for i in ids)
    # Special ids are dropped when decoding.
    assert sp_tokenizer.decode(sp_tokenizer.encode(text)) == text


def test_tokenizer_unseen_characters_use_bytes(sp_tokenizer):
    # "日" is 3 UTF-8 bytes and never occurs in the ASCII corpus: expect 3 byte pieces (ids 4..259).
    ids = sp_tokenizer.encode("日", bos=False, eos=False)
    pieces = [i for i in ids if 4 <= i < 4 + 256]
    assert [i - 4 for i in pieces] == list("日".encode("utf-8"))


def test_tokenizer_compresses_corpus_text(sp_tokenizer):
    text = "The day after Monday is Tuesday. She had five plums."
    assert len(sp_tokenizer.encode(text, bos=False, eos=False)) < len(text.split()) * 1.5


def test_build_tokenizer_missing(tmp_path):
    path = tmp_path / "nope" / "tokenizer.model"
    with pytest.raises(FileNotFoundError) as e:
        build_tokenizer(str(path))
    assert str(path) in str(e.value) and "[model] tokenizer_path" in str(e.value)


def test_build_tokenizer_hf_json_not_supported(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    with pytest.raises(NotImplementedError, match="not supported yet"):
        build_tokenizer(str(path))


def test_build_tokenizer_unknown_format(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("a\nb\n")
    with pytest.raises(ValueError, match=r"\.model"):
        build_tokenizer(str(path))


@pytest.mark.parametrize("content", [b"this is not a model", b"", b"\x00" * 64])
def test_build_tokenizer_corrupt_model(tmp_path, content):
    path = tmp_path / "broken.model"
    path.write_bytes(content)
    with pytest.raises(ValueError) as e:
        build_tokenizer(str(path))
    assert str(path) in str(e.value)


# --- dataloader on a toy corpus -----------------------------------------------------------------


class NumberTokenizer:
    """Documents are whitespace-separated integers n; token id = n + 10. BOS = 1, EOS = 2."""

    vocab_size, pad_id, bos_id, eos_id = 10_000, 0, 1, 2

    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
        return [1] * bos + [int(w) + 10 for w in text.split()] + [2] * eos

    def decode(self, ids) -> str:
        return " ".join(str(i - 10) for i in ids if i >= 10)


def write_numbers_corpus(root: Path, n_docs: int, words_per_doc: int) -> list[int]:
    """Docs of consecutive unique numbers, split over two files; returns the expected stream.

    The first file gets ``n_docs // 3 + 1`` docs, so that (for the sizes used here) the file
    boundary does not fall on a sample boundary and reading the files in another order changes
    the samples' contents, not just their order.
    """
    lines = [" ".join(str(d * words_per_doc + w) for w in range(words_per_doc)) for d in range(n_docs)]
    first = n_docs // 3 + 1
    (root / "b_dir").mkdir(parents=True)
    # Sorted by path: "a.txt" < "b_dir/c.txt"; blank lines and non-.txt files are skipped.
    (root / "a.txt").write_text("\n\n".join(lines[:first]) + "\n   \n")
    (root / "b_dir" / "c.txt").write_text("\n".join(lines[first:]))
    (root / "notes.md").write_text("999 999 999\n")
    stream = []
    for line in lines:
        stream += [1] + [int(w) + 10 for w in line.split()] + [2]
    return stream


def windows(stream: list[int], S: int) -> list[list[int]]:
    return [stream[i * S:(i + 1) * S] for i in range(len(stream) // S)]


def sample_of(inputs_L: torch.Tensor, labels_L: torch.Tensor) -> list[int]:
    return inputs_L.tolist() + labels_L[-1:].tolist()


def take_epoch(loader: PackedTextDataLoader, expected: list[list[int]]) -> list[int]:
    """Sample indices (into ``expected``) of one epoch's batches, checking each batch's form."""
    seen = []
    for _ in range(loader.batches_per_epoch):
        x, y = next(loader)
        assert x.dtype == y.dtype == torch.int64
        assert x.shape == y.shape == (loader.local_batch_size, loader.seq_len)
        assert torch.equal(x[:, 1:], y[:, :-1])
        for b in range(x.shape[0]):
            seen.append(expected.index(sample_of(x[b], y[b])))
    return seen


def test_packing_exact(tmp_path):
    stream = write_numbers_corpus(tmp_path, n_docs=10, words_per_doc=5)  # 10 docs x 7 = 70 tokens
    assert len(stream) == 70
    seq_len, B = 4, 2
    # 14 samples of 5 tokens, nothing dropped; samples straddle documents (and files), so any
    # change in document order or in where the cuts fall changes their contents.
    expected = windows(stream, seq_len + 1)
    loader = build_dataloader(str(tmp_path), NumberTokenizer(), seq_len, B)
    assert loader.num_tokens == 70 and loader.num_samples == 14 and loader.batches_per_epoch == 7
    assert sorted(take_epoch(loader, expected)) == list(range(14))
    assert loader.epoch == 1


def test_packing_drops_remainder_and_partial_batch(tmp_path):
    stream = write_numbers_corpus(tmp_path, n_docs=8, words_per_doc=6)
    first_file = stream[:3 * 8]  # a.txt alone: 3 docs of 8 tokens
    seq_len, B = 4, 3
    expected = windows(first_file, seq_len + 1)  # 4 samples of 5 tokens; 4 tokens dropped
    assert len(expected) == 4
    loader = build_dataloader(str(tmp_path / "a.txt"), NumberTokenizer(), seq_len, B)  # a single file
    assert loader.num_tokens == 24 and loader.num_samples == 4
    assert loader.batches_per_epoch == 1  # 4 samples -> 1 batch of 3; the 4th sample waits
    seen = [take_epoch(loader, expected) for _ in range(6)]
    assert all(len(set(s)) == 3 for s in seen)
    assert set().union(*map(set, seen)) == {0, 1, 2, 3}  # each epoch leaves out a different one


def test_ranks_partition_samples(tmp_path):
    stream = write_numbers_corpus(tmp_path, n_docs=18, words_per_doc=6)  # 144 tokens
    seq_len, B, W = 11, 2, 3
    expected = windows(stream, seq_len + 1)  # 12 samples: 4 per rank, 2 batches each
    assert len(expected) == 12
    per_rank = []
    for rank in range(W):
        loader = build_dataloader(str(tmp_path), NumberTokenizer(), seq_len, B, dp_rank=rank, dp_world_size=W)
        epoch0 = take_epoch(loader, expected)
        epoch1 = take_epoch(loader, expected)
        assert sorted(epoch0) == sorted(epoch1) == list(range(rank, 12, W))
        per_rank.append(set(epoch0))
    assert set().union(*per_rank) == set(range(12))
    assert sum(len(s) for s in per_rank) == 12  # disjoint


def test_shuffle_is_deterministic_per_seed_and_epoch():
    tokens = torch.arange(4000) % 997
    def epochs(seed, n=3):
        loader = PackedTextDataLoader(tokens, seq_len=7, local_batch_size=5, seed=seed)
        return [torch.cat([next(loader)[0] for _ in range(loader.batches_per_epoch)]) for _ in range(n)]
    a, b, c = epochs(0), epochs(0), epochs(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], a[1])  # a new order every epoch ...
    assert not torch.equal(a[0], c[0])  # ... and per seed
    # ... but always the same samples: 4000 // 8 = 500 samples, 100 batches of 5.
    for e in a:
        assert sorted(e[:, 0].tolist()) == sorted((torch.arange(0, 4000, 8) % 997).tolist())


def test_state_dict_round_trip(tmp_path):
    write_numbers_corpus(tmp_path, n_docs=20, words_per_doc=9)  # 220 tokens
    make = lambda: build_dataloader(str(tmp_path), NumberTokenizer(), 5, 3, dp_rank=1, dp_world_size=2, seed=7)
    original = make()
    bpe = original.batches_per_epoch
    assert bpe == 6  # 36 samples, 18 on rank 1, 6 batches of 3
    for k in [0, 2, bpe - 1, bpe, bpe + 4]:
        original = make()
        for _ in range(k):
            next(original)
        state = original.state_dict()
        assert state["epoch"] == k // bpe and state["batch_in_epoch"] == k % bpe
        restored = make()
        restored.load_state_dict(dict(state))
        for _ in range(2 * bpe + 1):  # across at least one epoch boundary
            (x0, y0), (x1, y1) = next(original), next(restored)
            assert torch.equal(x0, x1) and torch.equal(y0, y1)
        assert restored.state_dict() == original.state_dict()


def test_load_state_dict_rejects_mismatch(tmp_path):
    write_numbers_corpus(tmp_path, n_docs=20, words_per_doc=9)
    a = build_dataloader(str(tmp_path), NumberTokenizer(), 5, 3, dp_rank=0, dp_world_size=2)
    b = build_dataloader(str(tmp_path), NumberTokenizer(), 5, 3, dp_rank=0, dp_world_size=1)
    with pytest.raises(ValueError, match="dp_world_size"):
        b.load_state_dict(a.state_dict())
    bad = a.state_dict() | {"batch_in_epoch": a.batches_per_epoch}
    with pytest.raises(ValueError, match="out of range"):
        a.load_state_dict(bad)


def test_dataloader_missing_path(tmp_path):
    path = tmp_path / "no_such_data"
    with pytest.raises(FileNotFoundError) as e:
        build_dataloader(str(path), NumberTokenizer(), 4, 2)
    assert str(path) in str(e.value) and "[training] dataset_path" in str(e.value)


def test_dataloader_folder_without_txt(tmp_path):
    (tmp_path / "readme.md").write_text("1 2 3\n")
    with pytest.raises(ValueError, match="no .txt files"):
        build_dataloader(str(tmp_path), NumberTokenizer(), 4, 2)


def test_dataloader_corpus_too_small(tmp_path):
    write_numbers_corpus(tmp_path, n_docs=4, words_per_doc=3)  # 20 tokens
    # seq_len 4 -> 4 samples of 5; rank 1 of 2 needs samples 1 and 3 for B=2: OK with 20 tokens.
    build_dataloader(str(tmp_path), NumberTokenizer(), 4, 2, dp_rank=1, dp_world_size=2)
    # B=3 on rank 1 of 2 needs sample 5, i.e. 6 samples = 30 tokens.
    with pytest.raises(ValueError) as e:
        build_dataloader(str(tmp_path), NumberTokenizer(), 4, 3, dp_rank=1, dp_world_size=2)
    assert "20 tokens" in str(e.value) and "30 tokens" in str(e.value)


@pytest.mark.parametrize("seq_len, batch, rank, world", [(0, 2, 0, 1), (4, 0, 0, 1), (4, 2, 2, 2), (4, 2, 0, 0)])
def test_dataloader_bad_sizes(tmp_path, seq_len, batch, rank, world):
    write_numbers_corpus(tmp_path, n_docs=4, words_per_doc=3)
    with pytest.raises(ValueError):
        build_dataloader(str(tmp_path), NumberTokenizer(), seq_len, batch, dp_rank=rank, dp_world_size=world)


# --- the shipped assets --------------------------------------------------------------------------


def test_shipped_corpus_and_tokenizer_build_a_loader(sp_tokenizer):
    loader = build_dataloader(str(CORPUS_DIR), sp_tokenizer, seq_len=256, local_batch_size=8)
    lines = [l.strip() for l in (CORPUS_DIR / "corpus.txt").read_text().split("\n") if l.strip()]
    # Independently: per-document encode (not the batched path the loader uses), + BOS + EOS.
    assert loader.num_tokens == sum(len(sp_tokenizer.encode(l, bos=False, eos=False)) + 2 for l in lines)
    assert loader.batches_per_epoch >= 100
    x, y = next(loader)
    assert x.shape == y.shape == (8, 256)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < sp_tokenizer.vocab_size and int(x.min()) >= 0
    assert (x == sp_tokenizer.bos_id).any()  # documents are shorter than a sample


def test_shipped_corpus_is_reproducible():
    corpus = CORPUS_DIR / "corpus.txt"
    data = corpus.read_bytes()
    assert 1_000_000 <= len(data) <= 3_000_000
    docs = _load_script("make_corpus").generate()
    assert ("\n".join(docs) + "\n").encode("utf-8") == data


def test_tokenizer_training_is_deterministic(tmp_path):
    train = _load_script("train_tokenizer").train
    train(CORPUS_DIR / "corpus.txt", tmp_path / "a.model")
    train(CORPUS_DIR / "corpus.txt", tmp_path / "b.model")
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.model", "b.model"]  # no .vocab left behind
