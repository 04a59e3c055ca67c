"""Packed language-model batches from local text files.

    loader = build_dataloader("assets/data/stories", tokenizer, seq_len=256, local_batch_size=8,
                              dp_rank=rank, dp_world_size=world, seed=0)
    input_ids_BL, labels_BL = next(loader)       # int64 [B, L]; labels_BL = input_ids shifted by one

How the token stream is made and cut:
  * ``dataset_path`` is a ``.txt`` file or a folder searched recursively for ``.txt`` files, read in
    sorted order of their path; every non-empty line is one document.
  * Each document is encoded as ``[bos] + tokens + [eos]`` and all are concatenated, in order, into
    one int32 stream. This happens once, at construction.
  * The stream is cut into ``N = len(stream) // (L + 1)`` samples of ``L + 1`` tokens; the remainder
    is dropped. Documents run across sample boundaries (packing, no padding, no attention mask).
  * Sample ``i`` belongs to data-parallel rank ``i % dp_world_size``, so ranks never share a sample.
  * Every epoch, a rank visits its samples in an order shuffled from ``(seed, epoch)``, in batches
    of ``B = local_batch_size``; a last partial batch is dropped, then the next epoch starts. All
    ranks have the same number of batches per epoch only if their sample counts agree to within B;
    the loader is infinite, so the train loop's step count decides when to stop.

The loader is stateful for checkpointing: ``state_dict()`` holds the epoch and the number of
batches already taken in it, and ``load_state_dict`` makes a fresh loader continue with exactly
the batches the saved one would have produced next.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from components.tokenizer import Tokenizer


class PackedTextDataLoader:
    """Infinite iterator of ``(input_ids_BL, labels_BL)`` over one rank's share of a token stream.

    Args:
        tokens: the whole packed stream, 1-D integer tensor (stored as int32).
        seq_len: L, tokens per sample fed to the model (each sample holds L + 1 tokens).
        local_batch_size: B, samples per batch on this rank.
        dp_rank, dp_world_size: this rank's index among the data-parallel ranks, and their number.
        seed: together with the epoch number, fixes the sample order.
        source: where the tokens came from, for error messages.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, local_batch_size: int, dp_rank: int = 0,
                 dp_world_size: int = 1, seed: int = 0, source: str = "<tokens>"):
        _check_sizes(seq_len, local_batch_size, dp_rank, dp_world_size, seed)
        if tokens.dim() != 1 or tokens.dtype.is_floating_point:
            raise ValueError(f"tokens must be a 1-D integer tensor, got {tuple(tokens.shape)} {tokens.dtype}")
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.seed = seed

        S = seq_len + 1
        self.num_tokens = tokens.numel()
        self.num_samples = self.num_tokens // S
        # This rank's samples are the global ids dp_rank, dp_rank + W, ...; it needs B of them.
        needed_samples = dp_rank + (local_batch_size - 1) * dp_world_size + 1
        if self.num_samples < needed_samples:
            raise ValueError(
                f"dataset {source} is too small: it has {self.num_tokens} tokens, which make "
                f"{self.num_samples} samples of seq_len + 1 = {S} tokens; rank {dp_rank} of "
                f"{dp_world_size} needs at least {needed_samples * S} tokens ({needed_samples} samples) "
                f"for one batch of local_batch_size = {local_batch_size}. Use a larger corpus or a "
                f"smaller seq_len / local_batch_size."
            )
        self._samples_NS = tokens[: self.num_samples * S].to(torch.int32).view(self.num_samples, S)
        self._rank_ids = torch.arange(dp_rank, self.num_samples, dp_world_size)
        self.batches_per_epoch = len(self._rank_ids) // local_batch_size

        self._epoch = 0
        self._batch_in_epoch = 0  # batches already returned in this epoch
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        """This rank's global sample ids in the order epoch ``epoch`` visits them."""
        # SeedSequence-based: a stable, well-mixed stream for every (seed, epoch) pair.
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self._rank_ids))
        return self._rank_ids[torch.from_numpy(perm)]

    def __iter__(self) -> PackedTextDataLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        B = self.local_batch_size
        start = self._batch_in_epoch * B
        ids_B = self._order[start: start + B]
        rows_BS = self._samples_NS[ids_B].long()
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
        missing = [k for k in ("epoch", "batch_in_epoch", *expected) if k not in state_dict]
        if missing:
            raise ValueError(f"dataloader state is missing {missing}")
        mismatched = {k: (int(state_dict[k]), v) for k, v in expected.items() if int(state_dict[k]) != v}
        if mismatched:
            detail = ", ".join(f"{k}: saved {saved}, now {now}" for k, (saved, now) in mismatched.items())
            raise ValueError(f"dataloader state does not match this loader ({detail}); resuming would "
                             f"replay or skip data")
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


def _check_sizes(seq_len: int, local_batch_size: int, dp_rank: int, dp_world_size: int, seed: int) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if local_batch_size < 1:
        raise ValueError(f"local_batch_size must be >= 1, got {local_batch_size}")
    if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"need 0 <= dp_rank < dp_world_size, got dp_rank={dp_rank}, dp_world_size={dp_world_size}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")


def text_files(dataset_path: str | Path) -> list[Path]:
    """The ``.txt`` files that make up a dataset, in the order their documents are read."""
    p = Path(dataset_path)
    if not p.exists():
        raise FileNotFoundError(f"dataset not found: {p} (set by [training] dataset_path)")
    if p.is_file():
        return [p]
    files = sorted((f for f in p.rglob("*.txt") if f.is_file()), key=lambda f: f.relative_to(p).as_posix())
    if not files:
        raise ValueError(f"dataset folder {p} ([training] dataset_path) has no .txt files")
    return files


def read_documents(files: Sequence[Path]) -> list[str]:
    """Every non-empty line of every file, stripped of surrounding whitespace, in order."""
    docs = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"dataset file {f} is not valid UTF-8: {e}") from e
        docs.extend(line.strip() for line in text.split("\n") if line.strip())
    return docs


def tokenize_documents(docs: Sequence[str], tokenizer: Tokenizer) -> torch.Tensor:
    """``[bos] + encode(doc) + [eos]`` for every document, concatenated: int32 [T]."""
    if hasattr(tokenizer, "encode_batch"):
        ids = tokenizer.encode_batch(docs, bos=True, eos=True)
    else:
        ids = [tokenizer.encode(d, bos=True, eos=True) for d in docs]
    total = sum(len(x) for x in ids)
    stream = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=total)
    return torch.from_numpy(stream)


def build_dataloader(dataset_path: str, tokenizer: Tokenizer, seq_len: int, local_batch_size: int,
                     dp_rank: int = 0, dp_world_size: int = 1, seed: int = 0) -> PackedTextDataLoader:
    """Read, tokenize and pack ``dataset_path`` (``[training] dataset_path``) for one DP rank."""
    _check_sizes(seq_len, local_batch_size, dp_rank, dp_world_size, seed)  # before the slow part
    docs = read_documents(text_files(dataset_path))
    tokens = tokenize_documents(docs, tokenizer)
    return PackedTextDataLoader(tokens, seq_len, local_batch_size, dp_rank, dp_world_size, seed,
                                source=str(dataset_path))
