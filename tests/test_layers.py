"""The package layout is its layers: imports only go down, and no private module sits at the top.

docs/architecture.md draws the layers; this keeps the drawing true. A module may import from its
own layer or a lower one, never a higher one, so (for example) the env layer cannot reach into
the supervisor, and the output layer cannot call the generator.
"""

from __future__ import annotations

import ast
from pathlib import Path

import skyrl_structured

PACKAGE = Path(skyrl_structured.__file__).parent

#: Each top-level module or package of ``skyrl_structured`` and its layer, lowest first.
LAYERS: dict[str, int] = {
    # the vocabulary every layer speaks
    "types": 0,
    "errors": 0,
    "failures": 0,
    "config": 0,
    "keys": 0,
    "observe": 0,
    "_observers": 0,
    "progress": 0,
    "stream": 0,
    "tiny": 0,
    # how rollouts live and die; the HTTP server core (it imports nothing of the package)
    "_runtime": 1,
    "_http": 1,
    # what a rollout talks to, and its turns
    "envs": 2,
    "engines": 2,
    "_episode": 2,
    # results, and the checks made before any rollout
    "_output": 3,
    "validate": 3,
    # the generators SkyRL sees
    "generator": 4,
    "vlm_generator": 4,
    "agents": 4,
    # what users run and import
    "informative": 5,
    "cli": 5,
    "integrations": 5,
    "testing": 5,
    "__init__": 5,
    "__main__": 5,
}


def _top(path: Path, root: Path = PACKAGE) -> str:
    return path.relative_to(root).parts[0].removesuffix(".py")


def _imported(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, top-level part of skyrl_structured) for each import in ``path``."""
    # A module's package and an __init__'s package are both its parent directory.
    package = list(path.relative_to(root).parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.startswith("skyrl_structured."):
                target = node.module.split(".")[1:]
            else:
                continue
            if target:
                found.append((node.lineno, target[0]))
            else:  # ``from . import x`` at the top: x is itself a top-level part
                found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("skyrl_structured."):
                    found.append((node.lineno, alias.name.split(".")[1]))
    return found


def test_every_top_level_part_has_a_layer():
    parts = {_top(path) for path in PACKAGE.rglob("*.py")}
    assert parts - set(LAYERS) == set(), "add the new module to LAYERS and to docs/architecture.md"


def test_no_private_module_sits_flat_at_the_top():
    flat = sorted(p.name for p in PACKAGE.glob("_*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert flat == [], "private modules live in their layer's package (_runtime, _episode, _output, envs, ...)"


def test_imports_only_go_down():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = _top(path)
        for line, target in _imported(path):
            if target in LAYERS and LAYERS[target] > LAYERS[own]:
                upward.append(
                    f"{path.relative_to(PACKAGE)}:{line} imports {target} (layer {LAYERS[target]} > {LAYERS[own]})"
                )
    assert upward == []


def test_the_checker_sees_upward_imports(tmp_path):
    """The rule can fail: env modules that import the generator, relatively or not, are caught."""
    (tmp_path / "envs" / "sub").mkdir(parents=True)
    fake = tmp_path / "envs" / "sub" / "probe.py"
    fake.write_text(
        "from ...generator import StructuredGymGenerator\nimport skyrl_structured._output.collector\n"
        "from .. import _open\n",
        encoding="utf-8",
    )
    assert _top(fake, tmp_path) == "envs"
    assert _imported(fake, tmp_path) == [(1, "generator"), (2, "_output"), (3, "envs")]


# ------------------------------------------------------------------ no circles, inside a layer too


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden.update(id(inner) for inner in ast.walk(node))
    return hidden


def _module_imports(path: Path, root: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports, at the top or inside a function (a circle either way).

    Imports under ``if TYPE_CHECKING:`` never run, so they are left out; ``from pkg import name``
    counts as importing ``pkg.name`` where that is a module, else ``pkg``.
    """
    name = _module_name(path, root)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    hidden = _type_checking_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(
                    [*package[: len(package) - (node.level - 1)], *(node.module.split(".") if node.module else [])]
                )
            else:
                base = node.module or ""
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {target for target in found if target in modules and target != name}


def _circles(root: Path) -> list[list[str]]:
    """Each set of modules under ``root`` that import each other round a loop (Tarjan's components)."""
    paths = {_module_name(path, root): path for path in root.rglob("*.py")}
    graph = {name: _module_imports(path, root, set(paths)) for name, path in paths.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in order:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], order[target])
        if low[node] == order[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return circles


def test_no_module_imports_itself_back_round_a_loop():
    assert _circles(PACKAGE) == []


def test_the_circle_check_sees_a_circle_inside_one_layer(tmp_path):
    """The check can fail: two env modules importing each other (one lazily) are caught; a
    ``TYPE_CHECKING`` import is not an import."""
    root = tmp_path / "skyrl_structured"
    (root / "envs").mkdir(parents=True)
    (root / "__init__.py").write_text("", encoding="utf-8")
    (root / "envs" / "__init__.py").write_text("from ._a import A\n", encoding="utf-8")
    (root / "envs" / "_a.py").write_text("from ._b import B\nA = 1\n", encoding="utf-8")
    (root / "envs" / "_b.py").write_text("def f():\n    from . import _a\nB = 2\n", encoding="utf-8")
    (root / "envs" / "_c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._a import A\n", encoding="utf-8"
    )
    assert _circles(root) == [["skyrl_structured.envs._a", "skyrl_structured.envs._b"]]


# ------------------------------------------------------------------ only the bridges import a backend

_BACKENDS = {"asyncio", "trio", "trio_asyncio"}

#: Where importing asyncio or trio is the point, each with its reason in docs/architecture.md ("Backends").
#: A path ending in "/" is a whole package.
BACKEND_IMPORTS = {
    "engines/bridge.py",  # asyncio-only clients under trio
    "_runtime/native.py",  # the runtime's bridge: the loops' cheapest waits; a worker's asyncio loop for an async env
    "engines/vllm.py",  # vLLM's engine is asyncio code
    "testing/",  # the test kit plays users' asyncio envs and clients and counts both runtimes' tasks
}


def _backend_imports(path: Path) -> list[tuple[int, str]]:
    """(line, backend) for each import of asyncio, trio or trio_asyncio in ``path``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] in _BACKENDS]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in _BACKENDS:
            found.append((node.lineno, str(node.module)))
    return found


def _allowed_backend_import(relative: str) -> bool:
    return any(relative == entry or (entry.endswith("/") and relative.startswith(entry)) for entry in BACKEND_IMPORTS)


def test_only_the_bridges_import_asyncio_or_trio():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if not _allowed_backend_import(relative):
            offenders += [f"{relative}:{line} imports {name}" for line, name in _backend_imports(path)]
    assert offenders == [], "go through anyio, or through a bridge (docs/architecture.md, 'Backends')"


def test_every_backend_exception_is_still_needed():
    """A listed module that no longer imports a backend leaves the list (the list stays the truth)."""
    for entry in BACKEND_IMPORTS:
        paths = sorted((PACKAGE / entry).rglob("*.py")) if entry.endswith("/") else [PACKAGE / entry]
        assert any(_backend_imports(p) for p in paths), f"{entry} imports no backend now: drop it from the list"


def test_the_backend_checker_sees_every_form_of_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import asyncio.events\nfrom trio import Event\ndef f():\n    import trio_asyncio\nfrom .asyncio import x\n",
        encoding="utf-8",
    )
    assert _backend_imports(probe) == [(1, "asyncio.events"), (2, "trio"), (4, "trio_asyncio")]


# ------------------------------------------------------------------ sizes: small modules, short functions

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's length: its ``def`` line to its last, less its docstring (documentation is not logic)."""
    length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        length -= first.end_lineno - first.lineno + 1  # type: ignore[operator]
    return length


def _oversized(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    found = []
    if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
        found.append(f"{lines} lines")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _function_lines(node) > MAX_FUNCTION_LINES:
            found.append(f"{node.name}() at line {node.lineno}: {_function_lines(node)} lines")
    return found


def test_no_module_over_500_lines_and_no_function_over_80():
    over = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if found := _oversized(path):
            over[relative] = found
    assert over == {}, "split it: one concept per module, one step per function"


def test_the_size_checker_counts_code_not_docstrings(tmp_path):
    long_doc = '"""' + "\n" * 100 + '"""'
    probe = tmp_path / "probe.py"
    probe.write_text(
        f"def documented():\n    {long_doc}\n    return 1\n\n"
        + "async def long():\n"
        + "    x = 0\n" * 80
        + "    return x\n",
        encoding="utf-8",
    )
    assert _oversized(probe) == ["long() at line 105: 82 lines"]  # documented() is 103 lines, 2 of them code
