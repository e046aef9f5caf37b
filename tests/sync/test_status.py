"""What a run waits for, in one line (spes.sync.status), and `python -m spes.status` against a real server."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import usage_error
from spes.sync.proto import spes_pb2 as pb
from spes.sync.status import describe
from spes.sync.wire import upload_digest
from sync_helpers import TOKEN, make_client, peer_upload, running_server, tiny_spec, write_pki

REPO = Path(__file__).resolve().parents[2]


def test_the_line_names_the_open_round_who_is_in_and_when_the_missing_were_last_heard() -> None:
    status = pb.StatusReply(
        run_id="abc",
        num_peers=4,
        current_round=10,
        open_round=20,
        open_round_age_s=42.4,
        peers_joined=[0, 1, 2],
        peers_uploaded=[0, 1],
        missing_peers=[2, 3],
        presence=[pb.PeerPresence(peer=p, last_seen_s=7.2, connected=p != 2) for p in range(3)],
    )
    assert describe(status) == (
        "run abc: round 20 open for 42 s, uploaded by [0, 1], waiting for [2, 3] (peer 2 disconnected, last heard "
        "7 s ago; peer 3 never joined)"
    )
    joining = pb.StatusReply(run_id="abc", num_peers=2, current_round=-1, open_round=-1, peers_joined=[1])
    assert describe(joining) == "run abc: no round completed yet; 1 of 2 peers joined (peer 0 never joined)"


def test_round_zero_counts_and_a_run_with_everyone_in_and_nothing_missing_names_nobody() -> None:
    opened = pb.StatusReply(
        run_id="r",
        num_peers=2,
        current_round=0,
        open_round=0,
        open_round_age_s=3,
        peers_joined=[0, 1],
        peers_uploaded=[1],
        missing_peers=[0],
        presence=[pb.PeerPresence(peer=0, last_seen_s=2.4, connected=True)],
    )
    assert describe(opened) == (
        "run r: round 0 open for 3 s, uploaded by [1], waiting for [0] (peer 0 connected, last heard 2 s ago)"
    )
    idle = pb.StatusReply(run_id="r", num_peers=2, current_round=0, open_round=-1, peers_joined=[0, 1])
    assert describe(idle) == "run r: round 0 complete; every peer joined, none has uploaded the next round yet"


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m spes.status ARGS` as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "spes.status", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )


@pytest.mark.timeout(60)
def test_the_status_command_asks_a_real_server(tmp_path: Path) -> None:
    spec = tiny_spec()
    secret = tmp_path / "token"
    secret.write_text(TOKEN)
    with running_server(spec, token=TOKEN) as (server, addr), make_client(addr, spec, 0, token=TOKEN) as client:
        client.join()
        upload = peer_upload(spec, 0, seed=1)
        client.plane.upload(1, upload, timeout=10, digest=upload_digest(upload, "fp32"))
        out = _status(addr, "--token_file", str(secret))
        assert out.returncode == 0, out.stderr
        line = out.stdout.strip()
        assert f"run {server.service.run_id}: round 1 open" in line and "uploaded by [0], waiting for [1]" in line
        assert "peer 1 never joined" in line
        refused = _status(addr)
        assert refused.returncode == 1
        assert refused.stderr.splitlines() == [
            f"error: {addr}: UNAUTHENTICATED: missing or wrong token: set SPES_TOKEN (or token_file) to this run's "
            "shared secret"
        ]


@pytest.mark.timeout(60)
def test_the_status_command_says_a_wrong_token_and_a_token_file_others_can_read_once_each(tmp_path: Path) -> None:
    """The wrong token's fix came twice (the server's, then status's own), and the warning had no `warning:`."""
    wrong = tmp_path / "token"
    wrong.write_text("not-the-token")
    wrong.chmod(0o644)
    with running_server(tiny_spec(), token=TOKEN) as (_, addr):
        refused = _status(addr, "--token_file", str(wrong))
    assert refused.returncode == 1
    assert refused.stderr.splitlines() == [
        f"warning: --token_file {wrong} is readable by group or others: run `chmod 600 {wrong}`",
        f"error: {addr}: UNAUTHENTICATED: missing or wrong token: set SPES_TOKEN (or token_file) to this run's "
        "shared secret",
    ]


@pytest.mark.timeout(60)
def test_the_status_command_says_what_to_check_when_nothing_answers(capsys: pytest.CaptureFixture[str]) -> None:
    from spes.status import main

    with socket.socket() as unused:  # bound, never listening: a connection to it is refused
        unused.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{unused.getsockname()[1]}"
        assert main([addr, "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {addr}: UNAVAILABLE: ") and len(err.splitlines()) == 1
    assert "is the parameter server running there (python -m spes.server)" in err


@pytest.mark.timeout(60)
def test_a_mutual_tls_server_refusing_the_client_certificate_is_blamed_on_the_tls_flags(tmp_path: Path) -> None:
    """A mutual-TLS server that refuses the client's certificate (or its lack of one) shows the client only
    `Socket closed`: the line named the address, the firewall and --tls_ca, never --tls_cert."""
    pki = write_pki(tmp_path)
    with running_server(tiny_spec(), tls_client_ca=pki.ca, **pki.server) as (_, addr):
        refused = _status(f"localhost:{addr.split(':')[1]}", "--tls_ca", pki.ca, "--timeout", "5")
    assert refused.returncode == 1 and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert "UNAVAILABLE" in refused.stderr
    assert "a server started with --tls_client_ca (mutual TLS) needs --tls_cert/--tls_key signed by that CA" in (
        refused.stderr
    )


def test_the_status_command_refuses_an_address_without_a_port(capsys: pytest.CaptureFixture[str]) -> None:
    from spes.status import main

    assert main(["server.example.org"]) == 2  # gRPC would dial a guessed port and say only UNAVAILABLE
    assert capsys.readouterr().err == "error: 'server.example.org' is not HOST:PORT (e.g. server.example.org:50051)\n"


@pytest.mark.parametrize(
    ("flag", "rule"),
    [
        ("--watch=-1", "argument --watch: -1 must be a finite number >= 0"),
        ("--watch=nan", "argument --watch: nan must be a finite number >= 0"),
        ("--timeout=0", "argument --timeout: 0 must be a finite number > 0"),
        ("--timeout=inf", "argument --timeout: inf must be a finite number > 0"),
    ],
)
def test_the_status_command_refuses_seconds_out_of_range(
    capsys: pytest.CaptureFixture[str], flag: str, rule: str
) -> None:
    from spes.status import main

    assert usage_error(capsys, lambda: main(["127.0.0.1:50051", flag])) == f"python -m spes.status: error: {rule}"


def test_the_status_command_names_a_tls_flag_whose_files_cannot_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A certificate without its key aborted the process in gRPC's core (SIGABRT, a C stack trace); a file that is
    no PEM gave gRPC log lines and UNAVAILABLE naming no file. Each is now one line naming the flag, exit 2."""
    from spes.status import main

    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    pki = write_pki(tmp_path)
    cases = [
        (["--tls_ca", str(tmp_path / "none.crt")], f"error: --tls_ca {str(tmp_path / 'none.crt')!r}: file not found"),
        (["--tls_cert", pki.server["tls_cert"]], "error: --tls_cert and --tls_key (mutual TLS) must be given together"),
        (["--tls_ca", str(junk)], f"error: --tls_ca {str(junk)!r}: not a usable PEM certificate or key ("),
        (
            ["--tls_cert", str(junk), "--tls_key", pki.server["tls_key"]],
            f"error: --tls_cert {str(junk)!r} and --tls_key {pki.server['tls_key']!r}: not a usable PEM certificate "
            "or key (",
        ),
    ]
    for flags, line in cases:
        assert main(["127.0.0.1:1", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert err.startswith(line) and len(err.splitlines()) == 1, err
    with running_server(tiny_spec(), **pki.server) as (server, addr):
        assert main([addr, "--tls_ca", pki.ca, "--timeout", "10"]) == 0  # good files still pass
    assert f"run {server.service.run_id}: " in capsys.readouterr().out
