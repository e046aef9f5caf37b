"""The package's structure: no import cycle anywhere in spes (grimp's graph of every import, function-level and
type-only ones included), and the floors of the sync wing and of the Hugging Face wing ([tool.importlinter] in
pyproject.toml, `lint-imports` in CI), every module of each wing on one; in tests/, no test module imports another
(what tests share lives in helper modules and conftest.py). And the documents that map it: every module has its row
in docs/architecture.md's table of concerns, and the table names no module that is gone; docs/testing.md names every
test helper module, every test file with a GPU test and every module bench/mutation.py mutates."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grimp
import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def import_cycles(package: str) -> list[list[str]]:
    """The strongly connected groups of more than one module in `package`'s import graph (Tarjan)."""
    graph = grimp.build_graph(package, include_external_packages=False)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in edges.get(module, []):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in edges:
        if module not in index:
            visit(module)
    return groups


def test_spes_has_no_import_cycle() -> None:
    assert import_cycles("spes") == []


def test_a_cycle_is_found_when_there_is_one(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    package = tmp_path / "circle"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from circle import b\n")
    (package / "b.py").write_text("def f() -> None:\n    from circle import a  # a function-level import counts\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("circle") == [["circle.a", "circle.b"]]


def imported_test_modules(path: Path) -> list[str]:
    """The modules named `test_*` that the Python file at `path` imports, at any depth of its code."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return sorted({n for n in names if any(part.startswith("test_") for part in n.split("."))})


def test_no_test_module_imports_another() -> None:
    found = {str(p.relative_to(TESTS)): imported_test_modules(p) for p in sorted(TESTS.rglob("*.py"))}
    assert {path: names for path, names in found.items() if names} == {}


def test_a_test_module_import_is_found(tmp_path: Path) -> None:
    module = tmp_path / "test_x.py"
    module.write_text(
        "import os\nfrom sync_helpers import stub_for\n\ndef f() -> None:\n    from sync.test_peer import g\n"
    )
    assert imported_test_modules(module) == ["sync.test_peer", "sync.test_peer.g"]


def concern_table_modules(text: str) -> set[str]:
    """The modules named in the architecture document's table of concerns: `spes/x.py`, `spes/sync/{a,b}.py`, and a
    folder (`spes/sync/codecs/`) for every module in it."""
    table = text.split("## Where each concern lives", 1)[1].split("\n## ", 1)[0]
    named = set()
    for path in re.findall(r"`(spes/[\w/{},]+(?:\.py|/))`", table):
        head, _, rest = path.partition("{")
        named |= (
            {head + name + rest.partition("}")[2] for name in rest.partition("}")[0].split(",")} if rest else {path}
        )
    return named


def test_every_module_has_its_row_in_the_architecture_document() -> None:
    named = concern_table_modules((REPO / "docs" / "architecture.md").read_text())
    modules = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "spes").rglob("*.py")
        if p.name != "__init__.py" and "proto" not in p.parts
    }
    missing = sorted(
        m for m in modules if m not in named and not any(m.startswith(d) for d in named if d.endswith("/"))
    )
    assert not missing, f"modules without a row in docs/architecture.md's 'Where each concern lives': {missing}"
    gone = sorted(m for m in named if not (REPO / m).exists())
    assert not gone, f"docs/architecture.md's 'Where each concern lives' names what is not there: {gone}"
    assert concern_table_modules("## Where each concern lives\n| x | `spes/sync/{a,b}.py`, `spes/c/` |\n## next") == {
        "spes/sync/a.py",
        "spes/sync/b.py",
        "spes/c/",
    }


@pytest.mark.parametrize(
    ("contract", "globs"),
    [("sync wing floors", ("sync/**/*.py",)), ("Hugging Face wing floors", ("hf*.py", "upcycl*.py"))],
)
def test_every_module_of_a_wing_is_on_a_floor_of_its_layers_contract(contract: str, globs: tuple[str, ...]) -> None:
    """lint-imports checks only the modules a `layers` contract names: a module of the wing left off it could import
    any other, above it or beside it, and the floors docs/architecture.md states would not hold (in the Hugging Face
    wing: a command line's `--help` would import torch through the key map)."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's tomllib reads pyproject.toml")
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    floors = next(c["layers"] for c in config if c["type"] == "layers" and c["name"] == contract)
    layered = {m.strip() for floor in floors for m in floor.split("|")}
    modules = {
        ".".join(p.relative_to(REPO).with_suffix("").parts)
        for glob in globs
        for p in (REPO / "spes").glob(glob)
        if p.name != "__init__.py" and "proto" not in p.parts
    }
    assert sorted(modules - layered) == [], f"modules on no floor of pyproject.toml's {contract!r}"
    assert sorted(layered - modules) == [], f"floors of pyproject.toml's {contract!r} naming no module"


def mutated_modules() -> list[str]:
    """The keys of bench/mutation.py's `MODULES`, read from its source (importing it would import torch)."""
    tree = ast.parse((REPO / "bench" / "mutation.py").read_text())
    found = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "MODULES"
    )
    assert isinstance(found, ast.Dict)
    return [key.value for key in found.keys if isinstance(key, ast.Constant)]


def test_the_testing_document_names_every_helper_gpu_test_file_and_mutated_module() -> None:
    """docs/testing.md is where a contributor learns what the suite shares, what only a GPU checks and which modules
    are under mutation testing: each list there is the whole list (a module may be named by its file name where the
    text names its folder just before)."""
    named = set(re.findall(r"`([\w/.]+\.py)`", (REPO / "docs" / "testing.md").read_text()))
    files = sorted(TESTS.rglob("*.py"))
    helpers = [p.name for p in files if not p.name.startswith("test_") and p.name not in ("conftest.py", "__init__.py")]
    gpu = [
        p.relative_to(REPO).as_posix()
        for p in files
        if re.search(r"\bpytest\.mark\.gpu\b", p.read_text()) and p.name != "conftest.py"
    ]
    mutated = mutated_modules()
    assert len(mutated) > 40 and "spes/sync/merge.py" in mutated
    unnamed = {
        "test helper modules": [name for name in helpers if name not in named],
        "test files with GPU tests": [path for path in gpu if path not in named],
        "modules under mutation testing": [m for m in mutated if m not in named and Path(m).name not in named],
    }
    assert {what: names for what, names in unnamed.items() if names} == {}, "docs/testing.md does not name these"
