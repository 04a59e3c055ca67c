"""Train the project's sentencepiece BPE tokenizer on the generated corpus.

    python scripts/make_corpus.py          # first, if assets/data/stories/corpus.txt is missing
    python scripts/train_tokenizer.py      # writes assets/tokenizer/tokenizer.model

Vocabulary: 2048 pieces, of which 4 are special (pad=0, unk=1, bos=2, eos=3) and 256 are the
byte-fallback pieces <0x00>..<0xFF>, so any UTF-8 text encodes without <unk> even though the
corpus is plain ASCII. Normalisation is the identity and whitespace is kept as written, so
``decode(encode(text)) == text``.

Training is single-threaded on the whole corpus in file order (no sentence sampling, no
shuffling), which makes the output byte-identical from run to run with the same sentencepiece
version.
"""

from __future__ import annotations

import argparse
import hashlib
import io
from pathlib import Path

import sentencepiece as spm

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = ROOT / "assets" / "data" / "stories" / "corpus.txt"
DEFAULT_OUT = ROOT / "assets" / "tokenizer" / "tokenizer.model"
VOCAB_SIZE = 2048


def train(corpus: Path, out: Path, vocab_size: int = VOCAB_SIZE) -> None:
    if not corpus.is_file():
        raise SystemExit(f"corpus not found: {corpus} (run scripts/make_corpus.py first)")
    # Lines go in through an iterator and the model comes back as bytes, rather than via
    # input=/model_prefix=, because sentencepiece records those paths inside the .model file:
    # with them the output would depend on where the repo lives (and on a temp dir's name).
    # This also means no .vocab file is ever written.
    lines = corpus.read_text(encoding="utf-8").splitlines()
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=1.0,
        pad_id=0, unk_id=1, bos_id=2, eos_id=3,
        pad_piece="<pad>", unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>",
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        # Determinism: every line, in file order, on one thread.
        input_sentence_size=0,
        shuffle_input_sentence=False,
        num_threads=1,
        max_sentence_length=1 << 16,  # documents are whole lines; none may be skipped for length
        minloglevel=2,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(model.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args()

    train(args.corpus, args.out, args.vocab_size)
    sp = spm.SentencePieceProcessor(model_file=str(args.out))
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()[:16]
    print(f"wrote {args.out}: vocab {sp.get_piece_size()}, sha256 {digest}")


if __name__ == "__main__":
    main()
