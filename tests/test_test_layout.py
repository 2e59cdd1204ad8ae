"""The test suite's own layout: helpers live in shared ``tests/_*.py`` modules, never in a test module.

A test module that imports another test module drags that module's requirements along (issue 45: the agent
tests could not be collected without SkyRL's source because they imported helpers from a module that loads
SkyRL's validator at import). So no test module, helper module or subprocess script in ``tests/`` imports
from a ``test_*`` module, and every test module imports with SkyRL's source hidden, except the modules that
are about SkyRL itself (listed below).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from .helpers import SUBPROCESS_HANG_S

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

#: Modules that load SkyRL's own generator (or its config) at import: differential tests against SkyRL.
NEEDS_SKYRL_SOURCE = {
    "tests.test_config",
    "tests.test_dropin_attributes",
    "tests.test_fault_matrix",
    "tests.test_fully_async",
    "tests.test_vlm_generator",
    "tests.test_vlm_parity_upstream",
}

# An import statement naming a test module, in code or in a subprocess script held in a string.
_IMPORTS_A_TEST_MODULE = re.compile(
    r"^\s*(?:from\s+(?:tests(?:\.\w+)*\.|\.+(?:\w+\.)*)test_\w+\s+import|import\s+tests(?:\.\w+)*\.test_\w+)",
    re.MULTILINE,
)


def _python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _imported_modules(path: Path) -> list[str]:
    """Every module an import statement of ``path`` names (relative ones resolved), at any depth."""
    package = _module_name(path).rsplit(".", 1)[0].split(".")
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names += [module] if node.module else [f"{module}.{alias.name}" for alias in node.names]
    return names


def test_no_module_in_tests_imports_from_a_test_module() -> None:
    offenders = []
    for path in _python_files():
        for name in _imported_modules(path):
            if name.startswith("tests.") and name.rsplit(".", 1)[-1].startswith("test_"):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
        for match in _IMPORTS_A_TEST_MODULE.finditer(path.read_text(encoding="utf-8")):
            offenders.append(f"{path.relative_to(ROOT)} runs {match.group(0).strip()!r}")
    assert sorted(set(offenders)) == [], "move the shared helpers into a tests/_*.py module"


def test_the_import_rule_sees_every_form_of_import() -> None:
    """The rule above is only as good as its parser: each form of importing a test module is seen."""
    assert _IMPORTS_A_TEST_MODULE.search("from tests.test_x import y")
    assert _IMPORTS_A_TEST_MODULE.search("    from .test_x import y")
    assert _IMPORTS_A_TEST_MODULE.search("from tests.engines.test_x import y")
    assert _IMPORTS_A_TEST_MODULE.search("import tests.test_x")
    assert not _IMPORTS_A_TEST_MODULE.search("from tests._agents import test_like_name")
    assert not _IMPORTS_A_TEST_MODULE.search('("tests.test_cli_run", "a test function")')


_IMPORT_EACH = """
import importlib, json, sys
sys.modules["skyrl"] = None  # SkyRL's source hidden: `import skyrl` fails, find_spec("skyrl") is None
import _pytest.outcomes
failed = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except _pytest.outcomes.Skipped:
        pass  # a module-level importorskip: collected, and skipped with its reason
    except BaseException as exc:
        failed[name] = repr(exc)[:300]
print(json.dumps(failed))
"""


def test_every_test_module_imports_without_skyrls_source_unless_it_is_about_skyrl() -> None:
    modules = [_module_name(p) for p in _python_files() if p.name.startswith("test_")]
    assert "tests.test_agents_tombstone" in modules  # the glob found the suite
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_HANG_S,  # a bound only a hang reaches
        check=True,
    )
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(failed) - NEEDS_SKYRL_SOURCE == set(), failed
    assert NEEDS_SKYRL_SOURCE - set(failed) == set(), "these import without SkyRL now: drop them from the list"
