"""Tokenize a text dataset once into memory-mapped ``.bin`` shards, so training starts at once and
never holds the corpus in memory.

    python scripts/pretokenize.py --tokenizer assets/tokenizer/tokenizer.model \
        --dataset assets/data/stories --out data/stories_bin [--text-field text] [--shard-tokens 100000000] \
        [--overwrite]
    python train.py --config train_configs/debug_model.toml --training.dataset_path data/stories_bin

The input is anything ``[training] dataset_path`` reads locally (.txt, JSON lines, Parquet, a file
or a folder). Documents are encoded exactly as the trainer does (``[bos] + tokens + [eos]``) and
written in order to ``shard-00000.bin``, ``shard-00001.bin``, ...; a shard is closed at the first
document end after ``--shard-tokens`` tokens, so no document is split between shards. The format
is in ``components/dataloader.py`` (:func:`write_token_shard`); each shard records the vocabulary
size, and training refuses shards made for a tokenizer of another size.

Progress is printed every few seconds. Problems (a missing input, a broken JSON line, an output
folder that already holds shards: ``--overwrite`` replaces them) stop the script with one
``error: ...`` line and exit status 2; the shards of a run that stops are removed.
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

from components.dataloader import (DataError, TokenizeProgress, dataset_files, encode_documents,  # noqa: E402
                                   iter_documents, write_token_shard)
from components.tokenizer import Tokenizer, TokenizerError, build_tokenizer  # noqa: E402


def pretokenize(dataset_path: str | Path, tokenizer: Tokenizer, out_dir: str | Path, text_field: str = "text",
                shard_tokens: int = 100_000_000, docs_per_batch: int = 1024, overwrite: bool = False,
                log=None) -> list[Path]:
    """Write the shards; returns their paths in order. ``overwrite`` first removes the shards
    ``out_dir`` already holds (else they stop the run); ``log`` gets the progress lines. On an
    error (a broken input line, Ctrl-C) the shards written so far are removed again."""
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens must be >= 1, got {shard_tokens}")
    files = dataset_files(dataset_path)
    if any(f.suffix == ".bin" for f in files):
        raise DataError(f"{dataset_path} is already pre-tokenized (it holds .bin shards): point --dataset at text files")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file; choose a folder")
    old = sorted(out.glob("shard-*.bin"))
    if old and not overwrite:
        raise FileExistsError(f"{out} already holds {len(old)} shard(s) ({old[0].name}, ...); pass --overwrite to "
                              f"replace them, or choose another --out")
    for f in old:
        f.unlink()
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    pending: list[np.ndarray] = []
    pending_len = 0

    def flush() -> None:
        nonlocal pending, pending_len
        path = out / f"shard-{len(paths):05d}.bin"
        write_token_shard(path, np.concatenate(pending) if pending else np.zeros(0, np.int64), tokenizer.vocab_size)
        paths.append(path)
        pending, pending_len = [], 0

    progress = TokenizeProgress(str(dataset_path), sum(f.stat().st_size for f in files), log)
    docs = iter_documents(files, text_field, progress.add_bytes)
    try:
        while batch := list(itertools.islice(docs, docs_per_batch)):
            for doc_ids in encode_documents(batch, tokenizer):
                pending.append(np.asarray(doc_ids, dtype=np.int64))
                pending_len += len(doc_ids)
                progress.add_tokens(len(doc_ids))
                if pending_len >= shard_tokens:
                    flush()
        if pending or not paths:
            flush()
    except BaseException:
        for path in paths:  # a half-written dataset would pass for a whole one
            path.unlink(missing_ok=True)
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    progress.finish()
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="a .model, a tokenizer.json or a folder holding one")
    parser.add_argument("--dataset", required=True, help="a .txt/.jsonl/.parquet file or a folder of them")
    parser.add_argument("--out", required=True, help="output folder for shard-NNNNN.bin")
    parser.add_argument("--overwrite", action="store_true", help="replace the shards --out already holds")
    parser.add_argument("--text-field", default="text", help="JSON-lines field / Parquet column with the text")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (at least)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        for flag, value in (("--tokenizer", args.tokenizer), ("--dataset", args.dataset)):
            if not Path(value).exists():
                raise FileNotFoundError(f"{flag} {value}: not found ({Path(value).resolve()})")
        tokenizer = build_tokenizer(args.tokenizer)
        paths = pretokenize(args.dataset, tokenizer, args.out, args.text_field, args.shard_tokens,
                            overwrite=args.overwrite, log=lambda line: print(line, flush=True))
    except (FileNotFoundError, FileExistsError, DataError, TokenizerError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    total = sum((p.stat().st_size - 32) // (2 if tokenizer.vocab_size <= 2**16 else 4) for p in paths)
    print(f"wrote {len(paths)} shard(s), {total:,} tokens, to {args.out} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
