"""The server's deployment settings (`spes.sync.settings`): one flag per field, checked values, and the descriptors
its limits can hold."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import pytest

from spes.sync.settings import FILE_RESERVE, DeployConfig, add_deploy_flags, deploy_from_args


def parse(*argv: str) -> DeployConfig:
    parser = argparse.ArgumentParser()
    add_deploy_flags(parser)
    return deploy_from_args(parser.parse_args(list(argv)))


def test_every_field_is_a_flag_with_its_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPES_TOKEN", raising=False)
    assert parse() == DeployConfig()
    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    got = parse("--max_connections", "32", "--handshake_timeout", "2.5", "--insecure", "--token_file", str(secret))
    assert (got.max_connections, got.handshake_timeout, got.insecure, got.token) == (32, 2.5, True, "s3cret")
    parser = argparse.ArgumentParser()
    add_deploy_flags(parser)
    flags = {option for action in parser._actions for option in action.option_strings}
    assert {f.metadata.get("flag", f"--{f.name}") for f in dataclasses.fields(DeployConfig)} <= flags


LIMITS = [f.name for f in dataclasses.fields(DeployConfig) if f.metadata["group"] == "limits"]


@pytest.mark.parametrize("field", LIMITS)
def test_a_limit_must_be_positive_and_finite(field: str) -> None:
    """Every flag of the "limits" group (a new one too) is refused unless a positive finite number, naming it."""
    for value in (0, -1, math.inf, math.nan):
        with pytest.raises(ValueError) as err:
            DeployConfig(**{field: value})
        assert str(err.value) == f"--{field} must be a finite number > 0, got {value}"


def test_the_open_files_its_limits_can_hold() -> None:
    assert DeployConfig().open_files() == 256 + 2 * 64 + FILE_RESERVE
    assert DeployConfig(max_connections=32, max_streams=16).open_files() == 32 + 32 + FILE_RESERVE
