"""Tokenizer, dataloader and the shipped corpus/tokenizer assets.

The dataloader tests use a toy tokenizer whose ids are easy to predict (a document "5 6 7" becomes
[BOS, 15, 16, 17, EOS]), so every expected stream and sample below is computed by hand from the
input text, not by the code under test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from components.dataloader import PackedTextDataLoader, build_dataloader
from components.tokenizer import SentencePieceTokenizer, build_tokenizer
from tests.utils import ROOT, load_script

TOKENIZER_PATH = ROOT / "assets" / "tokenizer" / "tokenizer.model"
CORPUS_DIR = ROOT / "assets" / "data" / "stories"


_load_script = load_script


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


def test_build_tokenizer_hf_json_unreadable(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    with pytest.raises(ValueError) as e:
        build_tokenizer(str(path))
    assert "could not load Hugging Face tokenizer" in str(e.value) and str(path) in str(e.value)


def test_build_tokenizer_folder_without_tokenizer(tmp_path):
    (tmp_path / "vocab.txt").write_text("a\n")
    with pytest.raises(ValueError, match="neither tokenizer.json nor tokenizer.model"):
        build_tokenizer(str(tmp_path))


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


def test_unshuffled_loader_reads_the_stream_in_order():
    """shuffle=False: the packed stream cut into L + 1-token samples in order, every epoch, the
    global batch of step k being samples k*W ... k*W + W - 1 over the W ranks (upstream's order)."""
    tokens = torch.arange(4000)
    loader = PackedTextDataLoader(tokens, seq_len=7, local_batch_size=5, shuffle=False)
    for _ in range(2):  # two epochs, the same order
        x = torch.cat([next(loader)[0] for _ in range(loader.batches_per_epoch)])
        assert torch.equal(x, tokens[:500 * 8].view(500, 8)[:, :7])
    W = 2
    ranks = [PackedTextDataLoader(tokens, seq_len=7, local_batch_size=1, dp_rank=r, dp_world_size=W, shuffle=False)
             for r in range(W)]
    first_steps = [torch.cat([next(loader)[1] for loader in ranks]) for _ in range(3)]
    assert torch.equal(torch.cat(first_steps), tokens[:6 * 8].view(6, 8)[:, 1:])


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


# --- Hugging Face tokenizer.json -----------------------------------------------------------------

HF_TEXTS = ["Once upon a time there was a cat.", "The dog ran to the park and back.",
            "Mia had five plums; she ate two.", "Zoë's café"]


def make_hf_tokenizer(folder: Path, *, specials=("<|endoftext|>", "<|im_start|>"), template: bool = False) -> Path:
    """A tiny byte-level BPE tokenizer.json trained here (no download), Qwen3-like: no BOS token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(HF_TEXTS * 5, trainer)
    if template:  # a post-processor that would add a special token of its own
        tok.post_processor = processors.TemplateProcessing(
            single=f"{specials[-1]} $A", special_tokens=[(specials[-1], tok.token_to_id(specials[-1]))])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def test_hf_tokenizer_qwen_style_no_bos(tmp_path):
    path = make_hf_tokenizer(tmp_path / "tok", template=True)
    tok = build_tokenizer(str(tmp_path / "tok"))  # a folder: tokenizer.json is found in it
    assert type(tok).__name__ == "HFTokenizer"
    assert tok.eos_id == 0 and tok.bos_id == -1 and tok.pad_id == -1  # special tokens come first
    assert tok.vocab_size == 300
    body = tok.encode("the cat", bos=False, eos=False)
    assert 0 not in body and 1 not in body  # the template's <|im_start|> is not added
    assert tok.encode("the cat") == body + [0]  # no BOS exists, EOS closes the document
    for text in HF_TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch(HF_TEXTS) == [tok.encode(t) for t in HF_TEXTS]
    assert build_tokenizer(str(path)).encode("the cat") == tok.encode("the cat")


def test_hf_tokenizer_config_names_special_tokens(tmp_path):
    make_hf_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": null, "eos_token": {"content": "<|im_start|>"}, "pad_token": "<|endoftext|>"}')
    tok = build_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (-1, 1, 0)
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<|endoftext|>", "eos_token": "<|im_start|>"}')
    tok = build_tokenizer(str(tmp_path))
    assert tok.encode("cat")[0] == 0 and tok.encode("cat")[-1] == 1


@pytest.mark.parametrize("config, pattern", [
    ('{"eos_token": "<|nope|>"}', r"eos_token '<\|nope\|>' is not in the vocabulary"),
    ("{not json", "tokenizer_config.json is not valid JSON"),
])
def test_hf_tokenizer_bad_config(tmp_path, config, pattern):
    make_hf_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(config)
    with pytest.raises(ValueError, match=pattern):
        build_tokenizer(str(tmp_path))


def test_hf_tokenizer_without_eos_is_refused(tmp_path):
    make_hf_tokenizer(tmp_path, specials=("<pad>",))
    with pytest.raises(ValueError, match="has no EOS token"):
        build_tokenizer(str(tmp_path))


def test_hf_tokenizer_packs_eos_separated_documents(tmp_path):
    make_hf_tokenizer(tmp_path / "tok")
    tok = build_tokenizer(str(tmp_path / "tok"))
    docs = HF_TEXTS * 3
    (tmp_path / "data.txt").write_text("\n".join(docs))
    loader = build_dataloader(str(tmp_path / "data.txt"), tok, seq_len=7, local_batch_size=2)
    stream = sum((tok.encode(d, bos=False, eos=False) + [0] for d in docs), [])
    assert loader.num_tokens == len(stream)
    expected = windows(stream, 8)
    seen = take_epoch(loader, expected)  # the samples are exactly the stream's windows, none twice
    assert len(set(seen)) == len(seen) == len(expected) // 2 * 2


# --- JSON lines, Parquet, mixed folders -----------------------------------------------------------


def number_lines(n_docs: int, words: int, start: int = 0) -> list[str]:
    return [" ".join(str((start + d) * words + w) for w in range(words)) for d in range(n_docs)]


def stream_of(lines: list[str]) -> list[int]:
    return sum(([1] + [int(w) + 10 for w in line.split()] + [2] for line in lines), [])


def write_parquet(path: Path, column: str, values: list) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: values, "id": list(range(len(values)))}), path, row_group_size=3)


def test_jsonl_with_custom_field(tmp_path):
    import json

    lines = number_lines(10, 4)
    records = [json.dumps({"id": i, "content": l, "meta": {"x": 1}}) for i, l in enumerate(lines)]
    records.insert(3, "")  # blank lines are skipped
    records.insert(5, json.dumps({"content": "   "}))  # so are empty documents
    (tmp_path / "d.jsonl").write_text("\n".join(records) + "\n")
    loader = build_dataloader(str(tmp_path / "d.jsonl"), NumberTokenizer(), 5, 2, text_field="content")
    expected = windows(stream_of(lines), 6)
    assert loader.num_tokens == 10 * 6
    assert sorted(take_epoch(loader, expected)) == list(range(10))


def test_mixed_folder_reads_every_format_in_path_order(tmp_path):
    import json

    a, b, c = number_lines(4, 3, 0), number_lines(5, 3, 4), number_lines(7, 3, 9)
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("\n".join(a))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": l}) for l in b))
    write_parquet(tmp_path / "sub" / "c.parquet", "text", c[:3] + [None] + c[3:])  # nulls skipped
    (tmp_path / "readme.md").write_text("999\n")
    loader = build_dataloader(str(tmp_path), NumberTokenizer(), 4, 2, dp_rank=1, dp_world_size=2)
    stream = stream_of(a + b + c)
    assert loader.num_tokens == len(stream) == 16 * 5
    expected = windows(stream, 5)
    assert sorted(take_epoch(loader, expected)) == list(range(1, 16, 2))


@pytest.mark.parametrize("content, pattern", [
    ('{"text": "1 2"}\n{"text": "3"}\n{"text": oops}\n', r"bad\.jsonl:3: not a JSON object"),
    ('{"text": "1 2"}\n{"body": "3"}\n', r"bad\.jsonl:2: no 'text' field \(keys: body\).*dataset_text_field"),
    ('{"text": "1 2"}\n[1, 2]\n', r"bad\.jsonl:2: expected a JSON object, got list"),
    ('{"text": 12}\n', r"bad\.jsonl:1: field 'text' is int, not a string"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, content, pattern):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(ValueError, match=pattern):
        build_dataloader(str(tmp_path), NumberTokenizer(), 2, 1)


def test_bad_parquet_files(tmp_path):
    write_parquet(tmp_path / "p.parquet", "body", ["1 2 3"] * 10)
    with pytest.raises(ValueError, match=r"p\.parquet: no 'text' column \(columns: body, id\)"):
        build_dataloader(str(tmp_path / "p.parquet"), NumberTokenizer(), 2, 1)
    with pytest.raises(ValueError, match="column 'id' is int64, not a string"):
        build_dataloader(str(tmp_path / "p.parquet"), NumberTokenizer(), 2, 1, text_field="id")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"broken\.parquet is not a readable Parquet file"):
        build_dataloader(str(tmp_path / "broken.parquet"), NumberTokenizer(), 2, 1)


def test_unsupported_file_extension(tmp_path):
    (tmp_path / "data.csv").write_text("1 2 3\n")
    with pytest.raises(ValueError, match=r"data\.csv .*unsupported extension"):
        build_dataloader(str(tmp_path / "data.csv"), NumberTokenizer(), 2, 1)


# --- pre-tokenized shards ------------------------------------------------------------------------


def test_pretokenized_single_shard_equals_text_loader(tmp_path):
    write_numbers_corpus(tmp_path / "txt", n_docs=20, words_per_doc=9)
    pretokenize = _load_script("pretokenize").pretokenize
    paths = pretokenize(tmp_path / "txt", NumberTokenizer(), tmp_path / "bin")
    assert [p.name for p in paths] == ["shard-00000.bin"]
    assert paths[0].stat().st_size == 32 + 2 * 220  # uint16: the vocab (10,000) fits
    text = build_dataloader(str(tmp_path / "txt"), NumberTokenizer(), 5, 3, dp_rank=1, dp_world_size=2, seed=3)
    binary = build_dataloader(str(tmp_path / "bin"), NumberTokenizer(), 5, 3, dp_rank=1, dp_world_size=2, seed=3)
    assert isinstance(binary._shards[0], np.memmap)
    assert text.state_dict() == binary.state_dict()
    for _ in range(2 * text.batches_per_epoch + 1):
        (x0, y0), (x1, y1) = next(text), next(binary)
        assert torch.equal(x0, x1) and torch.equal(y0, y1)


def test_pretokenized_shards_partition_samples(tmp_path):
    lines = number_lines(30, 5)  # 30 docs of 7 tokens
    (tmp_path / "d.txt").write_text("\n".join(lines))
    paths = _load_script("pretokenize").pretokenize(tmp_path / "d.txt", NumberTokenizer(), tmp_path / "bin",
                                                    shard_tokens=50)
    # A shard closes after the document that reaches 50 tokens: 8 docs (56 tokens) per shard.
    assert len(paths) == 4
    streams = [stream_of(lines[i:i + 8]) for i in range(0, 30, 8)]
    expected = sum((windows(s, 6) for s in streams), [])  # samples never straddle two shards
    assert len(expected) == 9 + 9 + 9 + 7
    for rank in range(3):
        loader = build_dataloader(str(tmp_path / "bin"), NumberTokenizer(), 5, 2, dp_rank=rank, dp_world_size=3)
        mine = list(range(rank, 34, 3))  # 12, 11, 11 samples: 6, 5, 5 batches of 2
        seen = take_epoch(loader, expected)
        assert set(seen) <= set(mine) and len(set(seen)) == len(seen) == len(mine) // 2 * 2


def test_pretokenized_bad_shards(tmp_path):
    from components.dataloader import write_token_shard

    write_token_shard(tmp_path / "a.bin", np.arange(100), vocab_size=10_000)
    with pytest.raises(ValueError, match=r"vocabulary of 10000 tokens, but \[model\] tokenizer_path has 2048"):
        build_dataloader(str(tmp_path / "a.bin"), SmallVocab(), 4, 2)
    data = (tmp_path / "a.bin").read_bytes()
    (tmp_path / "a.bin").write_bytes(data[:-10])
    with pytest.raises(ValueError, match=r"a\.bin is truncated or corrupt: the header announces 100 tokens"):
        build_dataloader(str(tmp_path / "a.bin"), NumberTokenizer(), 4, 2)
    (tmp_path / "a.bin").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="is not a pre-tokenized shard"):
        build_dataloader(str(tmp_path / "a.bin"), NumberTokenizer(), 4, 2)
    (tmp_path / "b.txt").write_text("1 2 3\n")
    with pytest.raises(ValueError, match="mixes pre-tokenized .bin shards with text files"):
        build_dataloader(str(tmp_path), NumberTokenizer(), 4, 2)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 50\)"):
        write_token_shard(tmp_path / "c.bin", np.arange(60), vocab_size=50)


def test_pretokenize_script_stops_with_one_line(tmp_path, capsys):
    """scripts/pretokenize.py: a missing input, a broken JSON line (file and line named) and an output
    folder already holding shards each end in one ``error:`` line and exit status 2; a run that stops
    leaves no shards behind; --overwrite replaces old shards."""
    script = _load_script("pretokenize")

    def run(dataset, *more):
        rc = script.main(["--tokenizer", str(TOKENIZER_PATH), "--dataset", str(dataset), "--out", str(out), *more])
        return rc, capsys.readouterr().err

    out = tmp_path / "bin"
    missing = tmp_path / "nope.txt"
    assert run(missing) == (2, f"error: --dataset {missing}: not found ({missing.resolve()})\n")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "Mia had a cat."}\n\n{"text": "unclosed"\n')
    rc, err = run(broken)
    assert rc == 2 and err.startswith(f"error: {broken}:3: not a JSON object (") and err.count("\n") == 1, err
    assert not out.exists()
    good = tmp_path / "good.txt"
    good.write_text("Mia had a cat.\nThe cat sat.\n")
    assert run(good) == (0, "")
    rc, err = run(good)
    assert rc == 2 and err == (f"error: {out} already holds 1 shard(s) (shard-00000.bin, ...); pass --overwrite "
                               f"to replace them, or choose another --out\n")
    assert run(good, "--overwrite") == (0, "")
    # Shards flushed before a broken line further on are removed again.
    broken.write_text("".join(f'{{"text": "{i} {i}"}}\n' for i in range(5)) + "{oops\n")
    with pytest.raises(ValueError, match=r"broken\.jsonl:6: not a JSON object"):
        script.pretokenize(broken, NumberTokenizer(), tmp_path / "partial", shard_tokens=3, docs_per_batch=1)
    assert not (tmp_path / "partial").exists()


def test_tokenizing_progress_lines(tmp_path):
    """Progress lines while tokenizing: the start with the input's size, a line per batch when due
    (here always), the end with the token count; bytes read add up to the files' sizes; batching
    does not change the stream."""
    from components.dataloader import TokenizeProgress, dataset_files, iter_documents, tokenize_documents

    lines = number_lines(50, 4)
    (tmp_path / "a.txt").write_text("\n".join(lines[:20]) + "\n")
    (tmp_path / "b.jsonl").write_text("".join(f'{{"text": "{line}"}}\n' for line in lines[20:]))
    files = dataset_files(tmp_path)
    size = sum(f.stat().st_size for f in files)
    logged = []
    progress = TokenizeProgress("corpus", size, logged.append, every_s=0)
    tokens = tokenize_documents(iter_documents(files, "text", progress.add_bytes), NumberTokenizer(), progress,
                                docs_per_batch=16)
    progress.finish()
    assert tokens.tolist() == stream_of(lines)
    assert progress.bytes == size and progress.tokens == 50 * 6
    assert logged[0] == f"tokenizing corpus ({size / 1e6:.1f} MB) ..."
    assert len(logged) == 1 + 4 + 1 and all(line.startswith("tokenizing: ") for line in logged[1:-1])
    assert logged[-2].startswith(f"tokenizing: {size / 1e6:.1f} MB of {size / 1e6:.1f} MB (100%), 300 tokens")
    assert logged[-1].startswith("tokenized corpus: 300 tokens in ")


class SmallVocab(NumberTokenizer):
    vocab_size = 2048


def test_pretokenize_uses_uint32_for_large_vocabularies(tmp_path):
    from components.dataloader import read_token_shard, write_token_shard

    tokens = np.array([0, 70_000, 151_935, 5])
    write_token_shard(tmp_path / "big.bin", tokens, vocab_size=151_936)
    got, vocab = read_token_shard(tmp_path / "big.bin")
    assert got.dtype == np.uint32 and vocab == 151_936 and got.tolist() == tokens.tolist()


# --- streaming (Hugging Face datasets) -----------------------------------------------------------


def test_streaming_loader_ranks_epochs_and_state(tmp_path):
    from components.dataloader import StreamingTextDataLoader

    docs = number_lines(25, 4)  # 25 docs of 6 tokens
    opened = []

    def open_docs():
        opened.append(1)
        return iter(docs)

    def make(rank, world=2):
        return StreamingTextDataLoader(open_docs, NumberTokenizer(), 5, 2, dp_rank=rank, dp_world_size=world,
                                       source="fake")
    for rank in range(2):
        mine = stream_of(docs[rank::2])  # 13 or 12 docs -> 78 or 72 tokens -> 6 batches of 12 tokens
        loader = make(rank)
        got = [sample_of(x[b], y[b]) for x, y in (next(loader) for _ in range(6)) for b in range(2)]
        assert got == windows(mine, 6)[:12]
        assert loader.epoch == 0
        x, _ = next(loader)  # the stream ended: the leftover is dropped and the next epoch starts over
        assert loader.epoch == 1 and x[0].tolist() == mine[:5]
    # State round trip mid-epoch, with tokens waiting in the buffer.
    for k in (1, 3, 6, 8):
        a = make(1)
        for _ in range(k):
            next(a)
        b = make(1)
        b.load_state_dict(a.state_dict())
        for _ in range(8):
            (x0, y0), (x1, y1) = next(a), next(b)
            assert torch.equal(x0, x1) and torch.equal(y0, y1)
    with pytest.raises(ValueError, match="dp_world_size: saved 2, now 3"):
        make(1, world=3).load_state_dict(make(1).state_dict())
    with pytest.raises(ValueError, match="is empty"):
        next(StreamingTextDataLoader(lambda: iter([]), NumberTokenizer(), 5, 2, source="fake"))


def test_hf_dataset_name_streams_through_datasets(monkeypatch):
    import types

    calls = []

    def load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        if name == "missing/ds":
            raise ConnectionError("no network")
        return iter([{"body": l} for l in number_lines(12, 4)])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    loader = build_dataloader("hf:org/stories", NumberTokenizer(), 5, 2, text_field="body", hf_config="en",
                              hf_split="validation")
    x, y = next(loader)
    assert calls[0] == ("org/stories", "en", "validation", True)
    assert x[0].tolist() == stream_of(number_lines(1, 4))[:5]
    with pytest.raises(ValueError, match="could not open the Hugging Face dataset 'missing/ds'.*no network"):
        build_dataloader("hf:missing/ds", NumberTokenizer(), 5, 2)
    loader = build_dataloader("hf:org/stories", NumberTokenizer(), 5, 2)  # the default field, "text"
    with pytest.raises(ValueError, match="record 0 has no 'text' field"):
        next(loader)


def test_hf_dataset_without_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(ValueError, match="needs the `datasets` package"):
        build_dataloader("hf:allenai/c4", NumberTokenizer(), 5, 2)
