"""The parameter server's command line (`spes.sync.settings.build_parser`, `command_from_args`, `main`): the run's
spec comes from its YAML and `--section.key=value` overrides, the flags are the deployment's."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_helpers import child_env, parameter_server, run_logged
from spes.config import ServerSection
from spes.schema import config_help
from spes.sync.server import config_of, exposure_warnings
from spes.sync.settings import DeployConfig, LegacyRun, ServerConfig, build_parser, command_from_args
from terminal_helpers import hangup_as_in_a_terminal

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
USAGE = "usage: python -m spes.server [RUN.yaml] [--section.key=value ...] [flags]\n"
DESCRIPTION = """\
SPES parameter server: collects every peer's trained tensors each round, takes each expert
block from its owner, averages the shared parameters (DiLoCo: everything), applies the expert-merging
warm-up on merge rounds, persists the result (--state_dir) and serves the global model back.
The run's settings come from its YAML (any node's file: peers, experts per block, mode, sync_steps, codec,
and the `server:` section below, overridable as --server.key=value, like every key); the flags are the
deployment's. Without a YAML, the run is the defaults plus the overrides (e.g. --spes_config.num_peers=4),
and the model and sync_steps are taken from the first node to join.
"""
ALIASES = (
    "--total_peers N = --spes_config.num_peers=N, --num_train_experts_per_node N = "
    "--spes_config.num_train_experts_per_node=N, --merge_interval N = --server.merge_interval=N, "
    "--merge_alpha_start N = --server.merge_alpha_start=N, --merge_decay_steps N = --server.merge_decay_steps=N"
)
EPILOG = (
    "the run's `server:` section (key, default, meaning):\n"
    + "\n".join(config_help(ServerSection, "server."))
    + f"\n\nthe first SPES implementation's flags are accepted as spellings of overrides: {ALIASES}; with RUN.yaml, "
    "--total_peers and --num_train_experts_per_node are checked against it instead\n\n"
    "example: SPES_TOKEN=$(cat secret) python -m spes.server configs/spes_1b/node_0.yaml --port 50051 --tls_cert "
    "server.crt --tls_key server.key --state_dir server_state\nstop with SIGTERM or Ctrl-C (exit 0); restart with the "
    "same --state_dir to resume. See docs/running.md (TLS, tokens, ports).\n"
)
"""The help's text around the flags, as a user reads it (kept as written, lines and all)."""


def server_config(*argv: str) -> ServerConfig:
    return config_of(command_from_args(build_parser().parse_args(list(argv))))


@pytest.mark.parametrize(
    ("config", "layout"),
    [
        ("tiny.yaml", (4, 2, "spes")),
        ("spes_1b/node_2.yaml", (4, 4, "spes")),
        (
            "diloco_1b/node_0.yaml",
            (4, 16, "diloco"),
        ),  # a DiLoCo node stores (and announces) all 16 experts as one block
        ("upcycled_9b/node_7.yaml", (8, 2, "spes")),
    ],
)
def test_the_runs_yaml_gives_the_server_its_spec(config: str, layout: tuple[int, int, str]) -> None:
    spec = server_config(str(CONFIGS / config)).spec
    assert (spec.num_peers, spec.experts_per_block, spec.mode) == layout
    assert spec.complete and spec.origin == str(CONFIGS / config)


def test_the_server_section_and_overrides_reach_the_round_maths(tmp_path: Path) -> None:
    run = tmp_path / "run.yaml"
    run.write_text(
        "using_spes: true\nserver:\n  merge_interval: 50\n  dead_peer_policy: quorum\n  min_peers: 3\n"
        "spes_config:\n  num_peers: 4\n"
    )
    cfg = server_config(str(run), "--server.merge_alpha_start=0.05", "--server.round_timeout_s=30", "--port", "0")
    server = cfg.spec.server
    assert (server.merge_interval, server.merge_alpha_start, server.merge_decay_steps) == (50, 0.05, 10000)
    assert (server.round_timeout_s, server.dead_peer_policy, server.min_peers, cfg.deploy.port) == (
        30.0,
        "quorum",
        3,
        0,
    )
    # overrides of any section apply to the server's copy of the run, as to the nodes'
    diloco = server_config(str(run), "--using_dilico=true", "--server.outer_optimizer=nesterov")
    assert (diloco.spec.mode, diloco.spec.experts_per_block, diloco.spec.server.outer_optimizer) == (
        "diloco",
        8,
        "nesterov",
    )


def test_the_first_implementations_flags_spell_overrides() -> None:
    """`--total_peers 2 --num_train_experts_per_node 2 --merge_interval 7` (its run_parameter_server.sh) build the
    run spec of a server without the run's YAML; spes's own settings are overrides, as everywhere."""
    legacy = server_config(
        "--total_peers",
        "2",
        "--num_train_experts_per_node=2",
        "--merge_interval",
        "7",
        "--merge_alpha_start=0.05",
        "--server.round_timeout_s=9",
    ).spec
    assert (legacy.num_peers, legacy.experts_per_block, legacy.mode) == (2, 2, "spes")
    assert (legacy.server.merge_interval, legacy.server.merge_alpha_start, legacy.server.round_timeout_s) == (
        7,
        0.05,
        9.0,
    )
    assert legacy.manifest is None and legacy.sync_steps is None and legacy.block_owners is None
    tiny = server_config(str(CONFIGS / "tiny.yaml"), "--merge_interval", "0").spec
    assert tiny.server.merge_interval == 0


def test_a_run_without_its_yaml_says_whether_it_set_sync_steps_and_is_never_centralized() -> None:
    """Without `--spes_config.sync_steps=N` the server takes the first node's (`sync_steps_given`); a centralized run
    has no server to start."""

    def legacy(*argv: str) -> LegacyRun:
        run = command_from_args(build_parser().parse_args(list(argv))).run
        assert isinstance(run, LegacyRun)
        return run

    assert legacy("--total_peers", "2").sync_steps_given is False
    assert legacy("--total_peers", "2", "--spes_config.sync_steps=5").sync_steps_given is True
    with pytest.raises(ValueError) as refused:
        legacy("--total_peers", "2", "--using_spes=false")
    assert str(refused.value) == "--using_spes=false is a centralized run, which has no parameter server"


def test_the_words_argparse_leaves_are_overrides_layout_flags_or_left_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first-implementation flag is one override whether its value is the next word or follows `=` (a value holding
    `=` passed on whole); with RUN.yaml its layout flags are kept to be checked; any other `--key=value` is an override
    as given; what is neither is left over, for parse_args to refuse. No words given: sys.argv's."""
    parser = build_parser()
    words = ["run.yaml", "--merge_interval", "7=8", "--merge_decay_steps=9", "--server.round_timeout_s=3"]
    parsed, other = parser.parse_known_args([*words, "--total_peers", "4", "--bogus", "extra=word"])
    assert parsed.run == "run.yaml" and other == ["--bogus", "extra=word"]
    assert parsed.overrides == [
        "--server.merge_interval=7=8",
        "--server.merge_decay_steps=9",
        "--server.round_timeout_s=3",
    ]
    assert parsed.checked_flags == {"--total_peers": "4"}
    monkeypatch.setattr(sys, "argv", ["spes/server.py", "--total_peers=2", "--spes_config.sync_steps=5"])
    kept = argparse.Namespace(kept=True)
    parsed, other = parser.parse_known_args(namespace=kept)
    assert parsed is kept and (kept.run, kept.checked_flags, other) == (None, {}, [])
    assert kept.overrides == ["--spes_config.num_peers=2", "--spes_config.sync_steps=5"]


def test_the_help_reads_as_written_around_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """The usage, the description and the epilog word for word, their lines kept; RUN.yaml's own help; a flag's
    default where it has one."""
    monkeypatch.setenv("COLUMNS", "120")
    parser = build_parser()
    help_text = parser.format_help()
    assert help_text.startswith(f"{USAGE}\n{DESCRIPTION}\n") and help_text.endswith(f"\n\n{EPILOG}")
    assert "(default: 50051)" in help_text and "(default: None)" not in help_text
    run = next(action for action in parser._actions if action.dest == "run")
    assert (run.metavar, run.nargs, run.default, run.help) == (
        "RUN.yaml",
        "?",
        None,
        "a node YAML of the run: the server builds the run spec from it (with the same --section.key=value overrides "
        "as the nodes), including the model's manifest, and refuses any node whose spec or model differs",
    )


def test_log_levels_are_the_four_names_and_no_flag_is_taken_from_its_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    """`--insec` is no `--insecure` (an override such as `--state=...` must never set a flag it begins): refused,
    naming the command as it is typed."""
    parser = build_parser()
    assert parser.parse_args([]).log_level == "INFO"
    for level in ("DEBUG", "INFO", "WARNING", "ERROR"):
        assert parser.parse_args(["--log_level", level]).log_level == level
    choices = "(choose from 'DEBUG', 'INFO', 'WARNING', 'ERROR')"
    for argv, error in (
        (["--log_level", "info"], f"argument --log_level: invalid choice: 'info' {choices}"),
        (["--insec"], "unrecognized arguments: --insec; did you mean --insecure?"),
    ):
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(argv)
        assert exited.value.code == 2
        assert capsys.readouterr().err == f"{USAGE}python -m spes.server: error: {error}\n"


def test_the_first_implementations_layout_flags_are_checked_against_the_runs_yaml() -> None:
    """TOTAL_PEERS=8 run_parameter_server.sh RUN.yaml (a 4-peer YAML) started a server for 8 peers, which then
    refused every node of the run; with the YAML its layout flags (and so the script's variables) must agree."""
    tiny = str(CONFIGS / "tiny.yaml")  # 4 peers x 2 experts
    spec = server_config(tiny, "--total_peers", "4", "--num_train_experts_per_node=2").spec
    assert (spec.num_peers, spec.experts_per_block) == (4, 2)
    with pytest.raises(ValueError) as refused:
        server_config(tiny, "--total_peers", "8")
    assert str(refused.value) == (
        f"--total_peers 8 (TOTAL_PEERS of run_parameter_server.sh) disagrees with {tiny}: spes_config.num_peers=4; "
        "unset it (the YAML sets the run's layout), or give --spes_config.num_peers=8 to the server and every node "
        "alike"
    )
    with pytest.raises(ValueError, match=r"--num_train_experts_per_node 1 \(NUM_TRAIN_EXPERTS_PER_NODE of"):
        server_config(tiny, "--num_train_experts_per_node", "1")
    both = ("--spes_config.num_peers=8", "--spes_config.num_train_experts_per_node=1")  # as every node is given
    spec = server_config(tiny, *both, "--total_peers", "8", "--num_train_experts_per_node", "1").spec
    assert (spec.num_peers, spec.experts_per_block) == (8, 1)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["configs/centralized_1b.yaml"], "is a centralized run (using_spes: false), which has no parameter server"),
        (["configs/tiny.yaml", "--server.merge_intervall=3"], "did you mean 'server.merge_interval'?"),
        (["configs/tiny.yaml", "--server.merge_topk=0"], "config key 'server.merge_topk' = 0 must be >= 1"),
        (["configs/tiny.yaml", "--spes_config.wire_dtype=int8"], "it is now 'spes_config.codec' (same values)"),
        (
            ["--total_peers", "2", "--model.d_model=64"],
            "without the run's YAML only --spes_config.*, --server.*, --using_spes and --using_dilico apply",
        ),
        (["--total_peers"], "--total_peers needs a value"),
    ],
)
def test_mistakes_name_the_key_or_flag(
    argv: list[str], expected: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(REPO)
    pattern = expected.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?").replace("*", r"\*")
    if expected.startswith("--total_peers needs"):
        with pytest.raises(SystemExit):
            server_config(*argv)
        assert expected in capsys.readouterr().err
        return
    with pytest.raises(ValueError, match=pattern):
        server_config(*argv)


@pytest.mark.timeout(60)
def test_a_port_in_use_is_one_line_naming_the_flag() -> None:
    """grpc's core logged its own line (`add_port.cc ... Address already in use`) above the error line."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = subprocess.run(
            [sys.executable, "-m", "spes.server", "configs/tiny.yaml", "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert busy.returncode == 2
    assert busy.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port} (Address already in use): stop the process using it or pick "
        "another --port"
    ]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_port_another_spes_server_listens_on_is_one_line(tmp_path: Path) -> None:
    """gRPC listens with SO_REUSEPORT by default, under which a second server would share the first one's port."""
    with parameter_server(tmp_path / "first.log", "--total_peers", "1", "--num_train_experts_per_node", "8") as addr:
        port = addr.rsplit(":", 1)[1]
        args = ["--host", "127.0.0.1", "--port", port, "--total_peers", "1", "--num_train_experts_per_node", "8"]
        second = run_logged([sys.executable, "-m", "spes.server", *args], tmp_path / "second.log", timeout=60)
    assert second.returncode == 2
    assert second.stdout.strip().splitlines()[-1] == (
        f"error: cannot listen on 127.0.0.1:{port} (Address already in use): stop the process using it or pick "
        "another --port"
    )


def test_main_reports_a_bad_run_in_one_line_and_help_lists_the_section(monkeypatch: pytest.MonkeyPatch) -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "spes.server", "configs/tiny.yaml", "--server.merge_intervall=3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "error: command line (--server.merge_intervall=3): unknown config key 'server.merge_intervall'; did you mean "
        "'server.merge_interval'?"
    ]
    monkeypatch.setenv("COLUMNS", "120")
    help_text = subprocess.run(
        [sys.executable, "-m", "spes.server", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert help_text == build_parser().format_help()
    for key in ("--server.merge_interval=500", "--server.dead_peer_policy='wait'", "--stream_idle_timeout"):
        assert key in help_text


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("env", "taken", "refusal"),
    [
        (
            {"MERGE_ALPHA_START": "abc"},
            "MERGE_ALPHA_START=abc as --server.merge_alpha_start=abc",
            "error: command line (--server.merge_alpha_start=abc): config key 'server.merge_alpha_start' = 'abc' has "
            "the wrong type: expected float",
        ),
        ({"PORT": "abc"}, "PORT=abc as --port=abc", "python -m spes.server: error: argument --port: invalid int value"),
    ],
)
def test_the_server_script_names_the_variable_a_refused_flag_came_from(
    env: dict[str, str], taken: str, refusal: str
) -> None:
    """The server refuses a flag, which the user never typed when the script made it from a variable: the script's
    line before names the variable."""
    done = subprocess.run(
        ["/bin/bash", str(REPO / "run_scripts" / "run_parameter_server.sh"), str(CONFIGS / "tiny.yaml")],
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=50,
    )
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and lines[0] == f"run_parameter_server.sh: from the environment: {taken}", done.stderr
    assert lines[-1].startswith(refusal), done.stderr


@pytest.mark.timeout(60)
def test_the_server_script_started_from_elsewhere_runs_its_repositorys_interpreter(tmp_path: Path) -> None:
    """Without PYTHON, run_parameter_server.sh takes the .venv beside its own run_scripts/ (not one in the current
    directory, nor a python3 on PATH that may lack spes), and reads the YAML from the caller's directory."""
    repo = tmp_path / "repo"
    (repo / "run_scripts").mkdir(parents=True)
    script = repo / "run_scripts" / "run_parameter_server.sh"
    script.write_text((REPO / "run_scripts" / "run_parameter_server.sh").read_text())
    (repo / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / "bin").mkdir()
    for path, text in (
        # a venv's python, wherever it lies
        (repo / ".venv" / "bin" / "python", f'exec {shlex.quote(sys.executable)} "$@"'),
        (tmp_path / "bin" / "python3", "echo 'not the repository interpreter' >&2; exit 97"),
    ):
        path.write_text(f"#!/bin/sh\n{text}\n")
        path.chmod(0o755)
    (tmp_path / "run.yaml").write_text((CONFIGS / "tiny.yaml").read_text())
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env["PATH"] = f"{tmp_path / 'bin'}:/usr/bin:/bin"

    def server(*args: str) -> subprocess.CompletedProcess[str]:
        argv = ["/bin/bash", str(script), *args]
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=50)

    helped = server("--help")
    assert helped.returncode == 0 and "usage: python -m spes.server" in helped.stdout, helped.stderr
    refused = server("run.yaml", "--server.merge_topk=0")
    assert refused.returncode == 2 and "config key 'server.merge_topk' = 0 must be >= 1" in refused.stderr


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_failed_tls_handshakes_leave_no_grpc_core_lines(tmp_path: Path) -> None:
    """gRPC's core logged a line of its own (`I... ssl_transport_security.cc ... Handshake failed`) for every
    connection to a TLS server that did not speak TLS: anyone who reached the port wrote one line per connection
    into the server's log, past its throttled warnings; and a `spes.status` with the wrong CA printed it above its
    one-line error."""
    from sync_helpers import write_pki

    pki = write_pki(tmp_path)
    (tmp_path / "other").mkdir()
    other_ca = write_pki(tmp_path / "other").ca
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    tls = ["--tls_cert", pki.server["tls_cert"], "--tls_key", pki.server["tls_key"]]
    argv = [sys.executable, "-m", "spes.server", "configs/tiny.yaml", "--host", "127.0.0.1", "--port", "0", *tls]
    server = subprocess.Popen(argv, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        first = server.stderr.readline()
        assert "listening on 127.0.0.1:" in first, first
        port = int(first.split("listening on 127.0.0.1:")[1].split()[0])
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as plain:
                plain.sendall(b"GET / HTTP/1.1\r\n\r\n")
                plain.recv(100)  # the server closes it: not TLS
        status = subprocess.run(
            [sys.executable, "-m", "spes.status", f"localhost:{port}", "--tls_ca", other_ca],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 1 and len(status.stderr.strip().splitlines()) == 1, status.stderr
        assert status.stderr.startswith(f"error: localhost:{port}: UNAVAILABLE")
    finally:
        server.terminate()
        _, log = server.communicate(timeout=30)
    assert server.returncode == 0
    assert "Handshake failed" not in log and "ssl_transport_security" not in log, log


def test_a_token_sent_in_clear_text_under_insecure_is_a_warning() -> None:
    """run_cluster.sh passes --insecure: a SPES_TOKEN without TLS files crossed the network in clear text unsaid."""
    clear = exposure_warnings(DeployConfig(token="secret", insecure=True))
    assert clear == [
        "--insecure with a token but no --tls_cert/--tls_key: the token travels in clear text, and anyone on the "
        "network path can read it and join the run; add --tls_cert/--tls_key to protect it"
    ]
    assert exposure_warnings(DeployConfig(insecure=True)) == [
        "no SPES_TOKEN or --token_file: anyone who can reach this port can join the run"
    ]
    tls = {"tls_cert": "server.crt", "tls_key": "server.key"}
    assert exposure_warnings(DeployConfig(token="secret", insecure=True, **tls)) == []
    assert exposure_warnings(DeployConfig(token="secret", host="127.0.0.1")) == []


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_closed_terminals_hangup_stops_the_server_as_sigterm_does(tmp_path: Path) -> None:
    """SIGHUP (the terminal it ran in closed) killed the server at once: no shutdown, its streams cut, exit -1."""
    log = tmp_path / "server.log"
    argv = [sys.executable, "-m", "spes.server", "--host", "127.0.0.1", "--port", "0", "--total_peers", "1"]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*argv, "--num_train_experts_per_node", "8", "--state_dir", str(tmp_path / "state")],
            cwd=REPO,
            env=child_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=hangup_as_in_a_terminal,
        )
    try:
        deadline = time.monotonic() + 60
        while "listening" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "listening" in log.read_text(), log.read_text()
        os.killpg(proc.pid, signal.SIGHUP)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        proc.kill()
        proc.wait()
    assert "shutting down" in log.read_text()
