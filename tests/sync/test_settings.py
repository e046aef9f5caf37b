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


LIMITS = [f.name for f in dataclasses.fields(DeployConfig) if f.metadata.get("group") == "limits"]


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


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"port": -1}, "--port must be in [0, 65535], got -1"),
        ({"port": 65536}, "--port must be in [0, 65535], got 65536"),
        ({"data_port": -2}, "--data_port must be -1 (disabled) or in [0, 65535], got -2"),
        ({"data_port": 65536}, "--data_port must be -1 (disabled) or in [0, 65535], got 65536"),
        ({"max_message_mb": 1}, "--max_message_mb must be >= 2 (chunks are 1 MiB), got 1"),
        (
            {"tls_cert": "c.pem"},
            "--tls_cert and --tls_key must be given together: give --tls_key too, or leave out --tls_cert",
        ),
        (
            {"tls_key": "k.pem"},
            "--tls_cert and --tls_key must be given together: give --tls_cert too, or leave out --tls_key",
        ),
        ({"tls_client_ca": "ca.pem"}, "--tls_client_ca (mutual TLS) needs --tls_cert and --tls_key"),
        (
            {"tls_peer_ids": True, "tls_cert": "c.pem", "tls_key": "k.pem"},
            "--tls_peer_ids binds peer ids to client certificates: it needs mutual TLS (--tls_client_ca, --tls_cert, "
            "--tls_key)",
        ),
        ({"token": ""}, "the auth token is empty: put a non-empty secret in SPES_TOKEN or --token_file"),
    ],
)
def test_a_deployment_that_cannot_serve_is_refused_naming_the_flag(settings: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        DeployConfig(**settings)
    assert str(err.value) == message


def test_the_edges_of_the_ports_and_the_smallest_message_are_accepted() -> None:
    for port in (0, 65535):
        assert DeployConfig(port=port, data_port=port).port == port
    assert DeployConfig(data_port=-1, max_message_mb=2).max_message_mb == 2
    mutual = {"tls_cert": "c.pem", "tls_key": "k.pem", "tls_client_ca": "ca.pem", "tls_peer_ids": True}
    assert DeployConfig(**mutual).tls_peer_ids


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost"])
def test_a_loopback_server_needs_no_token(host: str) -> None:
    DeployConfig(host=host).check_exposure()


def test_a_server_other_machines_reach_needs_a_token_and_tls_or_insecure() -> None:
    with pytest.raises(ValueError) as err:
        DeployConfig(host="0.0.0.0").check_exposure()
    assert str(err.value) == (
        "--host 0.0.0.0 is reachable from other machines and no token is set: anyone could join the run. Set "
        "SPES_TOKEN or --token_file (with --tls_cert/--tls_key), bind --host 127.0.0.1, or pass --insecure on a "
        "trusted network"
    )
    with pytest.raises(ValueError) as err:
        DeployConfig(host="server.example.org", token="s").check_exposure()
    assert str(err.value) == (
        "--host server.example.org is reachable from other machines and the token would travel in clear text: add "
        "--tls_cert/--tls_key, or pass --insecure on a trusted network"
    )
    DeployConfig(host="10.0.0.5", token="s", tls_cert="c.pem", tls_key="k.pem").check_exposure()
    DeployConfig(host="0.0.0.0", insecure=True).check_exposure()


def test_each_flag_stands_in_its_group_with_its_doc_and_default() -> None:
    parser = argparse.ArgumentParser()
    add_deploy_flags(parser)
    titles = [g.title for g in parser._action_groups]
    assert titles[-4:] == ["network", "run", "limits", "security"]  # each group once, none left empty
    groups = {g.title: {a.dest: a for a in g._group_actions} for g in parser._action_groups}
    for f in dataclasses.fields(DeployConfig):
        action = groups[f.metadata["group"]][f.name]
        assert action.help == f.metadata["doc"] and action.default == f.default, f.name
        kind = {"int": int, "float": float}.get(str(f.type), str)
        assert action.type is kind or isinstance(action, argparse._StoreTrueAction), f.name


def test_a_token_file_the_flag_names_is_read_and_its_problems_name_the_flag(tmp_path: Path) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n")
    empty.chmod(0o600)
    with pytest.raises(ValueError) as err:
        parse("--token_file", str(empty))
    assert str(err.value) == f"--token_file {str(empty)!r} is empty: write the run's shared secret into it"


def test_a_token_file_others_can_read_is_a_warning_in_the_servers_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    secret.chmod(0o644)
    assert parse("--token_file", str(secret)).token == "s3cret"
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("spes.server", "WARNING", f"--token_file {secret} is readable by group or others: run `chmod 600 {secret}`")
    ]
    assert capsys.readouterr().err == ""


def test_a_limit_below_one_is_still_a_limit() -> None:
    assert DeployConfig(stream_idle_timeout=0.5, handshake_timeout=0.25).handshake_timeout == 0.25
