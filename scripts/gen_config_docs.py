#!/usr/bin/env python
"""Write docs/configuration.md from the config dataclasses' ``help`` texts (``--check``: fail if stale).

Run it after changing a field, a default or a help text in ``skyrl_structured/config/`` or the
command's sections (``skyrl_structured/_cli/schema.py``); tests/test_cli_docs.py fails until you do.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from skyrl_structured.cli._help import reference_markdown

TARGET = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is not up to date; write nothing")
    args = parser.parse_args(argv)
    text = reference_markdown()
    current = TARGET.read_text(encoding="utf-8") if TARGET.exists() else None
    if args.check:
        if current != text:
            print(f"{TARGET} is stale: run python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    if current != text:
        TARGET.write_text(text, encoding="utf-8")
        print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
