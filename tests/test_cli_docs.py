"""The docs that are generated from code stay in step with it, and the site's nav points at real pages."""

from __future__ import annotations

from pathlib import Path

import yaml

from skyrl_structured._cli.help import reference_markdown
from skyrl_structured._cli.schema import key_specs

ROOT = Path(__file__).resolve().parent.parent


def test_configuration_reference_is_up_to_date():
    current = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert current == reference_markdown(), "docs/configuration.md is stale: run python scripts/gen_config_docs.py"


def test_configuration_reference_lists_every_key():
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    for path, spec in key_specs().items():
        if spec.section is None:
            assert f"| `{path}` |" in text, path


def _nav_pages(entries):
    for entry in entries:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            if isinstance(value, list):
                yield from _nav_pages(value)
            else:
                yield value


def test_every_page_in_the_nav_exists():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    pages = list(_nav_pages(config["nav"]))
    assert "configuration.md" in pages
    missing = [page for page in pages if not (ROOT / "docs" / page).is_file()]
    assert not missing, f"mkdocs.yml lists pages that do not exist: {missing}"
