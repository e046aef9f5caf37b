"""`python -m spes.unshard`'s command line (the unsharding itself is tests/test_checkpoint.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dist_helpers import without_torch


@pytest.mark.timeout(120)
def test_help_and_a_usage_error_are_answered_without_torch(tmp_path: Path) -> None:
    """Importing torch took most of the two seconds `--help` took: the command line is read before it."""
    code, out, err = without_torch(tmp_path, "spes.unshard", "--help")
    assert code == 0 and out.startswith("usage: python -m spes.unshard [-h] sharded out_dir") and not err
    code, out, err = without_torch(tmp_path, "spes.unshard", "only_one")
    assert (code, out, err[-1]) == (
        2,
        "",
        "python -m spes.unshard: error: the following arguments are required: out_dir",
    )
