"""The docs that are generated from code stay in step with it, and the site's nav points at real pages."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from skyrl_structured.cli._help import key_cell, reference_markdown
from skyrl_structured.cli._schema import key_specs

ROOT = Path(__file__).resolve().parent.parent


def test_configuration_reference_is_up_to_date():
    current = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert current == reference_markdown(), "docs/configuration.md is stale: run python scripts/gen_config_docs.py"


def test_configuration_reference_lists_every_key():
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    for path, spec in key_specs().items():
        if spec.section is None:
            assert f"| {key_cell(path)} |" in text, path


def test_reference_keys_wrap_only_after_their_dots():
    # The theme breaks code at any letter (max_generate_length came out as max_gener/ate_length):
    # each key offers <wbr> after its dots only, and the site's stylesheet forbids other breaks.
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    cells = re.findall(r'^\| <code class="config-key">([^<]*(?:<wbr>[^<]*)*)</code> \|', text, flags=re.MULTILINE)
    leaves = [path for path, spec in key_specs().items() if spec.section is None]
    assert len(cells) >= len(leaves)
    for cell in cells:
        segments = cell.split("<wbr>")
        assert all(s.endswith(".") for s in segments[:-1]), cell
        assert all(re.fullmatch(r"[a-z0-9_]+\.?", s) for s in segments), cell
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    (stylesheet,) = config["extra_css"]
    css = (ROOT / "docs" / stylesheet).read_text(encoding="utf-8")
    rule = re.search(r"\.md-typeset code\.config-key \{([^}]*)\}", css)
    assert rule is not None
    assert "word-break: normal;" in rule.group(1)
    assert "overflow-wrap: normal;" in rule.group(1)


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
