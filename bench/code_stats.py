"""Code metrics of the `spes` package: lines per module and the largest classes and functions.

Measures the working tree, or any commit with `--rev` (read through git, nothing is checked out), so a
refactor can be reported as before/after from one command each:

    .venv/bin/python bench/code_stats.py --rev 92d762a --out bench/results/code_stats_92d762a.json
    .venv/bin/python bench/code_stats.py

`--ruff-format` measures every file as `ruff format` would write it, so a tree formatted by ruff can be
compared with one that was not (the formatter alone changes line counts).
`lines` counts every line of a file (as `wc -l`); `code` leaves out blank and comment-only lines (docstrings
count as code). A class or function spans from its `def`/`class` line to its last line, nested ones included;
functions are every `def` (methods and nested functions too), named `module:Class.method`. The generated
gRPC stubs (`*_pb2*.py`) are left out.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import REPO_ROOT, format_table, machine_info, parser, write_results

PACKAGE = "spes"


@dataclass(frozen=True)
class Span:
    """A class or function: where it is and how many lines it spans."""

    name: str
    path: str
    line: int
    lines: int


def is_generated(path: str) -> bool:
    """The protoc outputs, which nobody edits."""
    return "_pb2" in Path(path).name


def package_sources(rev: str | None) -> dict[str, str]:
    """Path (relative to the repository) -> text of every hand-written `.py` file of the package, at `rev`
    (a git revision) or in the working tree when `rev` is None."""
    if rev is None:
        paths = sorted(p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / PACKAGE).rglob("*.py"))
        return {p: (REPO_ROOT / p).read_text() for p in paths if not is_generated(p)}

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout

    paths = [p for p in git("ls-tree", "-r", "--name-only", rev, "--", PACKAGE).splitlines() if p.endswith(".py")]
    return {p: git("show", f"{rev}:{p}") for p in sorted(paths) if not is_generated(p)}


def ruff_formatted(path: str, text: str) -> str:
    """`text` as `ruff format` (with this repository's settings) would write the file at `path`."""
    return subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--stdin-filename", path, "-"],
        input=text,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def ruff_version() -> str:
    """The formatter's version, which a `--ruff-format` measurement depends on."""
    return subprocess.run(
        [sys.executable, "-m", "ruff", "--version"], capture_output=True, text=True, check=True
    ).stdout.split()[-1]


def count_lines(text: str) -> dict[str, int]:
    """All lines, and those that are neither blank nor only a comment."""
    lines = text.splitlines()
    code = sum(1 for line in lines if line.strip() and not line.lstrip().startswith("#"))
    return {"lines": len(lines), "code": code}


def spans(path: str, text: str) -> tuple[list[Span], list[Span]]:
    """The classes and the functions (every `def`, qualified by the classes and functions around it) of a file."""
    module = path.removesuffix(".py").replace("/", ".")
    classes: list[Span] = []
    functions: list[Span] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                assert child.end_lineno is not None  # set by ast.parse on every statement
                span = Span(f"{module}:{name}", path, child.lineno, child.end_lineno - child.lineno + 1)
                (classes if isinstance(child, ast.ClassDef) else functions).append(span)
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(text, filename=path), "")
    return classes, functions


def measure(sources: dict[str, str], top: int) -> dict[str, Any]:
    """Lines per module, totals, and the `top` largest classes and functions."""
    modules = {path: count_lines(text) for path, text in sources.items()}
    classes: list[Span] = []
    functions: list[Span] = []
    for path, text in sources.items():
        file_classes, file_functions = spans(path, text)
        classes += file_classes
        functions += file_functions

    def largest(items: list[Span]) -> list[dict[str, Any]]:
        return [asdict(s) for s in sorted(items, key=lambda s: (-s.lines, s.name))[:top]]

    return {
        "modules": modules,
        "total": {
            "files": len(modules),
            "lines": sum(m["lines"] for m in modules.values()),
            "code": sum(m["code"] for m in modules.values()),
        },
        "largest_classes": largest(classes),
        "largest_functions": largest(functions),
    }


def main() -> None:
    p = parser("code_stats", __doc__)
    p.add_argument("--rev", help="a git revision to measure instead of the working tree (e.g. a base commit)")
    p.add_argument("--top", type=int, default=5, help="how many of the largest classes and functions to list")
    p.add_argument("--ruff-format", action="store_true", help="measure each file as `ruff format` would write it")
    args = p.parse_args()
    sources = package_sources(args.rev)
    if args.ruff_format:
        sources = {path: ruff_formatted(path, text) for path, text in sources.items()}
    stats = measure(sources, args.top)
    formatted = " (as ruff would format it)" if args.ruff_format else ""
    print(
        f"{PACKAGE}/ at {args.rev or 'the working tree'}{formatted}: {stats['total']['files']} modules, "
        f"{stats['total']['lines']:,} lines ({stats['total']['code']:,} code)"
    )
    print(format_table(["module", "lines", "code"], [[p, m["lines"], m["code"]] for p, m in stats["modules"].items()]))
    for kind in ("classes", "functions"):
        print(f"\nlargest {kind}")
        print(
            format_table(
                ["name", "lines", "at"],
                [[s["name"], s["lines"], f"{s['path']}:{s['line']}"] for s in stats[f"largest_{kind}"]],
            )
        )
    machine = machine_info() | ({"ruff": ruff_version()} if args.ruff_format else {})
    write_results(
        args.out, {"rev": args.rev or "working tree", "ruff_format": args.ruff_format, "machine": machine, **stats}
    )


if __name__ == "__main__":
    main()
