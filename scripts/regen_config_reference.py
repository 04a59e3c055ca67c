"""Rewrite docs/config.md's config reference (between the config-reference markers) from the dataclasses.

    python scripts/regen_config_reference.py

tests/test_config.py fails until docs/config.md matches ``components.config.config_markdown()``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from components.config import config_markdown  # noqa: E402

BEGIN, END = "<!-- config-reference -->", "<!-- /config-reference -->"
PAGE = ROOT / "docs" / "config.md"


def main() -> None:
    text = PAGE.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{PAGE.relative_to(ROOT)} lacks the {BEGIN} / {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    PAGE.write_text(f"{head}{BEGIN}\n{config_markdown().strip()}\n{END}{tail}", encoding="utf-8")


if __name__ == "__main__":
    main()
