"""Running the benchmarks from tests: `bench/<name>.py --quick` in a subprocess, pointed at the test corpus."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import Corpus

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))  # NOTE: the tests import the benchmarks' pure helpers (common, figures, ...)


def corpus_flags(corpus: Corpus, *, valid: bool = True) -> list[str]:
    """The flags of `bench/common.corpus_args` that point a training benchmark at the test corpus."""
    flags = ["--tokenizer", str(corpus.tokenizer), "--train", corpus.train]
    return [*flags, "--valid", corpus.valid] if valid else flags


def run_bench(name: str, tmp_path: Path, *extra: str, timeout: float = 300) -> tuple[dict, str]:
    """Run `bench/<name>.py --quick --out <tmp>/<name>.json`; return its JSON and stdout."""
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), "--quick", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout
