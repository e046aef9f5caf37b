"""`python -m spes.status` against real servers on loopback: the run's line, each refusal in one line with what to
check (token, TLS flags, address, timeout), and `--watch` until Ctrl-C. Run through `main` in the test's process;
one run as a user types it."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from conftest import usage_error
from spes.status import describe, main, refusal
from spes.sync.auth import TOKEN_ENV, WRONG_TOKEN
from spes.sync.server import ParameterServer, start_server
from spes.sync.settings import DeployConfig, ServerConfig
from spes.sync.wire import upload_digest
from sync_helpers import TOKEN, make_client, peer_upload, running_server, tiny_spec, write_pki
from terminal_helpers import with_reader_gone

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def _said(capsys: pytest.CaptureFixture[str]) -> tuple[list[str], list[str]]:
    out, err = capsys.readouterr()
    return out.splitlines(), err.splitlines()


@pytest.mark.timeout(60)
def test_the_status_command_asks_a_real_server_with_the_runs_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tiny_spec()
    secret = tmp_path / "token"
    secret.write_text(TOKEN)
    secret.chmod(0o600)
    with running_server(spec, token=TOKEN) as (server, addr), make_client(addr, spec, 0, token=TOKEN) as client:
        client.join()
        upload = peer_upload(spec, 0, seed=1)
        client.plane.upload(1, upload, timeout=10, digest=upload_digest(upload, "fp32"))
        assert main([addr, "--token_file", str(secret)]) == 0
        out, err = _said(capsys)
        assert err == [] and len(out) == 1
        assert re.fullmatch(rf"\d\d:\d\d:\d\d run {server.service.run_id}: round 1 open for \d+ s, .*", out[0]), out
        assert "uploaded by [0], waiting for [1] (peer 1 never joined)" in out[0]
        assert main([addr]) == 1  # no token
        assert _said(capsys) == ([], [f"error: {addr}: UNAUTHENTICATED: {WRONG_TOKEN}"])  # its fix said once
        as_typed = subprocess.run(
            [sys.executable, "-m", "spes.status", addr, "--token_file", str(secret)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert as_typed.returncode == 0 and as_typed.stderr == "", as_typed.stderr
    assert f"run {server.service.run_id}: round 1 open" in as_typed.stdout


@pytest.mark.timeout(60)
def test_a_wrong_token_and_a_token_file_others_can_read_are_said_once_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The wrong token's fix came twice (the server's, then status's own), and the warning had no `warning:`."""
    wrong = tmp_path / "token"
    wrong.write_text("not-the-token")
    wrong.chmod(0o644)
    with running_server(tiny_spec(), token=TOKEN) as (_, addr):
        assert main([addr, "--token_file", str(wrong)]) == 1
    assert _said(capsys) == (
        [],
        [
            f"warning: --token_file {wrong} is readable by group or others: run `chmod 600 {wrong}`",
            f"error: {addr}: UNAUTHENTICATED: {WRONG_TOKEN}",
        ],
    )


@pytest.mark.timeout(60)
def test_nothing_listening_is_blamed_on_the_address_and_a_server_that_never_answers_on_the_timeout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as unused:  # bound, never listening: a connection to it is refused
        unused.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{unused.getsockname()[1]}"
        assert main([addr, "--timeout", "5"]) == 1
    _, err = _said(capsys)
    assert len(err) == 1 and err[0].startswith(f"error: {addr}: UNAVAILABLE: "), err
    assert err[0].endswith(
        "; is the parameter server running there (python -m spes.server) and its port open to this machine? "
        "(a server that serves TLS needs --tls_ca)"
    ), err
    with socket.socket() as silent:  # connections complete in the kernel; nothing ever speaks gRPC on them
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        addr = f"127.0.0.1:{silent.getsockname()[1]}"
        assert main([addr, "--timeout", "1"]) == 1
    _, err = _said(capsys)
    assert err == [
        f"error: {addr}: DEADLINE_EXCEEDED: Deadline Exceeded; no answer within --timeout: check the address and "
        "the network, or raise --timeout"
    ]


@pytest.mark.timeout(60)
def test_a_mutual_tls_server_refusing_the_client_certificate_is_blamed_on_the_tls_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mutual-TLS server that refuses the client's certificate (or its lack of one) shows the client only
    `Socket closed`: the line named the address, the firewall and --tls_ca, never --tls_cert. Now a probe handshake,
    which the server hangs up on, says which it is."""
    (tmp_path / "run").mkdir(), (tmp_path / "other").mkdir()
    pki, stranger = write_pki(tmp_path / "run"), write_pki(tmp_path / "other").client
    fix = "give this client --tls_cert/--tls_key signed by the server's --tls_client_ca"
    with running_server(tiny_spec(), tls_client_ca=pki.ca, **pki.server) as (server, addr):
        named = f"localhost:{addr.split(':')[1]}"  # the host the server's certificate is for
        for flags, cause in (
            ([], "the server requires a client certificate (mutual TLS)"),
            (
                ["--tls_cert", stranger["tls_cert"], "--tls_key", stranger["tls_key"]],
                f"the server refused the client certificate {stranger['tls_cert']!r}",
            ),
        ):
            assert main([named, "--tls_ca", pki.ca, "--timeout", "5", *flags]) == 1
            _, err = _said(capsys)
            assert len(err) == 1 and err[0].startswith(f"error: {named}: UNAVAILABLE"), err
            assert err[0].endswith(f"Socket closed; {cause}: {fix}"), err
        cert = pki.client
        assert main([named, "--tls_ca", pki.ca, "--tls_cert", cert["tls_cert"], "--tls_key", cert["tls_key"]]) == 0
    out, err = _said(capsys)
    assert err == [] and f"run {server.service.run_id}: " in out[0]  # the certificate it asks for: served


@pytest.mark.parametrize(
    ("code", "details", "tls", "line"),
    [
        ("UNAUTHENTICATED", WRONG_TOKEN, (None, None), f"error: h:1: UNAUTHENTICATED: {WRONG_TOKEN}"),
        (
            "UNAUTHENTICATED",
            "",
            (None, None),
            f"error: h:1: UNAUTHENTICATED; pass the run's shared secret (--token_file, or env {TOKEN_ENV})",
        ),
        ("NOT_FOUND", "no such method", (None, None), "error: h:1: NOT_FOUND: no such method"),
        (  # a refused TLS handshake is no server down: what it means instead of the unreachable server's hint
            "UNAVAILABLE",
            "failed to connect: CERTIFICATE_VERIFY_FAILED",
            ("ca.pem", None),
            "error: h:1: UNAVAILABLE: failed to connect: CERTIFICATE_VERIFY_FAILED; the server's TLS certificate is "
            "not signed by the CA this client was given",
        ),
        (
            "UNAVAILABLE",
            "",
            ("ca.pem", None),
            "error: h:1: UNAVAILABLE; is the parameter server running there (python -m spes.server) and its port "
            "open to this machine? (over TLS, --tls_ca must be the CA that signed the server's certificate for the "
            "host in the address, and a server started with --tls_client_ca (mutual TLS) needs --tls_cert/--tls_key "
            "signed by that CA)",
        ),
    ],
)
def test_a_refusal_is_the_servers_answer_then_what_to_do_unless_the_answer_says_it(
    code: str, details: str, tls: tuple[str | None, str | None], line: str
) -> None:
    class Refused(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode[code]

        def details(self) -> str:
            return details

    assert refusal("h:1", Refused(), tls) == line


@pytest.mark.timeout(60)
def test_watch_asks_again_until_ctrl_c_which_ends_it_quietly(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr("spes.status.time.sleep", sleep)
    with running_server(tiny_spec()) as (server, addr):
        try:
            assert main([addr, "--watch", "2.5"]) == 0
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C during --watch escaped main: the user saw a traceback")
    out, err = _said(capsys)
    assert slept == [2.5, 2.5] and err == []
    assert len(out) == 2 and all(f"run {server.service.run_id}: no round completed yet" in line for line in out)


@pytest.mark.timeout(60)
def test_a_watch_whose_first_question_finds_no_server_ends_with_the_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No answer to the first question is a wrong address, port or flag, not a restart: --watch ends at once."""

    def sleep(seconds: float) -> None:  # asking again would end in a Ctrl-C: exit 0
        raise KeyboardInterrupt

    monkeypatch.setattr("spes.status.time.sleep", sleep)
    with socket.socket() as unused:  # bound, never listening: a connection to it is refused
        unused.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{unused.getsockname()[1]}"
        assert main([addr, "--watch", "1", "--timeout", "5"]) == 1
    out, err = _said(capsys)
    assert out == [] and len(err) == 1 and err[0].startswith(f"error: {addr}: UNAVAILABLE: "), err


@pytest.mark.timeout(60)
def test_watch_outlives_a_server_restart(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's server restarted from its --state_dir, which its nodes ride out, ended a `--watch` with exit 1: it now
    says the server did not answer and asks again, and shows the run once the server is back on its port."""

    def serve(port: int) -> ParameterServer:
        for _ in range(50):  # NOTE: grpc's core lets go of a stopped server's port a moment after stop returns
            try:
                return start_server(ServerConfig(tiny_spec(), DeployConfig(host="127.0.0.1", port=port)))
            except ValueError:
                pause(0.1)
        raise AssertionError(f"port {port} still taken")

    pause = time.sleep  # NOTE: the module's, which the test replaces for the watch
    answers: list[str] = []
    down: list[ParameterServer] = []
    back: list[ParameterServer] = []

    def sleep(seconds: float) -> None:  # the watch's pauses: the server goes, comes back, and Ctrl-C once it answers
        if len(answers) == 2:
            raise KeyboardInterrupt
        if not down:
            server.stop(grace_s=0.5)
            down.append(server)
        elif not back:
            back.append(serve(server.port))
        pause(0.2)  # NOTE: the channel reconnects after its backoff (about a second)

    server = serve(0)
    monkeypatch.setattr("spes.status.time.sleep", sleep)
    monkeypatch.setattr("spes.status.describe", lambda reply: answers.append(describe(reply)) or answers[-1])
    try:
        assert main([f"127.0.0.1:{server.port}", "--watch", "1", "--timeout", "5"]) == 0
    finally:
        monkeypatch.undo()
        for left in [*back, *([] if down else [server])]:
            left.stop(grace_s=0.5)
    out, err = _said(capsys)
    assert len(out) == 2 and all("no round completed yet" in line for line in out), out
    unanswered = rf"\d\d:\d\d:\d\d error: 127.0.0.1:{server.port}: UNAVAILABLE: .* \(asking again in 1 s\)"
    assert err and all(re.fullmatch(unanswered, line) for line in err), err


@pytest.mark.timeout(60)
def test_watch_through_a_pipe_prints_each_line_as_it_asks_and_sigint_ends_it_with_exit_0() -> None:
    """What `--watch 30 | tee status.log` shows: each line when it is asked (a pipe's output is block-buffered,
    so lines held back until exit would show nothing for hours), and Ctrl-C (SIGINT) ends it without a traceback."""
    with running_server(tiny_spec()) as (server, addr):
        proc = subprocess.Popen(
            [sys.executable, "-m", "spes.status", addr, "--watch", "30"],
            cwd=REPO,
            env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},  # a user's shell sets none
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            shown, _, _ = select.select([proc.stdout], [], [], 20)
            first = proc.stdout.readline() if shown else ""
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert f"run {server.service.run_id}: " in first, "the first line did not come through the pipe while it ran"
    assert proc.returncode == 0 and err == "", err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("watch", [["--watch", "1"], []])
def test_a_watch_whose_reader_stops_early_ends_quietly_with_exit_0(watch: list[str]) -> None:
    """`--watch 1 | head -n 3`: the fourth line met a closed pipe and ended the watch in a BrokenPipeError traceback
    (exit 1). Nobody reads it any more, so it ends (it must not watch on into /dev/null), as one question does."""
    with running_server(tiny_spec()) as (_server, addr):
        proc = with_reader_gone(["-m", "spes.status", addr, *watch], 40)
    assert (proc.returncode, proc.stderr) == (0, "")


@pytest.mark.timeout(60)
def test_a_refusal_nobody_reads_still_ends_with_its_code() -> None:
    """`spes.status ... 2>&1 | head -n 0`: a refusal (no server there) met the closed pipe and ended with 0, as if
    the server had answered; a wrong address ended with 1, not 2. The lines are lost, the exit codes kept."""
    read, write = os.pipe()
    os.close(read)
    with socket.socket() as unused, open(write, "wb") as closed:  # bound, never listening: a connection is refused
        unused.bind(("127.0.0.1", 0))
        codes = [
            subprocess.run(
                [sys.executable, "-m", "spes.status", addr, "--timeout", "5"],
                cwd=REPO,
                stdout=closed,
                stderr=closed,
                timeout=40,
            ).returncode
            for addr in (f"127.0.0.1:{unused.getsockname()[1]}", "no-port")
        ]
    assert codes == [1, 2]


@pytest.mark.timeout(60)
def test_the_status_command_refuses_an_address_without_a_port(capsys: pytest.CaptureFixture[str]) -> None:
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
    assert usage_error(capsys, lambda: main(["127.0.0.1:50051", flag])) == f"python -m spes.status: error: {rule}"


def test_help_names_each_flag_with_its_meaning(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert shown.startswith("usage: python -m spes.status [-h] [--token_file TOKEN_FILE]")
    assert (
        "HOST:PORT Where a SPES run stands, asked of its parameter server from anywhere: the run, its rounds, who is "
        "in, who is missing and when each peer was last heard from. positional arguments:" in shown
    )
    for flag, meaning in {
        "HOST:PORT": "the parameter server (spes_config.server_addr)",
        "--token_file TOKEN_FILE": f"file holding the run's shared secret (default: env {TOKEN_ENV})",
        "--tls_ca TLS_CA": "CA certificate to verify the server (TLS)",
        "--tls_cert TLS_CERT": "client certificate (mutual TLS)",
        "--tls_key TLS_KEY": "client key (mutual TLS)",
        "--watch WATCH": "ask again every this many seconds, until Ctrl-C, through a server restart (0: once) "
        "(default: 0)",
        "--timeout TIMEOUT": "seconds to wait for the server's answer (default: 10)",
    }.items():
        assert f"{flag} {meaning}" in shown, flag


def test_a_tls_flag_whose_files_cannot_serve_is_named_before_grpc_sees_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A certificate without its key aborted the process in gRPC's core (SIGABRT, a C stack trace); a file that is
    no PEM gave gRPC log lines and UNAVAILABLE naming no file. Each is now one line naming the flag, exit 2."""

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
