"""Packed language-model batches from local files, pre-tokenized shards or a streamed Hugging Face
dataset.

    loader = build_dataloader("assets/data/stories", tokenizer, seq_len=256, local_batch_size=8,
                              dp_rank=rank, dp_world_size=world, seed=0)
    input_ids_BL, labels_BL = next(loader)       # int64 [B, L]; labels_BL = input_ids shifted by one

``dataset_path`` (``[training] dataset_path``) is one of:
  * a file, or a folder searched recursively (files read in sorted order of their path), of
    - ``.txt``: every non-empty line is one document (stripped of surrounding whitespace);
    - ``.jsonl`` / ``.ndjson`` / ``.json`` (JSON lines): one JSON object per line, the document in
      its ``text_field`` (``[training] dataset_text_field``); blank lines are skipped;
    - ``.parquet``: one document per row, in the column ``text_field``;
    Text formats may be mixed in one folder; other files are ignored.
  * pre-tokenized ``.bin`` shards written by ``scripts/pretokenize.py`` (a file or a folder of them,
    not mixed with text files): memory-mapped, never loaded whole (see :func:`read_token_shard`).
  * ``hf:<name>``: a Hugging Face dataset streamed with the ``datasets`` package (needs a network or
    its cache), see :class:`StreamingTextDataLoader`.

How local data is packed (:class:`PackedTextDataLoader`):
  * Each document is encoded as ``[bos] + tokens + [eos]`` (no ``bos`` if the tokenizer has none,
    e.g. Qwen3's) and all are concatenated, in order, into one stream. Text is tokenized once, at
    construction; ``.bin`` shards already hold such streams, one per shard.
  * Each stream is cut into ``len(stream) // (L + 1)`` samples of ``L + 1`` tokens; the remainder
    is dropped. Documents run across sample boundaries (packing, no padding, no attention mask).
  * Sample ``i`` (numbered over all streams) belongs to data-parallel rank ``i % dp_world_size``, so
    ranks never share a sample.
  * Every epoch, a rank visits its samples in an order shuffled from ``(seed, epoch)`` (in stream
    order with ``[training] shuffle = false``), in batches of ``B = local_batch_size``; a last
    partial batch is dropped, then the next epoch starts. All ranks have the same number of batches per epoch only if their sample counts agree to within B;
    the loader is infinite, so the train loop's step count decides when to stop.

Both loaders are stateful for checkpointing: ``state_dict()`` holds the position, and
``load_state_dict`` makes a fresh loader continue with exactly the batches the saved one would have
produced next.
"""

from __future__ import annotations

import itertools
import json
import struct
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from components.tokenizer import Tokenizer

TEXT_SUFFIXES = {".txt": "text", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
TOKEN_SUFFIX = ".bin"
HF_PREFIX = "hf:"

# Pre-tokenized shard: a 32-byte header, then num_tokens little-endian unsigned ints of itemsize bytes.
SHARD_MAGIC = b"QMOETOK1"
_SHARD_HEADER = struct.Struct("<8sIIQQ")  # magic, itemsize (2 or 4), reserved, vocab_size, num_tokens


class DataError(ValueError):
    """A problem with the dataset (path, file contents or size), reported to the user as one message."""


class PackedTextDataLoader:
    """Infinite iterator of ``(input_ids_BL, labels_BL)`` over one rank's share of token streams.

    Args:
        tokens: the packed stream, a 1-D integer tensor or numpy array (a ``np.memmap`` stays on
            disk), or a list of them (shards: samples never straddle two).
        seq_len: L, tokens per sample fed to the model (each sample holds L + 1 tokens).
        local_batch_size: B, samples per batch on this rank.
        dp_rank, dp_world_size: this rank's index among the data-parallel ranks, and their number.
        seed: together with the epoch number, fixes the sample order.
        source: where the tokens came from, for error messages.
        shuffle: False visits the samples in stream order every epoch (upstream TorchTitan's order).
    """

    def __init__(self, tokens: torch.Tensor | np.ndarray | Sequence[torch.Tensor | np.ndarray], seq_len: int,
                 local_batch_size: int, dp_rank: int = 0, dp_world_size: int = 1, seed: int = 0,
                 source: str = "<tokens>", shuffle: bool = True):
        _check_sizes(seq_len, local_batch_size, dp_rank, dp_world_size, seed)
        shards = list(tokens) if isinstance(tokens, (list, tuple)) else [tokens]
        self._shards = []
        for s in shards:
            arr = s.numpy() if isinstance(s, torch.Tensor) else s
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise ValueError(f"tokens must be 1-D integer arrays, got {tuple(arr.shape)} {arr.dtype}")
            self._shards.append(arr)
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.seed = seed
        self.shuffle = shuffle

        S = seq_len + 1
        self.num_tokens = sum(len(a) for a in self._shards)
        # First global sample id of each shard; sample i lives in shard searchsorted(starts, i) - 1.
        counts = [len(a) // S for a in self._shards]
        self._shard_starts = np.cumsum([0] + counts)
        self.num_samples = int(self._shard_starts[-1])
        # This rank's samples are the global ids dp_rank, dp_rank + W, ...; it needs B of them.
        needed_samples = dp_rank + (local_batch_size - 1) * dp_world_size + 1
        if self.num_samples < needed_samples:
            raise DataError(
                f"dataset {source} is too small: it has {self.num_tokens} tokens, which make "
                f"{self.num_samples} samples of seq_len + 1 = {S} tokens; rank {dp_rank} of "
                f"{dp_world_size} needs at least {needed_samples * S} tokens ({needed_samples} samples) "
                f"for one batch of local_batch_size = {local_batch_size}. Use a larger corpus or a "
                f"smaller seq_len / local_batch_size."
            )
        self._rank_ids = torch.arange(dp_rank, self.num_samples, dp_world_size)
        self.batches_per_epoch = len(self._rank_ids) // local_batch_size

        self._epoch = 0
        self._batch_in_epoch = 0  # batches already returned in this epoch
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        """This rank's global sample ids in the order epoch ``epoch`` visits them."""
        if not self.shuffle:
            return self._rank_ids.clone()
        # SeedSequence-based: a stable, well-mixed stream for every (seed, epoch) pair.
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self._rank_ids))
        return self._rank_ids[torch.from_numpy(perm)]

    def _sample(self, i: int) -> np.ndarray:
        """Global sample ``i``: its L + 1 tokens, int64."""
        shard = int(np.searchsorted(self._shard_starts, i, side="right")) - 1
        start = (i - int(self._shard_starts[shard])) * (self.seq_len + 1)
        return np.asarray(self._shards[shard][start: start + self.seq_len + 1], dtype=np.int64)

    def __iter__(self) -> PackedTextDataLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        B = self.local_batch_size
        start = self._batch_in_epoch * B
        ids_B = self._order[start: start + B].tolist()
        rows_BS = torch.from_numpy(np.stack([self._sample(i) for i in ids_B]))
        input_ids_BL = rows_BS[:, :-1].contiguous()
        labels_BL = rows_BS[:, 1:].contiguous()

        self._batch_in_epoch += 1
        if self._batch_in_epoch == self.batches_per_epoch:
            # Roll over now, so that a state saved after the last batch already points at the next epoch.
            self._epoch += 1
            self._batch_in_epoch = 0
            self._order = self._epoch_order(self._epoch)
        return input_ids_BL, labels_BL

    @property
    def epoch(self) -> int:
        return self._epoch

    # --- checkpointing -------------------------------------------------------------------------

    def _identity(self) -> dict[str, int]:
        return {
            "num_tokens": self.num_tokens, "num_samples": self.num_samples, "seq_len": self.seq_len,
            "local_batch_size": self.local_batch_size, "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size, "seed": self.seed,
        }

    def state_dict(self) -> dict[str, int]:
        """Plain ints: the position (``epoch``, ``batch_in_epoch``) and what it is a position in."""
        return {"epoch": self._epoch, "batch_in_epoch": self._batch_in_epoch, **self._identity()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a saved position; the data, sizes, rank layout and seed must be the same."""
        expected = self._identity()
        _check_identity(state_dict, expected, ("epoch", "batch_in_epoch"))
        epoch, batch = int(state_dict["epoch"]), int(state_dict["batch_in_epoch"])
        if epoch < 0 or not 0 <= batch < self.batches_per_epoch:
            raise ValueError(f"dataloader state out of range: epoch {epoch}, batch_in_epoch {batch} "
                             f"(batches per epoch: {self.batches_per_epoch})")
        self._epoch, self._batch_in_epoch = epoch, batch
        self._order = self._epoch_order(epoch)

    def __repr__(self) -> str:
        return (f"PackedTextDataLoader(tokens={self.num_tokens}, samples={self.num_samples}, "
                f"seq_len={self.seq_len}, local_batch_size={self.local_batch_size}, "
                f"rank={self.dp_rank}/{self.dp_world_size}, batches_per_epoch={self.batches_per_epoch})")


class StreamingTextDataLoader:
    """Infinite iterator of ``(input_ids_BL, labels_BL)`` over a stream of documents that is read,
    not held: a Hugging Face dataset with ``streaming=True``, or any re-openable iterable.

    Document ``j`` of the stream belongs to rank ``j % dp_world_size`` (so no document, hence no
    sample, is on two ranks). A rank tokenizes its documents into a buffer and cuts every batch of
    ``B`` samples of ``L + 1`` tokens from its front, in stream order (no shuffle: a stream cannot
    be permuted). When the stream ends, the tokens left (less than a batch) are dropped and the
    next epoch reopens it.

    Args:
        open_documents: returns a fresh iterator over the documents (str), from the start.
        tokenizer: encodes documents as ``[bos] + tokens + [eos]``.
        seq_len, local_batch_size, dp_rank, dp_world_size: as for :class:`PackedTextDataLoader`.
        source: the dataset's name, for messages and the state's identity.
    """

    def __init__(self, open_documents: Callable[[], Iterable[str]], tokenizer: Tokenizer, seq_len: int,
                 local_batch_size: int, dp_rank: int = 0, dp_world_size: int = 1, source: str = "<stream>"):
        _check_sizes(seq_len, local_batch_size, dp_rank, dp_world_size, 0)
        self.open_documents = open_documents
        self.tokenizer = tokenizer
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.dp_rank, self.dp_world_size, self.source = dp_rank, dp_world_size, source
        self._epoch = 0
        self._docs_read = 0  # documents of the stream (all ranks') consumed in this epoch
        self._buffer: list[int] = []
        self._docs: Iterator[str] | None = None
        self._batches_this_epoch = 0

    def _open(self) -> Iterator[str]:
        # Skipping re-reads the stream's start; it happens once per resume, not per step.
        return itertools.islice(iter(self.open_documents()), self._docs_read, None)

    def __iter__(self) -> StreamingTextDataLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        need = self.local_batch_size * (self.seq_len + 1)
        while len(self._buffer) < need:
            if self._docs is None:
                self._docs = self._open()
            doc = next(self._docs, None)
            if doc is None:  # end of the stream: drop the partial batch, start the next epoch
                if self._batches_this_epoch == 0 and self._docs_read == 0:
                    raise DataError(f"dataset {self.source} is empty")
                if self._batches_this_epoch == 0:
                    raise DataError(
                        f"dataset {self.source} is too small: rank {self.dp_rank} of {self.dp_world_size} got "
                        f"{len(self._buffer)} tokens from a whole pass, less than one batch of "
                        f"local_batch_size x (seq_len + 1) = {need}")
                self._epoch += 1
                self._docs_read, self._buffer, self._docs, self._batches_this_epoch = 0, [], None, 0
                continue
            j = self._docs_read
            self._docs_read += 1
            if j % self.dp_world_size == self.dp_rank and doc.strip():
                self._buffer.extend(self.tokenizer.encode(doc, bos=True, eos=True))
        rows_BS = torch.tensor(self._buffer[:need], dtype=torch.int64).view(self.local_batch_size, self.seq_len + 1)
        del self._buffer[:need]
        self._batches_this_epoch += 1
        return rows_BS[:, :-1].contiguous(), rows_BS[:, 1:].contiguous()

    @property
    def epoch(self) -> int:
        return self._epoch

    def _identity(self) -> dict[str, Any]:
        return {"source": self.source, "seq_len": self.seq_len, "local_batch_size": self.local_batch_size,
                "dp_rank": self.dp_rank, "dp_world_size": self.dp_world_size}

    def state_dict(self) -> dict[str, Any]:
        """The position: epoch, documents consumed and the tokenized leftovers not yet batched."""
        return {"epoch": self._epoch, "docs_read": self._docs_read, "batches_this_epoch": self._batches_this_epoch,
                "buffer": list(self._buffer), **self._identity()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _check_identity(state_dict, self._identity(), ("epoch", "docs_read", "batches_this_epoch", "buffer"))
        self._epoch, self._docs_read = int(state_dict["epoch"]), int(state_dict["docs_read"])
        self._batches_this_epoch = int(state_dict["batches_this_epoch"])
        self._buffer = [int(t) for t in state_dict["buffer"]]
        self._docs = None  # reopened, skipping docs_read documents, on the next batch

    def __repr__(self) -> str:
        return (f"StreamingTextDataLoader({self.source!r}, seq_len={self.seq_len}, "
                f"local_batch_size={self.local_batch_size}, rank={self.dp_rank}/{self.dp_world_size})")


def _check_identity(state_dict: dict[str, Any], expected: dict[str, Any], position_keys: tuple[str, ...]) -> None:
    missing = [k for k in (*position_keys, *expected) if k not in state_dict]
    if missing:
        raise ValueError(f"dataloader state is missing {missing}")
    mismatched = {k: (state_dict[k], v) for k, v in expected.items() if type(v)(state_dict[k]) != v}
    if mismatched:
        detail = ", ".join(f"{k}: saved {saved}, now {now}" for k, (saved, now) in mismatched.items())
        raise ValueError(f"dataloader state does not match this loader ({detail}); resuming would "
                         f"replay or skip data")


def _check_sizes(seq_len: int, local_batch_size: int, dp_rank: int, dp_world_size: int, seed: int) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if local_batch_size < 1:
        raise ValueError(f"local_batch_size must be >= 1, got {local_batch_size}")
    if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"need 0 <= dp_rank < dp_world_size, got dp_rank={dp_rank}, dp_world_size={dp_world_size}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")


# --- reading files -------------------------------------------------------------------------------


def dataset_files(dataset_path: str | Path) -> list[Path]:
    """The files that make up a local dataset, in the order their documents are read."""
    p = Path(dataset_path)
    if not p.exists():
        raise FileNotFoundError(f"dataset not found: {p} (set by [training] dataset_path; a Hugging Face "
                                f"dataset is written {HF_PREFIX}<name>)")
    supported = (*TEXT_SUFFIXES, TOKEN_SUFFIX)
    if p.is_file():
        if p.suffix not in supported:
            raise DataError(f"dataset file {p} ([training] dataset_path) has an unsupported extension; "
                            f"supported: {', '.join(supported)}")
        return [p]
    files = sorted((f for f in p.rglob("*") if f.is_file() and f.suffix in supported),
                   key=lambda f: f.relative_to(p).as_posix())
    if not files:
        raise DataError(f"dataset folder {p} ([training] dataset_path) has no .txt files "
                        f"(nor {', '.join(s for s in supported if s != '.txt')} files)")
    kinds = {f.suffix == TOKEN_SUFFIX for f in files}
    if len(kinds) > 1:
        raise DataError(f"dataset folder {p} mixes pre-tokenized {TOKEN_SUFFIX} shards with text files; "
                        f"point [training] dataset_path at one kind")
    return files


text_files = dataset_files  # the name before other formats existed


def _iter_jsonl(path: Path, text_field: str, on_bytes: Callable[[int], None]) -> Iterator[str]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            on_bytes(len(raw))
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid UTF-8 ({e.reason} at byte {e.start} of the line)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not a JSON object ({e.msg}); JSON-lines files hold one "
                                f"object per line") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            if text_field not in record:
                raise DataError(f"{path}:{lineno}: no {text_field!r} field (keys: {', '.join(record)}); set "
                                f"[training] dataset_text_field to the field that holds the text")
            text = record[text_field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise DataError(f"{path}:{lineno}: field {text_field!r} is {type(text).__name__}, not a string")
            if text.strip():
                yield text


def _iter_parquet(path: Path, text_field: str, on_bytes: Callable[[int], None]) -> Iterator[str]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"{path}: reading Parquet needs the pyarrow package: pip install pyarrow") from e
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"dataset file {path} is not a readable Parquet file: {e}") from None
    names = pf.schema_arrow.names
    if text_field not in names:
        raise DataError(f"{path}: no {text_field!r} column (columns: {', '.join(names)}); set "
                        f"[training] dataset_text_field to the column that holds the text")
    ftype = pf.schema_arrow.field(text_field).type
    if not (pa.types.is_string(ftype) or pa.types.is_large_string(ftype)):
        raise DataError(f"{path}: column {text_field!r} is {ftype}, not a string column")
    size, groups = path.stat().st_size, pf.num_row_groups
    for i in range(groups):  # one row group at a time: large files stay out of memory
        on_bytes(size * (i + 1) // groups - size * i // groups)  # the file's share of this group
        for text in pf.read_row_group(i, columns=[text_field]).column(0).to_pylist():
            if text is not None and text.strip():
                yield text


def _iter_txt(path: Path, on_bytes: Callable[[int], None]) -> Iterator[str]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{line}: not valid UTF-8 ({e.reason}); the dataset's text files must be UTF-8") from None
    lines = text.split("\n")
    bytes_per_line = len(raw) / max(len(lines), 1)  # an average is enough for a progress line
    for i, line in enumerate(lines):
        if i % 1024 == 0:
            on_bytes(round(bytes_per_line * min(1024, len(lines) - i)))
        line = line.strip()
        if line:
            yield line


def _ignore(nbytes: int) -> None:
    pass


def iter_documents(files: Sequence[Path], text_field: str = "text",
                   on_bytes: Callable[[int], None] = _ignore) -> Iterator[str]:
    """Every document of every (text-format) file, in order; ``on_bytes(n)`` is told as the files'
    bytes are read (for progress lines)."""
    for f in files:
        kind = TEXT_SUFFIXES.get(f.suffix)
        if kind == "text":
            yield from _iter_txt(f, on_bytes)
        elif kind == "jsonl":
            yield from _iter_jsonl(f, text_field, on_bytes)
        elif kind == "parquet":
            yield from _iter_parquet(f, text_field, on_bytes)
        else:
            raise DataError(f"{f} is not a text-format dataset file")


def read_documents(files: Sequence[Path], text_field: str = "text") -> list[str]:
    return list(iter_documents(files, text_field))


def encode_documents(docs: Sequence[str], tokenizer: Tokenizer) -> list[list[int]]:
    """``[bos] + encode(doc) + [eos]`` for each document (in one batched call where the tokenizer has one)."""
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch(docs, bos=True, eos=True)
    return [tokenizer.encode(d, bos=True, eos=True) for d in docs]


def tokenize_documents(docs: Iterable[str], tokenizer: Tokenizer, progress: TokenizeProgress | None = None,
                       docs_per_batch: int = 4096) -> torch.Tensor:
    """``[bos] + encode(doc) + [eos]`` for every document, concatenated: int32 [T]. Encoded in
    batches of ``docs_per_batch`` documents, each reported to ``progress``."""
    parts = []
    docs = iter(docs)
    while batch := list(itertools.islice(docs, docs_per_batch)):
        ids = encode_documents(batch, tokenizer)
        total = sum(len(x) for x in ids)
        parts.append(np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=total))
        if progress is not None:
            progress.add_tokens(total)
    return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32))


class TokenizeProgress:
    """Progress of a long tokenization, as lines: ``tokenizing <what> (N MB) ...`` at the start,
    one every ``every_s`` seconds while it runs, and ``tokenized ...`` with the time at the end.
    ``log`` None prints nothing (the counts are still kept)."""

    def __init__(self, what: str, total_bytes: int, log: Callable[[str], None] | None, every_s: float = 5.0):
        self.what, self.total_bytes, self.log, self.every_s = what, total_bytes, log, every_s
        self.bytes = self.tokens = 0
        self.start = self.last = time.perf_counter()
        self.seconds = 0.0
        if log is not None:
            log(f"tokenizing {what} ({_mb(total_bytes)}) ...")

    def add_bytes(self, nbytes: int) -> None:
        self.bytes += nbytes

    def add_tokens(self, ntokens: int) -> None:
        self.tokens += ntokens
        now = time.perf_counter()
        if self.log is not None and now - self.last >= self.every_s:
            self.last = now
            done = min(self.bytes, self.total_bytes)
            self.log(f"tokenizing: {_mb(done)} of {_mb(self.total_bytes)} "
                     f"({100 * done / max(self.total_bytes, 1):.0f}%), {self.tokens:,} tokens, "
                     f"{now - self.start:.0f}s")

    def finish(self) -> float:
        """Ends the progress (the last line); returns the seconds it took."""
        self.seconds = time.perf_counter() - self.start
        if self.log is not None:
            self.log(f"tokenized {self.what}: {self.tokens:,} tokens in {self.seconds:.1f}s")
        return self.seconds


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:,.1f} MB"


# --- pre-tokenized shards ------------------------------------------------------------------------


def write_token_shard(path: str | Path, tokens: np.ndarray, vocab_size: int) -> None:
    """Write one pre-tokenized shard: header + tokens as uint16 (vocab <= 65536) or uint32."""
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got [{tokens.min()}, {tokens.max()}]")
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("wb") as f:
        f.write(_SHARD_HEADER.pack(SHARD_MAGIC, np.dtype(dtype).itemsize, 0, vocab_size, tokens.size))
        f.write(tokens.astype(dtype).tobytes())
    tmp.replace(path)  # a shard is whole or absent


def read_token_shard(path: str | Path) -> tuple[np.ndarray, int]:
    """(tokens memory-mapped read-only, vocab size the shard was written for)."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(_SHARD_HEADER.size)
    if len(head) < _SHARD_HEADER.size or head[:8] != SHARD_MAGIC:
        raise DataError(f"{path} is not a pre-tokenized shard (no {SHARD_MAGIC!r} header); write shards "
                        f"with scripts/pretokenize.py")
    _, itemsize, _, vocab_size, num_tokens = _SHARD_HEADER.unpack(head)
    if itemsize not in (2, 4):
        raise DataError(f"{path}: token size {itemsize} bytes in the header; expected 2 or 4")
    if size != _SHARD_HEADER.size + itemsize * num_tokens:
        raise DataError(f"{path} is truncated or corrupt: the header announces {num_tokens} tokens "
                        f"({_SHARD_HEADER.size + itemsize * num_tokens} bytes), the file has {size} bytes")
    if num_tokens == 0:
        return np.zeros(0, dtype=np.uint16), vocab_size
    dtype = np.uint16 if itemsize == 2 else np.uint32
    return np.memmap(path, dtype=dtype, mode="r", offset=_SHARD_HEADER.size, shape=(num_tokens,)), vocab_size


# --- entry point ---------------------------------------------------------------------------------


def _open_hf_dataset(spec: str, text_field: str, config_name: str, split: str) -> Callable[[], Iterator[str]]:
    name = spec[len(HF_PREFIX):]
    try:
        import datasets
    except ImportError:
        raise DataError(f"[training] dataset_path = {spec!r} streams a Hugging Face dataset, which needs the "
                        f"`datasets` package (pip install datasets) and a network connection; or download "
                        f"it once and point dataset_path at its .jsonl/.parquet files") from None

    def load():
        try:
            return datasets.load_dataset(name, config_name or None, split=split, streaming=True)
        except Exception as e:  # network, unknown name, unknown split: all end the same way for the user
            raise DataError(f"could not open the Hugging Face dataset {name!r} (config {config_name or None!r}, "
                            f"split {split!r}): {type(e).__name__}: {e}. Streaming needs a network "
                            f"connection; offline, point [training] dataset_path at local files") from None

    load()  # fail at start, not at the first step

    def open_documents() -> Iterator[str]:
        for i, record in enumerate(load()):
            if text_field not in record:
                raise DataError(f"{spec}: record {i} has no {text_field!r} field (fields: {', '.join(record)}); "
                                f"set [training] dataset_text_field")
            text = record[text_field]
            if isinstance(text, str):
                yield text
            elif text is not None:
                raise DataError(f"{spec}: record {i} field {text_field!r} is {type(text).__name__}, not a string")
    return open_documents


def build_dataloader(dataset_path: str, tokenizer: Tokenizer, seq_len: int, local_batch_size: int,
                     dp_rank: int = 0, dp_world_size: int = 1, seed: int = 0, text_field: str = "text",
                     hf_config: str = "", hf_split: str = "train", log: Callable[[str], None] | None = None,
                     shuffle: bool = True) -> PackedTextDataLoader | StreamingTextDataLoader:
    """The loader for ``dataset_path`` (``[training] dataset_path``) on one DP rank: local files
    are read and tokenized now (or memory-mapped, for ``.bin`` shards); ``hf:<name>`` streams.
    ``log`` (e.g. ``print`` on rank 0) gets the tokenizing progress lines (:class:`TokenizeProgress`)."""
    _check_sizes(seq_len, local_batch_size, dp_rank, dp_world_size, seed)  # before the slow part
    if dataset_path.startswith(HF_PREFIX):
        open_documents = _open_hf_dataset(dataset_path, text_field, hf_config, hf_split)
        return StreamingTextDataLoader(open_documents, tokenizer, seq_len, local_batch_size, dp_rank,
                                       dp_world_size, source=dataset_path)
    files = dataset_files(dataset_path)
    if files[0].suffix == TOKEN_SUFFIX:
        shards = []
        for f in files:
            tokens, vocab_size = read_token_shard(f)
            if vocab_size != tokenizer.vocab_size:
                raise DataError(f"{f} was tokenized with a vocabulary of {vocab_size} tokens, but [model] "
                                f"tokenizer_path has {tokenizer.vocab_size}: re-run scripts/pretokenize.py "
                                f"with this tokenizer")
            shards.append(tokens)
        return PackedTextDataLoader(shards, seq_len, local_batch_size, dp_rank, dp_world_size, seed,
                                    source=str(dataset_path), shuffle=shuffle)
    progress = TokenizeProgress(str(dataset_path), sum(f.stat().st_size for f in files), log)
    tokens = tokenize_documents(iter_documents(files, text_field, progress.add_bytes), tokenizer, progress)
    progress.finish()
    return PackedTextDataLoader(tokens, seq_len, local_batch_size, dp_rank, dp_world_size, seed,
                                source=str(dataset_path), shuffle=shuffle)
