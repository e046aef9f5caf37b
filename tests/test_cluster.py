"""run_scripts/run_cluster.sh under a real one-host SLURM: slurmctld + slurmd configured in a temp dir
(SLURM_CONF), the tiny config as a 2-node SPES run (2 tasks on this host), the parameter server on
"node" 0. Needs Debian's slurm-wlm (installed here with apt-get when missing and possible) and root
(slurmd launches the job steps); the test is skipped, saying why, only when those cannot be had.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dist_helpers import REPO, SMALL_NODE, child_env, run_logged
from spes.launch import free_port
from spes.torchrun import SHUTDOWN_TIMEOUT_S

SCRIPT = REPO / "run_scripts" / "run_cluster.sh"
SLURM_BINARIES = ("sbatch", "scontrol", "slurmctld", "slurmd")


def _ensure_slurm() -> str | None:
    """None when SLURM can run here, else the reason it cannot (after trying to install it)."""
    if os.geteuid() != 0:
        return "slurmd must run as root to launch job steps; run the test suite as root"
    if all(shutil.which(b) for b in SLURM_BINARIES):
        return None
    if shutil.which("apt-get") is None:
        return "SLURM is not installed and there is no apt-get to install Debian's slurm-wlm"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm"]
    proc = subprocess.run(install, capture_output=True, text=True, timeout=600, env=env)
    if proc.returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=300, env=env)
        proc = subprocess.run(install, capture_output=True, text=True, timeout=600, env=env)
    if proc.returncode != 0 or not all(shutil.which(b) for b in SLURM_BINARIES):
        return f"cannot install slurm-wlm with apt-get: {proc.stderr.strip()[-300:]}"
    return None


@dataclass(frozen=True)
class Slurm:
    conf: Path
    root: Path

    def env(self, **extra: str) -> dict[str, str]:
        return child_env(SLURM_CONF=str(self.conf), **extra)


def _write_conf(root: Path, host: str) -> Path:
    """A one-node cluster without munge (auth/none, cred/none), state and logs under `root`."""
    cpus = os.cpu_count() or 1
    (root / "state").mkdir()
    (root / "spool").mkdir()
    conf = root / "slurm.conf"
    conf.write_text(f"""ClusterName=spestest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    return conf


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    reason = _ensure_slurm()
    if reason is not None:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    cluster = Slurm(conf=_write_conf(root, socket.gethostname().split(".")[0]), root=root)
    daemons = [
        subprocess.Popen(
            [daemon, "-D", "-f", str(cluster.conf)],
            env=cluster.env(),
            cwd=root,
            stdout=open(root / f"{daemon}.out", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for daemon in ("slurmctld", "slurmd")
    ]
    try:
        deadline = time.time() + 60
        while (
            "idle"
            not in subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=cluster.env()).stdout
        ):
            if time.time() > deadline or any(d.poll() is not None for d in daemons):
                pytest.fail(f"the one-host SLURM did not come up; see {root}/slurmctld.log and slurmd.log")
            time.sleep(0.5)
        yield cluster
    finally:
        subprocess.run(["scancel", "--full", "--partition=debug"], env=cluster.env(), capture_output=True, timeout=30)
        for daemon in daemons:
            os.killpg(daemon.pid, 15)
        for daemon in daemons:
            daemon.wait(timeout=30)


def test_outside_a_slurm_job_the_script_says_how_to_submit(tmp_path: Path) -> None:
    env = {k: v for k, v in child_env().items() if not k.startswith("SLURM_")}
    proc = run_logged(["bash", str(SCRIPT)], tmp_path / "out.log", timeout=30, env=env)
    assert proc.returncode == 2 and "submit with: sbatch --nodes=N" in proc.stdout
    assert "or run it on every node with RANK=<node id> MASTER_ADDR=<node 0's host>" in proc.stdout
    proc = run_logged(["bash", str(SCRIPT)], tmp_path / "out.log", timeout=30, env={**env, "RANK": "4"})
    assert proc.returncode == 2 and "RANK=4 must be a node id in [0, 4)" in proc.stdout


def test_a_node_but_0_without_master_addr_or_a_port_of_0_is_refused_naming_it(tmp_path: Path) -> None:
    """Node 1 took 127.0.0.1 for node 0's host: on its own machine it found no server and retried for minutes. PORT=0
    (the OS's choice, as DATA_PORT=0) told every node port 0."""
    env = {
        k: v for k, v in child_env().items() if not k.startswith("SLURM_") and k not in ("MASTER_ADDR", "SERVER_HOST")
    }
    env.update(RANK="1", CONFIG="configs/tiny.yaml")
    proc = run_logged(["bash", str(SCRIPT)], tmp_path / "out.log", timeout=30, env=env)
    assert proc.returncode == 2 and proc.stdout.strip().splitlines() == [
        "run_cluster.sh: error: RANK=1 but MASTER_ADDR is not set: set MASTER_ADDR=<node 0's host> (or SERVER_HOST), "
        "where node 0 runs the parameter server"
    ]
    proc = run_logged(["bash", str(SCRIPT)], tmp_path / "out.log", timeout=30, env={**env, "RANK": "0", "PORT": "0"})
    assert proc.returncode == 2 and proc.stdout.strip().splitlines() == [
        "run_cluster.sh: error: PORT=0 must be a fixed port in [1, 65535]: the nodes are told it before the server "
        "starts (only DATA_PORT may be 0, chosen by the OS)"
    ]


def test_rank_set_inside_a_slurm_job_is_the_first_implementations_contract(tmp_path: Path) -> None:
    """A wrapper that `srun`s the script with each node's RANK (the first implementation's way under SLURM): every
    task took the SLURM branch, as if it were the batch step, and `srun`ed the whole run again."""
    env = {k: v for k, v in child_env().items() if not k.startswith("SLURM_")}
    env.update(SLURM_JOB_ID="7", SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_JOB_NODELIST="n0", RANK="4")
    proc = run_logged(["bash", str(SCRIPT)], tmp_path / "out.log", timeout=30, env=env)
    assert proc.returncode == 2 and "RANK=4 must be a node id in [0, 4)" in proc.stdout


def test_a_job_submitted_from_another_folder_is_refused_saying_where_to_submit_from(tmp_path: Path) -> None:
    """sbatch runs a copy of the script, so the repository is the folder sbatch was run in: submitted from another
    one, the job ended in a traceback (no spes importable there) or a config "not found" that was there."""
    elsewhere = tmp_path / "my runs ü"
    elsewhere.mkdir()
    env = {k: v for k, v in child_env().items() if not k.startswith("SLURM_")}
    env.update(SLURM_JOB_ID="7", SLURM_JOB_NODELIST="n0", SLURM_SUBMIT_DIR=str(elsewhere))
    env.update(CONFIG=str(REPO / "configs" / "tiny.yaml"))
    proc = run_logged(["bash", str(SCRIPT)], tmp_path / "out.log", timeout=30, env=env)
    assert proc.returncode == 2 and proc.stdout.strip().splitlines() == [
        f"run_cluster.sh: error: {elsewhere} (SLURM_SUBMIT_DIR, where sbatch was run) is not the spes repository: "
        "submit from the repository's root (cd <repository> && sbatch ... run_scripts/run_cluster.sh) or set "
        "SPES_ROOT=<repository>"
    ]
    proc = run_logged(["bash", str(SCRIPT)], tmp_path / "out.log", timeout=30, env={**env, "SPES_ROOT": str(REPO)})
    assert "is not the spes repository" not in proc.stdout  # SPES_ROOT names the repository


def _node_0_recorded(
    tmp_path: Path, server_args: str, *extra: str, cwd: Path = REPO, **settings: str
) -> tuple[int, str, list[str], list[str]]:
    """Node 0 of a RANK-started run, started in `cwd` with `settings` over the test's, with a PYTHON that records
    what the server and the trainer are started with: the script's exit code and output, the server's arguments and
    the trainer's."""
    tmp_path.mkdir(exist_ok=True)
    python = tmp_path / "python"
    python.write_text(
        f"""#!/bin/bash
case "$1 $2" in
  "-m spes.server") printf '%s\\n' "$@" > {shlex.quote(str(tmp_path / "server.args"))}; echo listening; exec sleep 30 ;;
  "-m spes.preflight") echo "1 the CPU" ;;
  "-m spes.torchrun") printf '%s\\n' "$@" > {shlex.quote(str(tmp_path / "node.args"))} ;;
  *) exec {shlex.quote(sys.executable)} "$@" ;;
esac
"""
    )
    python.chmod(0o755)
    env = {k: v for k, v in child_env().items() if not k.startswith("SLURM_")}
    env.update(
        RANK="0",
        MASTER_ADDR="127.0.0.1",
        CONFIG="configs/tiny.yaml",
        PYTHON=str(python),
        LOG_DIR=str(tmp_path / "logs"),
        STATE_DIR=str(tmp_path / "state"),
        SERVER_LINGER="0",
        SERVER_ARGS=server_args,
    )
    env.update(settings)
    proc = run_logged(["bash", str(SCRIPT), *extra], tmp_path / "out.log", timeout=50, env=env, cwd=cwd)
    recorded = [(tmp_path / f"{name}.args") for name in ("server", "node")]
    server, node = (f.read_text().splitlines() if f.is_file() else [] for f in recorded)
    return proc.returncode, proc.stdout, server, node


@pytest.mark.timeout(60)
def test_server_args_reach_the_server_only(tmp_path: Path) -> None:
    """The TLS files of a protected run: the extra arguments reach the server and every trainer, and a trainer takes
    only --section.key=value overrides (`--tls_cert server.crt` ended it: "expected one config file"), so the
    server's own flags come in SERVER_ARGS."""
    code, out, server, node = _node_0_recorded(
        tmp_path, "--tls_cert server.crt --tls_key server.key", "--spes_config.tls_ca=ca.crt"
    )
    assert code == 0, out
    assert server[:3] == ["-m", "spes.server", "configs/tiny.yaml"] and "--spes_config.tls_ca=ca.crt" in server
    assert server[-5:] == ["--insecure", "--tls_cert", "server.crt", "--tls_key", "server.key"]
    assert "--spes_config.tls_ca=ca.crt" in node and "--tls_cert" not in node


@pytest.mark.timeout(60)
def test_server_args_hold_paths_with_spaces_quoted_as_in_a_shell(tmp_path: Path) -> None:
    """SERVER_ARGS was split at every space: a TLS file under "/etc/spes certs" reached the server as two paths."""
    certs = tmp_path / "spes certs ü"
    code, out, server, _ = _node_0_recorded(tmp_path, f"--tls_cert '{certs}/server.crt' --tls_key \"{certs}/s k.key\"")
    assert code == 0, out
    assert server[-5:] == ["--insecure", "--tls_cert", f"{certs}/server.crt", "--tls_key", f"{certs}/s k.key"]
    code, out, server, _ = _node_0_recorded(tmp_path / "unbalanced", f"--tls_cert '{certs}/server.crt")
    assert code == 2 and out.strip().splitlines()[-1] == (
        f"run_cluster.sh: error: SERVER_ARGS=--tls_cert '{certs}/server.crt cannot be split into words (No closing "
        "quotation): quote each path as in a shell"
    )


@pytest.mark.timeout(60)
def test_started_from_another_folder_its_relative_settings_are_from_there(tmp_path: Path) -> None:
    """Started by hand in another folder, LOG_DIR=logs went into the repository's logs (named as logs), and CONFIG
    beside the user was "not found"."""
    here = tmp_path / "my runs ü"
    here.mkdir()
    (here / "node ü.yaml").write_text((REPO / "configs" / "tiny.yaml").read_text())
    code, out, server, node = _node_0_recorded(
        tmp_path, "", cwd=here, CONFIG="node ü.yaml", LOG_DIR="logs ü", STATE_DIR="state ü"
    )
    assert code == 0, out
    assert f"(log {here}/logs ü/server.log, state {here}/state ü)" in out
    assert (here / "logs ü" / "server.log").is_file() and not (REPO / "logs ü").exists()
    assert server[2] == f"{here}/node ü.yaml" and server[server.index("--state_dir") + 1] == f"{here}/state ü"
    assert f"{here}/node ü.yaml" in node


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_rank_master_addr_contract_runs_a_two_node_run_without_slurm(tiny_corpus, tmp_path: Path) -> None:
    """The first implementation's contract (RANK, MASTER_ADDR, NPROC_PER_NODE from any scheduler, or by hand): the
    script started once per node; node 0 starts the server, each node trains in its own data order (one CONFIG for
    both: data.seed + 1000 * RANK), and node 0 stops the server after SERVER_LINGER seconds."""
    run = tmp_path / "run"
    overrides = [
        *SMALL_NODE,
        "--spes_config.num_peers=2",
        "--spes_config.num_train_experts_per_node=4",
        "--spes_config.sync_steps=2",
        "--max_duration=6st",
        "--save_interval=null",
        f"--tokenizer.identifier={tiny_corpus.tokenizer}",
        f"--data.paths=[{tiny_corpus.train}]",
        "--data.validation_paths=[]",
        f"--save_folder={run}/node${{spes_config.peer_id}}",
    ]
    port = str(free_port())
    base = {k: v for k, v in child_env().items() if not k.startswith("SLURM_")}
    procs = []
    for rank in (0, 1):
        env = {
            **base,
            "RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29999",  # the scheduler's, not the node's: cleared before torchrun
            "WORLD_SIZE": "2",
            "NPROC_PER_NODE": "1",
            "CONFIG": "configs/tiny.yaml",
            "PORT": port,
            "LOG_DIR": str(run / "logs"),
            "SERVER_LINGER": "1",
            "PYTHON": sys.executable,
        }
        log = open(tmp_path / f"node{rank}.log", "w")
        procs.append(
            subprocess.Popen(
                ["bash", str(SCRIPT), *overrides], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )  # fmt: skip
    try:
        codes = [p.wait(timeout=270) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    outs = [(tmp_path / f"node{rank}.log").read_text() for rank in (0, 1)]
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert "listening" in (run / "logs" / "server.log").read_text()
    for rank, (out, seed) in enumerate(zip(outs, (6198, 7198))):
        assert f"node {rank} of 2 on" in out and f"server 127.0.0.1:{port}" in out and f"data order seed {seed} " in out
        records = [json.loads(line) for line in (run / f"node{rank}" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "sync_s" in r] == [2, 4, 6], f"node {rank}'s rounds"
    assert "stopping the parameter server in 1 s" in outs[0]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_job_with_fewer_tasks_than_the_config_has_peers_is_refused(slurm: Slurm, tmp_path: Path) -> None:
    """The batch step checks the config against the allocation before starting anything."""
    env = slurm.env(
        SLURM_JOB_ID="1",
        SLURM_NTASKS="3",
        SLURM_JOB_NODELIST=socket.gethostname().split(".")[0],
        SLURM_SUBMIT_DIR=str(REPO),
        CONFIG="configs/tiny.yaml",
    )
    proc = run_logged(["bash", str(SCRIPT)], tmp_path / "out.log", timeout=60, env=env)
    assert proc.returncode == 2
    assert "spes_config.num_peers=4 but the job runs 3 task(s)" in proc.stdout


def _latest_step(folder: Path) -> int:
    latest = folder / "latest"
    return int(latest.read_text().strip().removeprefix("step")) if latest.is_file() else 0


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_sbatch_runs_a_two_node_spes_run_and_a_killed_job_submitted_again_continues(
    slurm: Slurm, tiny_corpus, tmp_path: Path
) -> None:
    """sbatch of run_cluster.sh: 2 tasks = 2 nodes of one process each (each in its own data order) and the
    server, syncing every 2 steps. The whole job is cancelled mid-run (scancel --signal=KILL: the batch step dies
    at once, SLURM stops the nodes' steps), then the same sbatch again: the server restores its last round from
    --state_dir, every node resumes from its last checkpoint (--resume=auto) and finishes, and each node's
    metrics.jsonl holds every step and every round once."""
    run = tmp_path / "run"
    run.mkdir()
    overrides = [
        *SMALL_NODE,
        "--spes_config.num_peers=2",
        "--spes_config.num_train_experts_per_node=4",
        "--spes_config.sync_steps=2",
        "--max_duration=30st",
        "--save_interval=2",
        f"--tokenizer.identifier={tiny_corpus.tokenizer}",
        f"--data.paths=[{tiny_corpus.train}]",
        "--data.validation_paths=[]",
        f"--save_folder={run}/node${{spes_config.peer_id}}",
    ]

    def submit(attempt: int, *wait: str) -> subprocess.CompletedProcess[str]:
        env = slurm.env(
            CONFIG="configs/tiny.yaml",
            NPROC_PER_NODE="1",
            PORT=str(free_port()),
            LOG_DIR=str(run / f"logs{attempt}"),
            PYTHON=sys.executable,
        )
        return subprocess.run(
            [
                "sbatch",
                *wait,
                "--parsable",
                "--nodes=1",
                "--ntasks=2",
                "--ntasks-per-node=2",
                f"--output={run}/job{attempt}.out",
                str(SCRIPT),
                *overrides,
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )

    first = submit(1)
    assert first.returncode == 0, first.stderr
    job = first.stdout.strip().split(";")[0]
    deadline = time.time() + 180
    while min(_latest_step(run / "node0"), _latest_step(run / "node1")) < 6:
        assert time.time() < deadline, (run / "job1.out").read_text()[-3000:]
        time.sleep(0.2)
    subprocess.run(["scancel", "--full", "--signal=KILL", job], env=slurm.env(), check=True, timeout=30)
    while (
        job
        in subprocess.run(
            ["squeue", "-h", "-o", "%i"], env=slurm.env(), capture_output=True, text=True, timeout=30
        ).stdout.split()
    ):
        time.sleep(0.5)
    saved = {node: _latest_step(run / f"node{node}") for node in (0, 1)}
    assert all(6 <= s < 30 for s in saved.values()), saved

    second = submit(2, "--wait")
    out = (run / "job2.out").read_text() if (run / "job2.out").exists() else "(no job output)"
    assert second.returncode == 0, f"{second.stderr}\n{out[-4000:]}"
    assert "listening" in (run / "logs1" / "server.log").read_text()
    assert "resumed from" in (run / "logs2" / "server.log").read_text()
    for (node, step), seed in zip(saved.items(), (6198, 7198)):
        assert f"{node}: node {node} on" in out and f"data order seed {seed} " in out
        assert f"loaded {run}/node{node}/step{step} (step {step})" in out, out[-4000:]
        records = [json.loads(line) for line in (run / f"node{node}" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(1, 31))
        assert [r["step"] for r in records if "sync_s" in r] == list(range(2, 31, 2)), f"node {node}'s rounds"


# ---------------------------------------------------------------------------------------------------------------
# Stopped by SLURM before the time limit (its #SBATCH --signal): every node saves its last step, none is killed


def test_slurms_signal_comes_before_the_time_limit_by_more_than_the_nodes_shutdown_timeout() -> None:
    """torchrun kills a rank still saving after its shutdown timeout; SLURM kills the job at its time limit."""
    lead = re.search(r"^#SBATCH --signal=TERM@(\d+)$", SCRIPT.read_text(), re.MULTILINE)
    assert lead is not None and int(lead.group(1)) >= SHUTDOWN_TIMEOUT_S + 60  # NOTE: + the server's persist


def _squeued(cluster: Slurm, job: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], env=cluster.env(), capture_output=True, text=True, timeout=30)
    return job in out.stdout.split()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_slurms_signal_stops_every_node_with_its_last_step_saved(slurm: Slurm, tiny_corpus, tmp_path: Path) -> None:
    """The scheduler's SIGTERM reached the task's shell too, which died, ending the task: SLURM killed the nodes
    mid-save. And a node that stopped first (exit 143) made srun's --kill-on-bad-exit signal the others again."""
    overrides = [
        *SMALL_NODE,
        "--spes_config.num_peers=2",
        "--spes_config.num_train_experts_per_node=4",
        "--spes_config.sync_steps=2",
        "--max_duration=100000st",
        "--save_interval=null",
        f"--tokenizer.identifier={tiny_corpus.tokenizer}",
        f"--data.paths=[{tiny_corpus.train}]",
        "--data.validation_paths=[]",
        f"--save_folder={tmp_path}/node${{spes_config.peer_id}}",
    ]
    env = slurm.env(CONFIG="configs/tiny.yaml", NPROC_PER_NODE="1", PORT=str(free_port()), PYTHON=sys.executable)
    env["LOG_DIR"] = str(tmp_path / "logs")
    out = tmp_path / "job.out"
    submit = ["sbatch", "--parsable", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2", f"--output={out}"]
    job = subprocess.run(
        [*submit, str(SCRIPT), *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()
    metrics = [tmp_path / f"node{node}" / "metrics.jsonl" for node in (0, 1)]
    deadline = time.time() + 180
    while not all(m.is_file() and len(m.read_text().splitlines()) >= 3 for m in metrics):
        assert time.time() < deadline and _squeued(slurm, job), out.read_text()[-3000:] if out.exists() else job
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=TERM", job], env=slurm.env(), check=True, timeout=30)  # as at --signal's time
    deadline = time.time() + 90
    while _squeued(slurm, job):
        assert time.time() < deadline, out.read_text()[-3000:]
        time.sleep(0.5)
    log = out.read_text()
    for node in (0, 1):
        folder = tmp_path / f"node{node}"
        step = (folder / "latest").read_text().strip().removeprefix("step")
        said = f"{node}: error: stopped by SIGTERM: saved step {step}'s checkpoint in {folder} and stopped"
        assert said in log, log[-3000:]
    assert "exit code" not in log and "Terminating" not in log, log[-3000:]  # srun killed no node
