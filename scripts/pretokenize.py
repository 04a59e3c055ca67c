"""Tokenize a text dataset once into memory-mapped ``.bin`` shards, so training starts at once and
never holds the corpus in memory.

    python scripts/pretokenize.py --tokenizer assets/tokenizer/tokenizer.model \
        --dataset assets/data/stories --out data/stories_bin [--text-field text] [--shard-tokens 100000000]
    python train.py --config train_configs/debug_model.toml --training.dataset_path data/stories_bin

The input is anything ``[training] dataset_path`` reads locally (.txt, JSON lines, Parquet, a file
or a folder). Documents are encoded exactly as the trainer does (``[bos] + tokens + [eos]``) and
written in order to ``shard-00000.bin``, ``shard-00001.bin``, ...; a shard is closed at the first
document end after ``--shard-tokens`` tokens, so no document is split between shards. The format
is in ``components/dataloader.py`` (:func:`write_token_shard`); each shard records the vocabulary
size, and training refuses shards made for a tokenizer of another size.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from components.dataloader import dataset_files, iter_documents, write_token_shard  # noqa: E402
from components.tokenizer import Tokenizer, build_tokenizer  # noqa: E402


def pretokenize(dataset_path: str | Path, tokenizer: Tokenizer, out_dir: str | Path, text_field: str = "text",
                shard_tokens: int = 100_000_000, docs_per_batch: int = 1024) -> list[Path]:
    """Write the shards; returns their paths in order."""
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    files = dataset_files(dataset_path)
    if any(f.suffix == ".bin" for f in files):
        raise ValueError(f"{dataset_path} is already pre-tokenized")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("shard-*.bin")):
        raise FileExistsError(f"{out} already holds shards; remove them or choose another --out")
    paths: list[Path] = []
    pending: list[np.ndarray] = []
    pending_len = 0

    def flush() -> None:
        nonlocal pending, pending_len
        path = out / f"shard-{len(paths):05d}.bin"
        write_token_shard(path, np.concatenate(pending) if pending else np.zeros(0, np.int64), tokenizer.vocab_size)
        paths.append(path)
        pending, pending_len = [], 0

    docs = iter_documents(files, text_field)
    encode = getattr(tokenizer, "encode_batch", None)
    while batch := list(itertools.islice(docs, docs_per_batch)):
        ids = encode(batch, bos=True, eos=True) if encode else [tokenizer.encode(d) for d in batch]
        for doc_ids in ids:
            pending.append(np.asarray(doc_ids, dtype=np.int64))
            pending_len += len(doc_ids)
            if pending_len >= shard_tokens:
                flush()
    if pending or not paths:
        flush()
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="a .model, a tokenizer.json or a folder holding one")
    parser.add_argument("--dataset", required=True, help="a .txt/.jsonl/.parquet file or a folder of them")
    parser.add_argument("--out", required=True, help="output folder for shard-NNNNN.bin")
    parser.add_argument("--text-field", default="text", help="JSON-lines field / Parquet column with the text")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (at least)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    tokenizer = build_tokenizer(args.tokenizer)
    paths = pretokenize(args.dataset, tokenizer, args.out, args.text_field, args.shard_tokens)
    total = sum((p.stat().st_size - 32) // (2 if tokenizer.vocab_size <= 2**16 else 4) for p in paths)
    print(f"wrote {len(paths)} shard(s), {total:,} tokens, to {args.out} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
