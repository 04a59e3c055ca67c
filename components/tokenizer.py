"""Tokenizers: text <-> token ids.

    tokenizer = build_tokenizer(job.model.tokenizer_path)     # e.g. assets/tokenizer/tokenizer.model
    ids = tokenizer.encode("Mia had a cat.")                  # [bos, ..., eos]
    text = tokenizer.decode(ids)                              # special ids are dropped

Two formats, chosen by the file name: a sentencepiece ``.model`` (the project's own, made by
``scripts/train_tokenizer.py``, has byte fallback, so any UTF-8 text encodes without ``<unk>``) and a
Hugging Face ``tokenizer.json`` (e.g. Qwen3's, via the ``tokenizers`` package). ``tokenizer_path``
may also name a folder holding either. Byte-level tokenizers (both of those) give
``decode(encode(text, bos=False, eos=False)) == text``.

A tokenizer without a BOS token (Qwen3's) has ``bos_id == -1``; ``encode(bos=True)`` then adds none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

SUPPORTED_FORMATS = ("a sentencepiece model file ending in .model, a Hugging Face tokenizer.json, "
                     "or a folder holding one of them")


class TokenizerError(ValueError):
    """A tokenizer file that is missing pieces or cannot be read; the message names the file."""


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
            raise TokenizerError(f"could not load sentencepiece model {self.path}: {e}") from e
        # A model without these special pieces returns -1; the trainer needs real ids for them.
        for name in ("bos", "eos"):
            if getattr(self._sp, f"{name}_id")() < 0:
                raise TokenizerError(f"sentencepiece model {self.path} has no {name} piece")

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


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (the ``tokenizers`` package), e.g. Qwen3's own.

    BOS and EOS come from ``tokenizer_config.json`` beside the file (``bos_token``/``eos_token``,
    a string or ``{"content": ...}``) when there is one, else from the well-known special tokens
    the vocabulary holds. Qwen3 defines no BOS: ``bos_id`` is then -1 and ``encode(bos=True)`` adds
    nothing, so documents are separated by EOS alone. The tokenizer's own post-processor (which
    may add special tokens) is bypassed: the trainer decides where BOS/EOS go.
    """

    # Tried in order when tokenizer_config.json does not name the token (or is absent).
    _EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
    _BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]")

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise TokenizerError(f"{path}: a Hugging Face tokenizer.json needs the `tokenizers` package: "
                                 f"pip install tokenizers (or the project's \".[hf]\" extra)") from None
        self.path = Path(path)
        try:
            self._tok = _Tokenizer.from_file(str(self.path))
        except Exception as e:  # the Rust side raises a plain Exception for any parse error
            raise TokenizerError(f"could not load Hugging Face tokenizer {self.path}: {e}") from e
        config = _read_tokenizer_config(self.path.parent / "tokenizer_config.json")
        self._eos_id = self._special_id(config, "eos_token", self._EOS_CANDIDATES)
        self._bos_id = self._special_id(config, "bos_token", self._BOS_CANDIDATES)
        self._pad_id = self._special_id(config, "pad_token", ())
        if self._eos_id < 0:
            raise TokenizerError(
                f"Hugging Face tokenizer {self.path} has no EOS token: documents need one to be "
                f"separated. Put a tokenizer_config.json with \"eos_token\" beside it, or use a tokenizer "
                f"with one of {', '.join(self._EOS_CANDIDATES)}")

    def _special_id(self, config: dict, key: str, candidates: tuple[str, ...]) -> int:
        if key in config:
            value = config[key]
            if isinstance(value, dict):
                value = value.get("content")
            if value is None:  # an explicit null: the tokenizer has no such token (Qwen3's BOS)
                return -1
            token_id = self._tok.token_to_id(str(value))
            if token_id is None:
                raise TokenizerError(f"{self.path.parent / 'tokenizer_config.json'}: {key} {value!r} is not in "
                                 f"the vocabulary of {self.path}")
            return token_id
        for name in candidates:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return -1

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int:
        """The BOS id, or -1 if the tokenizer has none (Qwen3)."""
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    def _wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        return [self._bos_id] * (bos and self._bos_id >= 0) + ids + [self._eos_id] * eos

    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
        return self._wrap(self._tok.encode(text, add_special_tokens=False).ids, bos, eos)

    def encode_batch(self, texts: Sequence[str], *, bos: bool = True, eos: bool = True) -> list[list[int]]:
        """``[encode(t) for t in texts]``, run in parallel by the Rust library."""
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [self._wrap(e.ids, bos, eos) for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return (f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id})")


def _read_tokenizer_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise TokenizerError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def build_tokenizer(path: str | Path) -> Tokenizer:
    """Load the tokenizer at ``path`` (``[model] tokenizer_path``): a sentencepiece ``.model`` file, a
    Hugging Face ``tokenizer.json``, or a folder holding one of them (tokenizer.json preferred)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"tokenizer file not found: {p} (set by [model] tokenizer_path; the project's own "
            f"tokenizer is assets/tokenizer/tokenizer.model, made by scripts/train_tokenizer.py)"
        )
    if p.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (p / name).is_file():
                return build_tokenizer(p / name)
        raise TokenizerError(f"folder {p} ([model] tokenizer_path) holds neither tokenizer.json nor tokenizer.model. "
                         f"Supported formats: {SUPPORTED_FORMATS}")
    if p.suffix == ".json":
        return HFTokenizer(p)
    if p.suffix == ".model":
        return SentencePieceTokenizer(p)
    raise TokenizerError(f"unsupported tokenizer file {p} ([model] tokenizer_path). "
                     f"Supported formats: {SUPPORTED_FORMATS}")
