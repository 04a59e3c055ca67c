"""Tokenizers: text <-> token ids.

    tokenizer = build_tokenizer(job.model.tokenizer_path)     # e.g. assets/tokenizer/tokenizer.model
    ids = tokenizer.encode("Mia had a cat.")                  # [bos, ..., eos]
    text = tokenizer.decode(ids)                              # special ids are dropped

Only sentencepiece ``.model`` files are supported for now. The project's own model
(``scripts/train_tokenizer.py``) has byte fallback, so any UTF-8 text encodes without ``<unk>`` and
``decode(encode(text, bos=False, eos=False)) == text``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

SUPPORTED_FORMATS = "a sentencepiece model file ending in .model"


@runtime_checkable
class Tokenizer(Protocol):
    """What the trainer needs from a tokenizer. Ids are plain Python ints in [0, vocab_size)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def bos_id(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class SentencePieceTokenizer:
    """A sentencepiece model (BPE or unigram) loaded from a ``.model`` file."""

    def __init__(self, path: str | Path):
        import sentencepiece as spm  # imported here so the module is importable without it

        self.path = Path(path)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (RuntimeError, OSError) as e:
            raise ValueError(f"could not load sentencepiece model {self.path}: {e}") from e
        # A model without these special pieces returns -1; the trainer needs real ids for them.
        for name in ("bos", "eos"):
            if getattr(self._sp, f"{name}_id")() < 0:
                raise ValueError(f"sentencepiece model {self.path} has no {name} piece")

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def pad_id(self) -> int:
        """The pad id, or -1 if the model defines none (the project's model uses 0)."""
        return self._sp.pad_id()

    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
        return self._sp.encode(text, add_bos=bos, add_eos=eos)

    def encode_batch(self, texts: Sequence[str], *, bos: bool = True, eos: bool = True) -> list[list[int]]:
        """``[encode(t) for t in texts]``, done in C++ in one call (about twice as fast)."""
        return self._sp.encode(list(texts), add_bos=bos, add_eos=eos)

    def decode(self, ids: Sequence[int]) -> str:
        # sentencepiece drops control pieces (bos/eos/pad) when decoding.
        return self._sp.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def build_tokenizer(path: str | Path) -> Tokenizer:
    """Load the tokenizer at ``path`` (``[model] tokenizer_path``), choosing the format by file name."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"tokenizer file not found: {p} (set by [model] tokenizer_path; the project's own "
            f"tokenizer is assets/tokenizer/tokenizer.model, made by scripts/train_tokenizer.py)"
        )
    if p.name == "tokenizer.json" or (p.is_dir() and (p / "tokenizer.json").exists()):
        raise NotImplementedError(
            f"{p}: Hugging Face tokenizers (tokenizer.json) are not supported yet (a later issue adds "
            f"them); use a sentencepiece .model file for [model] tokenizer_path"
        )
    if p.is_dir():
        raise ValueError(f"{p} is a directory; [model] tokenizer_path must name a file. "
                         f"Supported formats: {SUPPORTED_FORMATS}")
    if p.suffix == ".model":
        return SentencePieceTokenizer(p)
    raise ValueError(f"unsupported tokenizer file {p} ([model] tokenizer_path). "
                     f"Supported formats: {SUPPORTED_FORMATS}")
