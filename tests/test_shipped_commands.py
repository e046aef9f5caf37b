"""Every command written in a shipped config's header, in a README code block or in a doc (DOCS) is exercised.

`written_commands` reads them: the indented `#   ` lines of each configs/**/*.yaml header and the lines of the
```bash blocks of the README and of DOCS, continuation lines joined. Each command is run here, in a cheap
but real form, or is named in ELSEWHERE with the test file that runs it (checked to exist and to mention it; the
test suite's own command is CI's). What the tests here prove:

- A server command (`run_scripts/run_parameter_server.sh RUN.yaml ...`) runs as written, from a scratch directory
  holding the token and TLS files it names, on a free PORT (replacing one the command sets); every node YAML of
  its run then passes a dry-run join (preflight's check: protocol, credentials, mode, peers, experts per block
  and the model manifest; nothing is registered). Before the server read the run's YAML, configs/diloco_1b's
  documented server refused its nodes.
- A node command (`run_scripts/run_single_node.sh N`, with the header's CONFIG or CONFIG_DIR; node 0's of each
  run) runs as written with `--preflight`, the server's address and credentials appended, against a server
  started from its run's YAML (one per run, shared by its node commands): its `settings` check passes, so the
  node would be admitted. A centralized node's preflight needs no server. (Its other checks, memory, disk and
  data of a 1B run, fail on this machine.)
- Commands mapped in ELSEWHERE are only linked to a test that runs the same script or module, not always with
  the same arguments (e.g. the README's 1B `spes.train` line: tests/test_train.py trains configs/tiny.yaml).
- The GPU tests' command (`pytest -m gpu`) is run as written, collecting only: it selects every file's GPU tests.
- A launch command (`python -m spes.launch CONFIG`) runs as written for one step per peer on the test corpus and
  ends with its summary (configs/tiny.yaml's is the session's longer quickstart run, conftest.quickstart_run);
  configs/upcycle_tiny.yaml's three commands (random dense model, upcycling, launch) run in order, so its launch
  starts from the checkpoint the upcycling wrote, and trains two rounds away from it.
- A benchmark command (`bench/X.py ...`, docs/benchmarks.md's list among them) gives only flags X parses; its run is
  tests/test_bench.py's `--quick` one (ELSEWHERE). A `bench/report.py` command runs as written with `--check`: every
  document is as its records render it.
- An inline command of the prose of docs/running.md and docs/migrating.md (`.venv/bin/python -m spes.server
  --help`, `bash run_scripts/...`), its placeholders filled, names a module or script that exists, and its flags
  parse with that entry point's own parser (a forwarding script's with the one it runs), config overrides checked
  against the config's keys; the first implementation's column of their tables names its scripts, not spes's.
- The device scripts (`bench/prepare_gpu.sh` here, `bench/run_gpu.sh` and `bench/run_wan_cores.sh` on the lent
  machine) run as written with a `python` that only logs what it would run: the wheels' pins are this machine's, the
  commit file is the benchmarks' commit, and each benchmark's flags are its own, its record under the device's $OUT.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import QUICKSTART
from dist_helpers import _kill_group, _tail, child_env, run_logged
from spes.checkpoint import load_model_state
from spes.config import TrainConfig, load_config
from spes.launch import free_port
from spes.preflight import check_server, manifest
from spes.schema import checked_overrides, override_to_dotlist
from sync_helpers import write_pki

REPO = Path(__file__).resolve().parents[1]
TOKEN = "shipped-commands-secret"

ELSEWHERE = {
    "run_scripts/quickstart.sh": ("tests/test_eval.py", "quickstart.sh"),
    "run_scripts/test.sh": (".ci/run", "run_scripts/test.sh"),
    "eval_scripts/convert_to_hf.sh": ("tests/test_eval.py", "convert_to_hf.sh"),
    "eval_scripts/eval_full.sh": ("tests/test_eval.py", "eval_full.sh"),
    "-m spes.hf ": ("tests/test_hf.py", "hf.main("),
    "-m spes.upcycle ": ("tests/test_upcycle.py", "upcycle.main("),
    "-m spes.train ": ("tests/test_train.py", '"spes.train"'),
    "build_default_corpus.py": ("tests/test_build_default_corpus.py", "build_default_corpus"),
    "train_tokenizer.py": ("tests/test_tokenizer.py", "train_tokenizer"),
    "tokenize_data.py": ("tests/test_tokenize_data.py", "tokenize_data"),
    "list_processed_files.sh": ("tests/test_tokenize_data.py", "list_processed_files.sh"),
    "AutoModelForCausalLM": ("tests/test_eval.py", "AutoModelForCausalLM"),
    "tensorboard --logdir": ("tests/test_tracking.py", "tensorboard"),
    "run_cluster.sh": ("tests/test_cluster.py", "run_cluster.sh"),
    "-m spes.status ": ("tests/test_status_cli.py", '"spes.status"'),
    "bench/mutation.py": ("tests/test_mutation.py", "mutation.main("),
    "SPES_RECORD_LOSS_CURVE=1 ": ("tests/test_loss_curve.py", 'os.environ.get("SPES_RECORD_LOSS_CURVE")'),
    "run_scripts/lint.sh": (".ci/run", "bash run_scripts/lint.sh"),
    "bench/bench_soak.py": ("tests/faults/test_soak.py", '"bench_soak.py"'),
    "bench/bench_overlap.py": ("tests/test_bench.py", '"bench_overlap",'),
    "bench/mini_repro.py": ("tests/test_mini_repro.py", '_run_quick("mini_repro",'),
    "bench/mini_repro_memory.py": ("tests/test_mini_repro.py", '_run_quick("mini_repro_memory",'),
    # its quick run on a clone lent an installed environment and a small corpus (a fresh one installs from the registry)
    "bench/bench_quickstart.py": ("tests/test_bench.py", 'run_bench("bench_quickstart"'),
    **{
        f"bench/{name}.py": ("tests/test_bench.py", f'run_bench("{name}"')
        for name in ("bench_aggregate", "bench_codec", "bench_fused_loss", "bench_memory", "bench_server_memory")
        + ("bench_sync", "bench_train", "bench_wan", "bench_wire")
    },
}
"""Commands run by another test: a fragment of the command -> the test file that runs it and what it calls."""
DOCS = (
    "README.md",
    "docs/migrating.md",
    "docs/running.md",
    "docs/architecture.md",
    "docs/testing.md",
    "docs/benchmarks.md",
)
"""The documents whose ```bash blocks hold commands a user runs."""
NOT_SPES = ("openssl ", "pip install", "import secrets", ".venv/bin/wandb sync ", "iptables ")
"""Commands of other tools, shown for the user's setup (certificates, a token, optional extras, a firewall)."""


def _logical_lines(lines: list[str]) -> list[str]:
    """Lines with their `\\` continuations joined, comments and blanks dropped."""
    joined, current = [], ""
    for line in (line.strip() for line in lines):
        if line.endswith("\\"):
            current += line.removesuffix("\\").strip() + " "
            continue
        current += line
        if current and not current.startswith("#"):
            joined.append(re.sub(r"\s+#\s.*$", "", current).strip())
        current = ""
    return joined


def written_commands() -> list[tuple[str, str]]:
    """(where, command) for every command in a shipped config's header and in the bash blocks of the README and DOCS."""
    found = []
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        header = [line[4:] for line in path.read_text().splitlines() if re.match(r"#   \S|#     ", line)]
        found += [(str(path.relative_to(REPO)), c) for c in _logical_lines(header)]
    for doc in DOCS:
        blocks = re.findall(r"```bash\n(.*?)```", (REPO / doc).read_text(), flags=re.S)
        found += [(doc, c) for block in blocks for c in _logical_lines(block.splitlines())]
    return sorted(set(found))


RUN_HERE = ("run_parameter_server.sh", "run_single_node.sh", "-m spes.launch ", "-m pytest -m gpu ")
DEVICE_SCRIPTS = ("bench/prepare_gpu.sh", "bench/run_gpu.sh", "bench/run_wan_cores.sh")
"""The scripts a session with a lent GPU runs: the first here, the others on the device."""


def kind(command: str) -> str:
    for name in (*RUN_HERE, *DEVICE_SCRIPTS, "bench/report.py"):
        if name in command + " ":
            return name
    fragment = next((f for f in ELSEWHERE if f in command), None)
    if fragment is not None:
        return fragment
    return "other tool" if any(n in command for n in NOT_SPES) else "unknown"


COMMANDS = written_commands()


def of_kind(name: str) -> list[str]:
    return sorted({c for _, c in COMMANDS if kind(c) == name})


def test_every_written_command_is_exercised() -> None:
    assert len(COMMANDS) > 20
    unknown = [f"{where}: {command}" for where, command in COMMANDS if kind(command) == "unknown"]
    assert not unknown, "commands no test runs (add them to a test here or to ELSEWHERE):\n" + "\n".join(unknown)
    for test, call in ELSEWHERE.values():
        assert call in (REPO / test).read_text(), f"{test} does not run {call}"
    assert all(of_kind(name) for name in (*RUN_HERE, *DEVICE_SCRIPTS, "bench/report.py"))


def test_the_written_python_commands_run_the_interpreter_the_quickstart_installs() -> None:
    """run_scripts/setup.sh installs spes and torch into .venv and nothing says to activate it: a bare `python`
    (the system's) ends in `No module named 'spes'` (or 'torch'). The inline commands of PROSE_DOCS too."""
    bare = [
        f"{where}: {c}"
        for where, c in [*COMMANDS, *PROSE]
        if re.match(r"(\S+=\S+\s+)*python3?\s", c) and not any(other in c for other in NOT_SPES)
    ]
    assert not bare, "written commands of a bare python:\n" + "\n".join(bare)


def test_the_readme_table_of_configs_names_every_config() -> None:
    readme = (REPO / "README.md").read_text()
    shipped = [p.name for p in sorted((REPO / "configs").iterdir())]
    assert [name for name in shipped if f"`configs/{name}" not in readme] == []


def test_written_node_commands_that_name_a_secure_server_carry_its_credentials() -> None:
    """A node command that names the server of a multi-node run (token and TLS on, as its server command is written)
    names the token and the CA too: copied as written, a preflight without them fails to connect. (The tests below
    append the credentials to every node command, so they cannot see one left out.)"""
    bare = [
        f"{where}: {command}"
        for where, command in COMMANDS
        if kind(command) == "run_single_node.sh"
        and "--spes_config.server_addr=" in command
        and secure(config_of(node_command(command)))
        and not all(f"--spes_config.{key}=" in command for key in ("token_file", "tls_ca"))
    ]
    assert not bare, "node commands without the token or the CA of their server:\n" + "\n".join(bare)


# ---------------------------------------------------------------------------------------------------------------
# Running them


def test_documented_upcycling_writes_where_the_run_loads() -> None:
    """Every documented `spes.upcycle --config C --out D` writes the checkpoint C's load_path names, and a
    documented node of that run given --load_path is given D: the README's Hub example wrote output/up9b/init/step0,
    which configs/upcycled_9b's nodes (load_path output/spes_upcycled_9b/init/step0) never read."""
    commands = [shlex.split(command) for _, command in COMMANDS]
    upcycles = [argv for argv in commands if "spes.upcycle" in argv and "--out" in argv]
    assert len(upcycles) >= 4
    load_paths = {}
    for argv in upcycles:
        config = argv[argv.index("--config") + 1]
        load_paths[str(Path(config).parent)] = load_config(REPO / config)[0].load_path
        assert argv[argv.index("--out") + 1] == load_paths[str(Path(config).parent)], shlex.join(argv)
    for argv in commands:
        given = [a.partition("=")[2] for a in argv if a.startswith("--load_path=")]
        run = [a.partition("=")[2] for a in argv if a.startswith("CONFIG_DIR=")]
        if given and run:
            assert given == [load_paths[run[0]]], shlex.join(argv)


SECRETS = ("spes.token", "ca.crt", "server.crt", "server.key")
"""The files the headers name: the run's token, the CA, the server's certificate and key."""


def _scratch(directory: Path, secrets: Path | None = None) -> Path:
    """`directory` with the repository's configs and scripts, and SECRETS: made there, or linked from `secrets`."""
    for name in ("configs", "run_scripts"):
        (directory / name).symlink_to(REPO / name)
    if secrets is not None:
        for name in SECRETS:
            (directory / name).symlink_to(secrets / name)
        return directory
    pki = write_pki(directory)
    assert Path(pki.ca) == directory / "ca.crt" and pki.server["tls_cert"] == str(directory / "server.crt")
    token = directory / "spes.token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    return directory


@pytest.fixture(scope="module")
def module_scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's one set of secrets (so one run's server can serve several tests' nodes), in a scratch dir."""
    return _scratch(tmp_path_factory.mktemp("shipped"))


@pytest.fixture
def scratch(tmp_path: Path, module_scratch: Path) -> Path:
    """A directory to run the commands from: the repository's configs and scripts, the token and TLS files."""
    return _scratch(tmp_path, module_scratch)


def credentials(scratch: Path, addr: str, secure: bool) -> list[str]:
    """The node overrides the headers tell the user to set: the server's address and, off loopback, the token
    and the CA."""
    secrets = [f"--spes_config.token_file={scratch / 'spes.token'}", f"--spes_config.tls_ca={scratch / 'ca.crt'}"]
    return [f"--spes_config.server_addr={addr}", *(secrets if secure else [])]


def run_configs(config: str) -> list[str]:
    """The YAML of every node of `config`'s run: its family's node files, or peer overrides of one file."""
    path = REPO / config
    if path.name.startswith("node_"):
        return [str(p.relative_to(REPO)) for p in sorted(path.parent.glob("node_*.yaml"))]
    return [f"{config} --spes_config.peer_id={p}" for p in range(load_config(path)[0].num_peers)]


@contextlib.contextmanager
def started(command: str, cwd: Path, log: Path, env: dict[str, str]) -> Iterator[None]:
    """`bash -c command` in `cwd` until it logs that it listens; killed (its whole group) afterwards."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
        )
    try:
        deadline = time.time() + 90
        while "listening" not in log.read_text():
            if proc.poll() is not None or time.time() > deadline:
                raise AssertionError(f"{command} did not start; log:\n{_tail(log)}")
            time.sleep(0.2)
        yield
    finally:
        _kill_group(proc)


def config_of(command: str) -> str:
    """The node YAML a run_single_node.sh / run_parameter_server.sh / spes.launch command runs."""
    words = shlex.split(command)
    env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S*", w))
    yaml = next((w for w in words if w.endswith(".yaml") and "=" not in w), None)
    if yaml is not None:
        return yaml
    node = words[words.index(next(w for w in words if w.endswith("run_single_node.sh"))) + 1]
    return env.get("CONFIG") or f"{env.get('CONFIG_DIR', 'configs/spes_1b')}/node_{node}.yaml"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", of_kind("run_parameter_server.sh"))
def test_server_commands_admit_every_node_of_their_run(command: str, scratch: Path) -> None:
    port = free_port()
    command = re.sub(r"\bPORT=\d+", f"PORT={port}", command)
    with started(command, scratch, scratch / "server.log", child_env(PORT=str(port), PYTHON=sys.executable)):
        addr = f"localhost:{port}"
        for node in run_configs(config_of(command)):
            path, *peer = node.split()
            cfg, _ = load_config(REPO / path, [*peer, *credentials(scratch, addr, "--tls_cert" in command)])
            shapes, trainable = manifest(cfg)
            checks, client = check_server(cfg, shapes, trainable)
            if client is not None:
                client.close()
            assert [c.status for c in checks] == ["ok", "ok"], f"{node}: {[c.detail for c in checks]}"


def node_command(command: str) -> str:
    """A node command made concrete: `<peer>` is node 0, a `<the same flags>` placeholder is dropped."""
    return re.sub(r"\s*<the same flags>", "", command.replace("<peer>", "0"))


def one_per_run(commands: list[str]) -> list[str]:
    """Node 0's command of each run: the other nodes' differ only in the node number, and the server test already
    dry-joins every node."""
    runs = {re.sub(r"run_single_node\.sh \d+", "run_single_node.sh N", c): c for c in reversed(commands)}
    return sorted(runs.values())


@pytest.fixture(scope="module")
def run_server(module_scratch: Path) -> Iterator[Callable[[str], str]]:
    """`run_server(config)`: the address of a server of `config`'s run, started as its header starts it on the
    first call and shared by that run's later node commands (a preflight only dry-joins and measures the link,
    which changes nothing on the server); every one is stopped after the module."""
    addresses: dict[str, str] = {}
    with contextlib.ExitStack() as stack:

        def address(config: str) -> str:
            if config not in addresses:
                port = free_port()
                tls = " --token_file spes.token --tls_cert server.crt --tls_key server.key" if secure(config) else ""
                server = f"{shlex.quote(sys.executable)} -m spes.server {config} --host 127.0.0.1 --port {port}{tls}"
                log = module_scratch / f"server{len(addresses)}.log"
                stack.enter_context(started(server, module_scratch, log, child_env(PYTHON=sys.executable)))
                addresses[config] = f"localhost:{port}"
            return addresses[config]

        yield address


def secure(config: str) -> bool:
    """A multi-node run's server (its node files' header) takes the token and TLS; a one-file run's is on loopback."""
    return Path(config).name.startswith("node_")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", one_per_run(of_kind("run_single_node.sh")))
def test_node_commands_pass_the_preflight_settings_check(
    command: str, scratch: Path, run_server: Callable[[str], str]
) -> None:
    config = config_of(node_command(command))
    cfg, _ = load_config(REPO / config)
    addr = run_server(config) if cfg.sync_enabled else f"localhost:{free_port()}"
    env = child_env(PYTHON=sys.executable, NPROC_PER_NODE="1")
    extra = ["--preflight", "--link_mb=1", *credentials(scratch, addr, secure(config))]
    node = f"{node_command(command)} {shlex.join(extra)}"
    proc = run_logged(
        ["bash", "-c", f"cd {shlex.quote(str(scratch))} && {node}"], scratch / "node.log", timeout=240, env=env
    )
    lines = {line.split()[1]: line for line in proc.stdout.splitlines() if re.match(r"(ok|FAIL|skip)\s+\w", line)}
    if cfg.sync_enabled:
        assert lines.get("settings", "").startswith("ok "), proc.stdout[-3000:]
    else:
        assert lines.get("server", "").startswith("skip") and "no parameter server" in lines["server"], proc.stdout


def run_python(command: str, scratch: Path, *extra: str, timeout: float = 380) -> subprocess.CompletedProcess[str]:
    """A `python -m ...` command as written (with this interpreter and the `VAR=value` words before it in its
    environment), `extra` appended, run in `scratch`."""
    words = shlex.split(command)
    env = dict(w.split("=", 1) for w in words[: words.index("-m")] if re.fullmatch(r"[A-Z_]+=\S*", w))
    proc = subprocess.run(
        [sys.executable, *words[words.index("-m") :], *extra],
        cwd=scratch,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc


def one_step(corpus) -> list[str]:  # type: ignore[no-untyped-def]
    """Launch overrides for one step per peer on the test corpus, nothing evaluated or saved."""
    return [
        "--",
        f"--tokenizer.identifier={corpus.tokenizer}",
        f"--data.paths=[{corpus.train}]",
        "--data.validation_paths=[]",
        "--max_duration=1st",
        "--spes_config.sync_steps=1",
        "--eval_interval=null",
        "--save_interval=null",
    ]


@pytest.mark.slow
@pytest.mark.timeout(450)
@pytest.mark.parametrize("command", [c for c in of_kind("-m spes.launch ") if "upcycle" not in c])
def test_launch_commands_run(command: str, scratch: Path, tiny_corpus, request: pytest.FixtureRequest) -> None:
    words = shlex.split(command)
    if words[words.index("-m") :] == QUICKSTART:  # the session's quickstart run is this command, as written
        stdout = request.getfixturevalue("quickstart_run").stdout
    else:
        stdout = run_python(
            command, scratch, "--out", str(scratch / "run"), "--timeout", "360", *one_step(tiny_corpus)
        ).stdout
    assert "SPES run summary" in stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", [c for c in of_kind("-m spes.train ") if " configs/tiny.yaml " in c])
def test_tiny_train_commands_run_as_written(command: str, scratch: Path, tiny_corpus) -> None:
    """A doc's `spes.train configs/tiny.yaml ...` trains two steps as written, on the test corpus (as a node of a
    SPES run it would wait for a server no command of it starts), and its dashboards write where the docs say:
    tensorboard in its log_dir, wandb where the docs' `wandb sync` reads."""
    data = [f"--tokenizer.identifier={tiny_corpus.tokenizer}", f"--data.paths=[{tiny_corpus.train}]"]
    run_python(command, scratch, *data, "--max_duration=2st", "--eval_interval=null", timeout=240)
    for log_dir in re.findall(r"--tensorboard.log_dir=(\S+)", command):
        assert list((scratch / log_dir).iterdir()), f"{command}: nothing in {log_dir}"
    synced = [c.split()[2] for _, c in COMMANDS if c.startswith(".venv/bin/wandb sync ")]
    assert synced and all(list(scratch.glob(p)) for p in synced if "--wandb." in command), synced


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_upcycle_tiny_header_runs_in_order(scratch: Path, tiny_corpus) -> None:
    """Make a random dense Qwen3 model, upcycle it into the run's load_path, launch the run (4 peers + server)
    from it for two rounds: every peer's experts moved away from the upcycled start."""
    header = [c for where, c in COMMANDS if where == "configs/upcycle_tiny.yaml"]
    make_dense = next(c for c in header if "--make_random_dense" in c)
    upcycle = next(c for c in header if "spes.upcycle" in c and "--out" in c)
    launch = next(c for c in header if "spes.launch" in c)
    tokenizer = f"--tokenizer.identifier={tiny_corpus.tokenizer}"
    run_python(make_dense, scratch, tokenizer)
    assert "equals the dense model at step 0" in run_python(upcycle, scratch, tokenizer).stdout
    two_rounds = ["--max_duration=2st", "--save_interval=2"]
    proc = run_python(launch, scratch, "--timeout", "360", *one_step(tiny_corpus), *two_rounds)
    assert "SPES run summary" in proc.stdout
    cfg, _ = load_config(REPO / "configs" / "upcycle_tiny.yaml")
    run = scratch / shlex.split(launch)[shlex.split(launch).index("--out") + 1]
    summary = json.loads((run / "summary.json").read_text())
    assert [(row["steps"], row["rounds"]) for row in summary["peers"]] == [(2, 2)] * cfg.num_peers
    start = load_model_state(scratch / str(cfg.load_path))
    for peer in range(cfg.num_peers):
        trained = load_model_state(run / f"node{peer}" / "step2")
        assert not torch.equal(trained["blocks.0.ffn.experts.w1.0"], start["blocks.0.ffn.experts.w1.0"])


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("command", of_kind("-m pytest -m gpu "))
def test_the_gpu_test_command_selects_the_gpu_tests_and_no_other(command: str) -> None:
    """Run as written but only collecting (this machine may have no CUDA to run them on): it selects the tests of
    every file holding a test marked `gpu`, and nothing from any other file."""
    proc = run_python(command, REPO, "--collect-only", timeout=200)
    selected = {line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line}
    marked = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "tests").rglob("test_*.py")
        if re.search(r"\bpytest\.mark\.gpu\b", p.read_text())
    }
    assert marked and selected == marked, proc.stdout[-3000:]


SCRIPTS = sorted(
    str(p.relative_to(REPO))
    for d in ("run_scripts", "eval_scripts", "data_process_scripts")
    for p in (REPO / d).glob("*.sh")
)


DELEGATED_HELP = {
    "run_scripts/run_parameter_server.sh": "usage: python -m spes.server",
    "run_scripts/test.sh": "usage: python -m pytest",
}
"""Scripts whose `--help` is the help of the command they run."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help_and_does_nothing_else(script: str, tmp_path: Path) -> None:
    """`--help` prints how to use the script and exits 0 (it ran the quickstart, or took `--help` for a model)."""
    proc = subprocess.run(
        ["bash", str(REPO / script), "--help"],
        cwd=tmp_path,
        env=child_env(PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=100,
    )
    expected = DELEGATED_HELP.get(script, f"{script} ")  # a line of the header showing how to run it
    assert proc.returncode == 0 and expected in proc.stdout, proc.stdout + proc.stderr
    assert not list(tmp_path.iterdir()), "it wrote files"


# ---------------------------------------------------------------------------------------------------------------
# Benchmarks: their written flags, the report, the device scripts


class Parsed(Exception):
    """Raised with an entry point's parsed arguments and the words it left to the config, before it runs anything."""


def parsed_by(main: Callable[[list[str]], Any], argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Parsed:
    """`argv` as `main`'s argument parser reads it, without running `main` (every entry point parses its arguments
    first): the namespace and the words left over, which the entry point takes as config overrides. A parse_args
    runs in full (a subparser's or subclass's parse_known_args within it included); a parse_known_args called
    directly leaves its rest to the caller."""
    parse, known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def stop(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", known)
        raise Parsed(parse(self, args, namespace), [])

    def stop_known(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> tuple[Any, list[str]]:
        raise Parsed(*known(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", stop_known)
    name = getattr(main, "__module__", main)
    try:
        main(argv)
    except Parsed as done:
        return done
    except SystemExit as exc:
        raise AssertionError(f"{name} refused {shlex.join(argv)} (exit {exc.code})") from None
    finally:
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)
        monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", known)
    raise AssertionError(f"{name} parsed no arguments")


def script_main(script: str, monkeypatch: pytest.MonkeyPatch) -> Callable[[list[str]], Any]:
    """The `main` of the Python script at `script` (a path in the repository), imported beside its own folder's
    modules."""
    monkeypatch.syspath_prepend(REPO / Path(script).parent)
    return importlib.import_module(Path(script).stem).main


def parsed(script: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """`argv` as `bench/<script>` parses it, without running it (the smoke tests run it with `--quick`, not with the
    flags the docs write)."""
    done = parsed_by(script_main(f"bench/{Path(script).name}", monkeypatch), argv, monkeypatch)
    assert not done.args[1], f"{script} refused {done.args[1]}"
    return done.args[0]


BENCH_SCRIPT = re.compile(r"(?:^|\s)bench/(\w+\.py)(?:\s|$)")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", sorted({c for _, c in COMMANDS if BENCH_SCRIPT.search(c)}))
def test_written_benchmark_flags_are_the_benchmarks_own(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    words = shlex.split(command)
    script = next(w for w in words if BENCH_SCRIPT.fullmatch(w))
    parsed(script, words[words.index(script) + 1 :], monkeypatch)


PROSE_DOCS = ("README.md", "docs/running.md", "docs/migrating.md")
"""The documents whose prose writes commands inline (`python -m spes.server --help`), beside their ```bash blocks."""
COMMAND_START = re.compile(r"([A-Z_]+=\S+ )*(\.venv/bin/python|python3?|bash|sbatch) |spes\.\w+ .*-|[\w/]+\.(py|sh) ")
"""How an inline command span begins: an interpreter or a launcher, a script followed by its arguments, or a module
followed by flags (`spes.hf import` names a subcommand)."""
SCRIPT_DIRS = ("run_scripts", "eval_scripts", "data_process_scripts", "bench")
FORWARDED = {
    "run_scripts/run_single_node.sh": ("spes.train", 1),
    "run_scripts/run_cluster.sh": ("spes.train", 0),
    "run_scripts/quickstart.sh": ("spes.train", 0),
    "run_scripts/run_parameter_server.sh": ("spes.server", 0),
}
"""Scripts that pass their arguments on: to which entry point, after how many of their own (run_single_node.sh's
node id)."""


def _prose(text: str) -> str:
    """`text` without its code blocks and without the cells of a table's column of the first implementation, which
    names its scripts (`run_scripts/wandb_sync.sh`), not spes's."""
    lines, column = [], None
    for line in re.sub(r"```.*?```", "", text, flags=re.S).splitlines():
        cells = line.strip().strip("|").split("|")
        if not line.startswith("|"):
            column = None
        elif column is None and "the first implementation" in [c.strip() for c in cells]:
            column = [c.strip() for c in cells].index("the first implementation")
        if column is not None and column < len(cells):
            cells[column] = ""
            line = "|".join(cells)
        lines.append(line)
    return "\n".join(lines)


def prose_commands(doc: str) -> list[str]:
    """The command spans of `doc`'s prose, each on one line."""
    spans = (" ".join(span.split()) for span in re.findall(r"`([^`]+)`", _prose((REPO / doc).read_text())))
    return [span for span in spans if COMMAND_START.match(span)]


PROSE = sorted({(doc, command) for doc in PROSE_DOCS for command in prose_commands(doc)})


def _concrete(command: str) -> list[str]:
    """The words of `command` with its placeholders filled: `<what ... flags>` or `<... overrides>` (arguments)
    dropped, any other `<...>` or a value `...` one word, `[--optional]` given."""
    command = re.sub(r"\s*<[^>]*(flags|overrides)>", "", command)
    command = re.sub(r"<[^>]*>|(?<=[= ])\.\.\.(?= |$)", "1", re.sub(r"\[([^]]*)\]", r"\1", command))
    return shlex.split(command)


def entry_point(command: str) -> tuple[str, list[str]]:
    """(entry point, its arguments) of an inline command: a module `spes.X` or a script's path in the repository
    (a bare script name is looked for in SCRIPT_DIRS); the environment words and a launcher's options dropped."""
    words = _concrete(command)
    words = words[next(i for i, w in enumerate(words) if not re.fullmatch(r"[A-Z_]+=\S*", w)) :]
    if re.fullmatch(r"(\.venv/bin/)?python3?", words[0]):
        words = words[1:]
    if words[0] == "-m":
        return words[1], words[2:]
    if words[0] in ("bash", "sbatch"):
        words = words[next(i for i, w in enumerate(words[1:], 1) if not w.startswith("-")) :]
    if words[0].startswith("spes."):
        return words[0], words[1:]
    found = [f"{d}/{words[0]}" for d in SCRIPT_DIRS if (REPO / d / words[0]).is_file()]
    return (found[0] if "/" not in words[0] and len(found) == 1 else words[0]), words[1:]


def check_overrides(overrides: list[str]) -> None:
    """Every override names a config key and holds a value of its type (as spes.train checks them)."""
    checked_overrides(TrainConfig, [override_to_dotlist(o) for o in overrides])


def parse_module(module: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`argv` parsed as `python -m module` parses it, its config overrides checked; `--help` may end it (exit 0)."""
    assert importlib.util.find_spec(module) is not None, f"no module {module}"
    main = importlib.import_module(module).main
    if "--help" in argv:
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0, f"{module} refused {shlex.join(argv)}"
        return None
    if module in ("spes.train", "spes.launch"):  # their own parse_args splits the overrides off: (..., overrides, ...)
        return check_overrides(importlib.import_module(module).parse_args(argv)[1])
    namespace, rest = parsed_by(main, argv, monkeypatch).args
    check_overrides([*rest, *getattr(namespace, "overrides", [])])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", sorted({c for _, c in PROSE}))
def test_inline_commands_name_an_entry_point_that_parses_their_flags(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An inline command of PROSE_DOCS names a module or script that exists and gives it only what it takes: a
    module's flags its parser's, a Python script's its main's, a forwarding script's (FORWARDED) those of the entry
    point it runs; any other script no flag but `--help`, which prints its header."""
    entry, argv = entry_point(command)
    if entry.startswith("spes."):
        return parse_module(entry, argv, monkeypatch)
    assert (REPO / entry).is_file(), f"{command}: no script {entry}"
    if entry.endswith(".py"):
        namespace, rest = parsed_by(script_main(entry, monkeypatch), argv, monkeypatch).args
        assert not rest, f"{entry} refused {rest}"
    elif entry in FORWARDED:
        module, own = FORWARDED[entry]
        parse_module(module, argv[own:], monkeypatch)
    elif argv == ["--help"]:  # a script's header is its help
        done = subprocess.run(["bash", str(REPO / entry), "--help"], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0 and entry in done.stdout, done.stdout + done.stderr
    else:
        assert not [w for w in argv if w.startswith("-")], f"{entry} takes no flags but --help"


def test_the_inline_commands_are_found() -> None:
    """The spans of both documents' prose, but none of the first implementation's own commands."""
    found = {doc for doc, _ in PROSE}
    commands = " ".join(c for _, c in PROSE)
    assert found == set(PROSE_DOCS) and len(PROSE) > 20, PROSE
    assert "python -m spes.unshard" in commands and "bash eval_scripts/convert_to_hf.sh" in commands
    assert "wandb_sync.sh" not in commands and "convet_model" not in commands


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", of_kind("bench/report.py"))
def test_written_report_commands_find_every_document_as_its_records_render_it(command: str) -> None:
    """Run as written with `--check` appended (as written, a stale document would be rewritten in the checkout)."""
    words = shlex.split(command)
    proc = subprocess.run(
        [sys.executable, *words[1:], "--check"], cwd=REPO, capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def stub_python(directory: Path) -> tuple[Path, Path]:
    """A `python` that runs `-c` code with this interpreter and only logs any other call (a pip download or install,
    the GPU tests, a benchmark): its path, and the log's, one line of tab-separated arguments per call."""
    stub, log = directory / "python", directory / "calls.tsv"
    stub.write_text(
        "#!/usr/bin/env bash\n"
        f'[ "$1" = -c ] && exec {shlex.quote(sys.executable)} "$@"\n'
        f'printf "%s\\t" "$@" >> {shlex.quote(str(log))}; echo >> {shlex.quote(str(log))}\n'
    )
    stub.chmod(0o755)
    return stub, log


def calls(log: Path) -> list[list[str]]:
    return [line.removesuffix("\t").split("\t") for line in log.read_text().splitlines()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", of_kind("bench/run_gpu.sh") + of_kind("bench/run_wan_cores.sh"))
def test_written_device_commands_run_their_benchmark_with_its_own_flags(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run as written, with a python that only logs what it is asked to run (this machine has no GPU): the
    benchmark's arguments are ones it takes and its record goes to the device's $OUT, which the session gets back; a
    flag the benchmark renamed would otherwise fail on the lent GPU, whose time is short."""
    stub, log = stub_python(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        ["bash", "-c", command],
        cwd=REPO,
        env=child_env(PYTHON=str(stub), OUT=str(out)),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (bench,) = [argv for argv in calls(log) if BENCH_SCRIPT.fullmatch(argv[0])]
    args = parsed(bench[0], bench[1:], monkeypatch)
    assert args.out.parent == out and list(out.glob("*.log")), (bench, sorted(out.iterdir()))
    if "run_gpu.sh" in command:
        assert any(argv[:4] == ["-m", "pytest", "-m", "gpu"] for argv in calls(log)), calls(log)


def linked_bench(directory: Path) -> None:
    """`directory`/bench: the checkout's bench/ file by file, so what a script writes beside it lands in `directory`."""
    (directory / "bench").mkdir()
    for path in (REPO / "bench").iterdir():
        (directory / "bench" / path.name).symlink_to(path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script", ["bench/prepare_gpu.sh", "bench/run_gpu.sh", "bench/run_wan_cores.sh"])
def test_device_scripts_answer_help_and_do_nothing_else(script: str, tmp_path: Path) -> None:
    """`--help` prints the header, which shows how to run the script, and exits 0 before any work: it downloaded
    the wheels (prepare_gpu.sh), or installed them and ran the GPU tests and the benchmark (run_gpu.sh)."""
    linked_bench(tmp_path)
    stub, log = stub_python(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        ["bash", str(tmp_path / script), "--help"],
        cwd=tmp_path,
        env=child_env(PYTHON=str(stub), OUT=str(out)),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0 and f"bash {script}" in proc.stdout, proc.stdout + proc.stderr
    assert not log.exists(), calls(log)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench", "out", "python"] and not list(out.iterdir())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", of_kind("bench/prepare_gpu.sh"))
def test_written_gpu_preparation_downloads_this_machines_pins_and_names_the_commit(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run as written from a copy of the checkout's bench/ (it writes .whl/ beside it), with a python that only
    logs its pip downloads: one per wheel, for the device's CPython 3.12, pinned to this machine's versions (the
    generated gRPC code needs them), and .whl/COMMIT the commit every record of the device run will name."""
    linked_bench(tmp_path)
    stub, log = stub_python(tmp_path)
    env = {k: v for k, v in child_env(PYTHON=str(stub)).items() if k != "SPES_COMMIT"}
    proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0 and "bash bench/run_gpu.sh" in proc.stdout, proc.stdout + proc.stderr
    downloads = calls(log)
    assert downloads and all(argv[:3] == ["-m", "pip", "download"] for argv in downloads), downloads
    for argv in downloads:
        assert argv[argv.index("--python-version") + 1] == "3.12" and argv[argv.index("-d") + 1] == ".whl", argv
        name, _, version = argv[-1].partition("==")
        assert name == "liger-kernel" or version == importlib.metadata.version(name), argv
    monkeypatch.delenv("SPES_COMMIT", raising=False)
    monkeypatch.syspath_prepend(REPO / "bench")
    from common import git_commit

    assert (tmp_path / ".whl" / "COMMIT").read_text().strip() == git_commit()
