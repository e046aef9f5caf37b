"""The commands that only talk gRPC start without torch: importing it took seconds of a `python -m spes.status`
that prints one line. Each check runs in a fresh interpreter (this one has torch loaded already)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCH_FREE = (
    "spes.status",
    "spes.launch",
    "spes.sync.channel",
    "spes.sync.auth",
    "spes.sync.status",
    "spes.server",
    "spes.sync.settings",
    "spes.save_folder",
)
"""The modules that import no torch: the status command and what it stands on, the launcher, the server's entry
point and the command line it reads (`spes.sync.server`, imported only for a command that holds, does), and a save
folder's layout (what the launcher and the checkpoint commands' refusals read)."""


def imports_torch(code: str) -> bool:
    """Whether running `code` in a fresh interpreter on this tree loads torch."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    check = f"{code}\nimport sys\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", check], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.parametrize("module", TORCH_FREE)
def test_a_command_that_only_talks_grpc_imports_no_torch(module: str) -> None:
    assert not imports_torch(f"import {module}")


def test_a_status_call_imports_no_torch_either() -> None:
    """What a call reaches (the channel, the token, the refusal's line), not only the import, stays torch-free."""
    code = "from spes.status import main\nassert main(['127.0.0.1:1', '--timeout', '1']) == 1"
    assert not imports_torch(code)


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["--help"], 0),
        (["--port"], 2),  # a flag without its value: argparse's usage and error
        (["--bogus"], 2),
        (["configs/tiny.yaml", "--server.merge_intervall=3"], 2),  # a config key the run does not have
        (["--total_peers", "2", "--model.d_model=64"], 2),  # a key a server without the run's YAML cannot set
        (["configs/tiny.yaml", "--total_peers", "8"], 2),  # a layout flag the YAML disagrees with
        (["configs/tiny.yaml", "--tls_cert", "server.crt"], 2),  # a certificate without its key
    ],
)
def test_the_servers_help_and_its_refusals_of_a_command_import_no_torch(argv: list[str], code: int) -> None:
    """`python -m spes.server --help` or a mistake took seconds, most of them importing torch and the server."""
    run = f"from spes.server import main\ntry:\n    code = main({argv!r})\nexcept SystemExit as e:\n    code = e.code"
    assert not imports_torch(f"{run}\nassert code == {code}, code")


def test_the_check_sees_torch_when_it_is_imported() -> None:
    assert imports_torch("import spes.sync.wire")
