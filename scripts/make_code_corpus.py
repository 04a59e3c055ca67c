"""Build the quality-run corpus: the Python sources of pinned packages, as shuffled JSON lines.

    python scripts/make_code_corpus.py                    # -> data/code/jsonl/code-0000{0..4}.jsonl, data/code/MANIFEST.json
    python scripts/make_code_corpus.py --out /data/code --any-version

The long FP8-against-bf16 runs need text that 500 steps of 16,384 tokens (8.2 M tokens) cannot
memorize, available without a network and reproducible byte for byte. The shipped stories corpus
(~0.5 M tokens) is memorized within a few hundred steps; this one holds about 115 M tokens of the
project's tokenizer (``assets/tokenizer``, 1.37 bytes a token on code): every ``.py`` file of
CPython's standard library (tests included) and of the ``torch``, ``transformers`` and ``sympy``
distributions installed here, one document per file. Those versions are pinned (``SOURCES``) so
that the output is the same on every machine: another version stops the script unless
``--any-version`` is given, and the manifest then records what was used.

Documents are visited in sorted (source, path) order and shuffled with a fixed seed, so any prefix
of the corpus (what a trainer reading in file order sees first) mixes all sources alike; they are
written as ``{"text": source, "path": "<source>/<path>"}`` lines to shards of about 40 MB in
``<out>/jsonl`` (the folder a trainer reads), and ``<out>/MANIFEST.json`` lists the sources, counts
and each shard's SHA-256. Empty files, files over 1 MB (generated tables) and files
that are not UTF-8 are left out.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import platform
import random
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "data" / "code"
SEED = 20261207
SHARD_BYTES = 40_000_000
MAX_FILE_BYTES = 1_000_000
# (source, pinned version): "python" is the interpreter's standard library, the others distributions.
SOURCES = (("python", "3.11.7"), ("torch", "2.13.0+cpu"), ("transformers", "5.24.0"), ("sympy", "1.14.0"))


class CorpusError(RuntimeError):
    pass


def installed_version(source: str) -> str:
    if source == "python":
        return platform.python_version()
    try:
        return importlib.metadata.version(source)
    except importlib.metadata.PackageNotFoundError:
        raise CorpusError(f"{source} is not installed; pip install the pinned version "
                          f"({dict(SOURCES)[source]}) or pass --sources without it") from None


def source_files(source: str) -> list[tuple[str, Path]]:
    """(path inside the source, file) of every ``.py`` file of ``source``, sorted by path."""
    if source == "python":
        lib = Path(sysconfig.get_paths()["stdlib"])
        found = [(p.relative_to(lib).as_posix(), p) for p in lib.rglob("*.py")
                 if not {"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(lib).parts)]
    else:
        dist = importlib.metadata.distribution(source)
        found = [(f.as_posix(), Path(dist.locate_file(f))) for f in dist.files or () if f.suffix == ".py"]
    return sorted(found)


def collect(sources: list[str], check_versions: bool = True) -> tuple[list[dict], dict]:
    """The documents (unshuffled, in sorted order) and the per-source manifest entries."""
    docs, manifest = [], {}
    pins = dict(SOURCES)
    for source in sources:
        version = installed_version(source)
        if check_versions and version != pins[source]:
            raise CorpusError(f"{source} {version} is installed, the corpus is pinned to {pins[source]}: install "
                              f"that version for the recorded corpus, or pass --any-version (the manifest records "
                              f"what was used, and the shards' hashes will differ)")
        kept = skipped = size = 0
        for rel, path in source_files(source):
            data = path.read_bytes()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                skipped += 1
                continue
            if len(data) > MAX_FILE_BYTES or not text.strip():
                skipped += 1
                continue
            docs.append({"text": text, "path": f"{source}/{rel}"})
            kept += 1
            size += len(data)
        manifest[source] = {"version": version, "files": kept, "left_out": skipped, "bytes": size}
    return docs, manifest


def write_shards(docs: list[dict], out: Path, shard_bytes: int = SHARD_BYTES) -> list[dict]:
    """Shuffle ``docs`` with the fixed seed and write them as JSON-lines shards; their names and hashes."""
    order = list(range(len(docs)))
    random.Random(SEED).shuffle(order)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict] = []
    lines: list[bytes] = []
    size = 0

    def flush() -> None:
        nonlocal lines, size
        path = out / f"code-{len(shards):05d}.jsonl"
        blob = b"".join(lines)
        path.write_bytes(blob)
        shards.append({"file": path.name, "documents": len(lines), "bytes": len(blob),
                       "sha256": hashlib.sha256(blob).hexdigest()})
        lines, size = [], 0

    for i in order:
        line = (json.dumps(docs[i], ensure_ascii=False) + "\n").encode("utf-8")
        lines.append(line)
        size += len(line)
        if size >= shard_bytes:
            flush()
    if lines:
        flush()
    return shards


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/make_code_corpus.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--sources", default=",".join(s for s, _ in SOURCES),
                   help=f"comma-separated, of {', '.join(s for s, _ in SOURCES)}")
    p.add_argument("--any-version", action="store_true", help="use the installed versions even if not the pinned ones")
    args = p.parse_args(argv)
    sources = [s for s in args.sources.split(",") if s]
    if unknown := set(sources) - dict(SOURCES).keys():
        p.error(f"unknown sources {', '.join(sorted(unknown))}; known: {', '.join(s for s, _ in SOURCES)}")
    shard_dir = args.out / "jsonl"
    old = sorted(shard_dir.glob("code-*.jsonl")) if shard_dir.is_dir() else []
    try:
        docs, manifest = collect(sources, check_versions=not args.any_version)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for f in old:
        f.unlink()
    shards = write_shards(docs, shard_dir)
    total = sum(s["bytes"] for s in shards)
    (args.out / "MANIFEST.json").write_text(json.dumps(
        {"seed": SEED, "sources": manifest, "documents": len(docs), "bytes": total, "shards": shards},
        indent=1) + "\n", encoding="utf-8")
    print(f"{len(docs)} documents, {total / 1e6:.1f} MB in {len(shards)} shard(s) under {shard_dir}")
    for s in shards:
        print(f"  {s['file']}  {s['bytes'] / 1e6:6.1f} MB  sha256 {s['sha256']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
