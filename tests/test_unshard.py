"""`python -m spes.unshard`'s command line (the unsharding itself is tests/test_checkpoint.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dist_helpers import without_torch


@pytest.mark.timeout(120)
def test_help_a_usage_error_and_a_path_naming_no_checkpoint_are_answered_without_torch(tmp_path: Path) -> None:
    """Importing torch took most of the two seconds `--help` took: the command line is read, and the checkpoint
    found (`spes.save_folder`), before it."""
    code, out, err = without_torch(tmp_path, "spes.unshard", "--help")
    assert code == 0 and out.startswith("usage: python -m spes.unshard [-h] sharded out_dir") and not err
    code, out, err = without_torch(tmp_path, "spes.unshard", "only_one")
    assert (code, out, err[-1]) == (
        2,
        "",
        "python -m spes.unshard: error: the following arguments are required: out_dir",
    )
    (tmp_path / "empty").mkdir()
    for node in ("node0", "node1"):
        (tmp_path / "run" / node).mkdir(parents=True)
        (tmp_path / "run" / node / "latest").write_text("step4-sharded\n")
    fix = (
        "point it at a checkpoint directory such as output/<run_name>/node0/step100, or a save folder holding 'latest'"
    )
    refused = {
        "missing": f"checkpoint missing: no such directory ({fix})",
        "empty": "checkpoint empty holds no checkpoint: neither a checkpoint directory (a step<N> directory spes "
        f"saved) nor a save folder (holding such directories or a 'latest' file); {fix}",
        "run": "checkpoint run is neither a checkpoint nor a save folder itself, but holds them; point it at one: "
        "run/node0, run/node1",
        "run/node0": "run/node0/latest names step4-sharded, which is missing or incomplete; run/node0 holds no "
        "complete checkpoint: point checkpoint at another one, or remove run/node0/latest to start that save folder "
        "afresh",
    }
    for path, line in refused.items():
        assert without_torch(tmp_path, "spes.unshard", path, "out") == (2, "", [f"error: {line}"]), path
