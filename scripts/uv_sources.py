"""Print uv's options for the package sources pip is configured with, for ``scripts/setup``.

uv reads no pip configuration (``pip.conf``, ``PIP_*``), so setup hands it pip's: the index, the
extra indexes, the find-links locations and the constraint files, from ``python -m pip config list``
(every configuration file and ``PIP_*`` environment variable; an environment variable over the
``install`` section over ``global``, as pip ranks them), and ``--index-strategy unsafe-best-match``,
so that like pip uv picks the best version across all the indexes.

Prints the certificate bundle pip is configured with (an empty line if none) and then one option or
value per line. Exits 1, printing why, when pip's configuration has a setting this does not carry
over: setup then installs with pip, as it always did.

Run with the virtualenv's interpreter: ``.venv/bin/python scripts/uv_sources.py``. Standard library only.
"""

from __future__ import annotations

import ast
import subprocess
import sys

#: Settings carried over to uv.
CARRIED = ("index-url", "extra-index-url", "find-links", "constraint", "cert")
#: Settings that change how pip talks or prints, not what it installs: nothing to carry over.
HARMLESS = frozenset(
    {
        "default-timeout",
        "timeout",
        "retries",
        "disable-pip-version-check",
        "progress-bar",
        "no-cache-dir",
        "cache-dir",
        "no-color",
        "no-input",
        "quiet",
        "verbose",
        "root-user-action",
    }
)
#: pip's precedence of the sections that ``pip install`` reads: later wins.
SECTIONS = ("global", "install", ":env:")


def pip_settings(listing: str) -> dict[str, str]:
    """The settings ``pip install`` uses, from ``pip config list``'s ``section.key='value'`` lines.

    Raises:
        ValueError: a setting that is not carried over and may change what pip installs.
    """
    ranked: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        name, equals, quoted = line.partition("=")
        if not equals:
            continue
        section, _, key = name.rpartition(".")
        if section not in SECTIONS:
            continue  # another pip command's section (download, wheel, ...)
        if key in HARMLESS:
            continue
        if key not in CARRIED:
            raise ValueError(f"pip is configured with {name}, which uv would not follow")
        value = ast.literal_eval(quoted)
        if not isinstance(value, str):
            raise ValueError(f"cannot read pip's {name} setting: {quoted}")
        rank = SECTIONS.index(section)
        if key not in ranked or rank >= ranked[key][0]:
            ranked[key] = (rank, value)
    return {key: value for key, (_, value) in ranked.items()}


def uv_options(settings: dict[str, str]) -> list[str]:
    """uv pip install's options for pip's ``settings``."""
    options = ["--index-strategy", "unsafe-best-match"]
    if "index-url" in settings:
        options += ["--index-url", settings["index-url"]]
    for key in ("extra-index-url", "find-links", "constraint"):
        for value in settings.get(key, "").split():
            options += [f"--{key}", value]
    return options


def main() -> int:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    try:
        settings = pip_settings(listing)
    except (ValueError, SyntaxError) as exc:
        print(f"uv_sources: {exc}", file=sys.stderr)
        return 1
    print(settings.get("cert", ""))
    print("\n".join(uv_options(settings)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
