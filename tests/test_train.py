"""`python -m spes.train` as users meet it: every failure ends in one line and a non-zero exit (no traceback on
screen, yet none lost: docs/running.md's exit codes and tracebacks), also under torchrun through the project's scripts;
`--resume=auto` continues a killed run where it stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import spes.node
from data_fixtures import write_token_shard
from dist_helpers import SMALL_NODE, child_env, parameter_server, run_logged, without_torch
from peer_nodes import CPU
from spes.atomic import hold_lock, lock_holder
from spes.checkpoint import META_FILE
from spes.config import load_config
from spes.node import (
    SAVE_FOLDER_LOCK,
    build_node,
    claim_save_folder,
    describe_experts,
    holding_save_folder,
    start_checkpoint,
)
from spes.torchrun import ERROR_DIR_ENV
from spes.train import _apply_resume, main, parse_args

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
FAST = ["--using_spes=false", "--eval_interval=null", "--log_interval=1", "--save_interval=null", "--max_duration=2st"]


def train(tmp_path: Path, *args: str, timeout: float = 90, name: str = "train.log") -> tuple[int, str]:
    proc = run_logged([sys.executable, "-m", "spes.train", *args], tmp_path / name, timeout=timeout)
    return proc.returncode, proc.stdout


def assert_one_line(code: int, out: str, *expected: str) -> str:
    """A non-zero exit, no traceback, and the last line the error naming `expected`."""
    last = out.strip().splitlines()[-1] if out.strip() else ""
    assert code != 0 and "Traceback" not in out and last.startswith("error: "), out[-3000:]
    assert all(e in last for e in expected), last
    return last


@pytest.mark.timeout(120)
def test_help_and_a_refused_command_line_or_config_are_answered_without_torch(tmp_path: Path) -> None:
    """Importing torch took most of the two seconds `--help` or a mistyped key took (longer on a busy host): the
    command line and the config are read and refused before it, with the same lines and exit codes."""
    code, out, err = without_torch(tmp_path, "spes.train", "--help")
    assert code == 0 and out.startswith("usage: python -m spes.train") and "--model.d_model=" in out and not err
    (tmp_path / "typo.yaml").write_text("model:\n  d_modle: 64\n")
    refused = {
        ("typo.yaml",): "error: typo.yaml: unknown config key 'model.d_modle'; did you mean 'model.d_model'?",
        (TINY, "--seed=-1"): "error: command line (--seed=-1): config key 'seed' = -1 must be >= 0",
        (TINY, "--seed"): "error: override '--seed' must look like --section.key=value",
        ("gone.yaml",): "error: config file not found: gone.yaml (pass a YAML file, e.g. configs/tiny.yaml)",
        (
            TINY,
            "--resume=always",
        ): "error: command line: '--resume=always' is not an option; use --resume or --resume=auto",
    }
    for argv, line in refused.items():
        assert without_torch(tmp_path, "spes.train", *argv) == (2, "", [line]), argv
    typo = refused[("typo.yaml",)]
    code, out, err = without_torch(tmp_path, "spes.train", "typo.yaml", SPES_DEBUG="1")
    assert (code, out, err[0], err[-1]) == (2, "", "Traceback (most recent call last):", typo), err
    (tmp_path / "errors").mkdir()
    left = without_torch(tmp_path, "spes.train", "typo.yaml", SPES_ERROR_DIR=str(tmp_path / "errors"), RANK="1")
    assert left == (2, "", []) and (tmp_path / "errors" / "rank1.txt").read_text() == typo + "\n"


def test_resume_flags_are_parsed() -> None:
    assert parse_args(["c.yaml", "--resume"])[2] == "always"
    assert parse_args(["c.yaml", "--resume=auto", "--seed=1"]) == ("c.yaml", ["--seed=1"], "auto")
    assert parse_args(["c.yaml"])[2] is None


def test_a_resume_says_when_it_passes_over_the_yamls_load_path(tmp_path: Path) -> None:
    """--resume (and --resume=auto finding a checkpoint) continues save_folder and reads no load_path; a YAML whose
    load_path names the run's starting weights used to be passed over without a word."""
    save, start = tmp_path / "run", tmp_path / "start"
    for checkpoint in (save / "step4", start):
        checkpoint.mkdir(parents=True)
        (checkpoint / META_FILE).write_text("{}")
    note = f"note: resuming save_folder {save}; load_path {start} is not read"
    cfg, _ = load_config(TINY, [f"--save_folder={save}", f"--load_path={start}"])
    assert _apply_resume(cfg, "always") == [note] and cfg.load_path == str(save)
    assert _apply_resume(cfg, "always") == []  # load_path is save_folder already: nothing passed over
    for resume, loaded, said in ((None, start, []), ("auto", save / "step4", [note])):
        cfg, _ = load_config(TINY, [f"--save_folder={save}", f"--load_path={start}"])
        assert _apply_resume(cfg, resume) == []
        logged: list[str] = []
        assert start_checkpoint(cfg, logged.append) == loaded and logged == said, (resume, logged)


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (
            ["--spes_config.peer_id=1"],
            "SPES node, peer 1 of 4; experts: trains 2..3 of 8 in every MoE layer, the others frozen",
        ),
        (
            ["--spes_config.peer_id=3", "--spes_config.num_train_experts_per_node=3"],
            "SPES node, peer 3 of 4; experts: trains none (3 per peer leave it none of 8), only the shared parameters",
        ),
        (
            ["--using_dilico=true", "--spes_config.peer_id=2"],
            "DiLoCo node, peer 2 of 4; experts: trains all 8 of every MoE layer",
        ),
        (["--using_spes=false"], "centralized run; experts: trains all 8 of every MoE layer"),
    ],
)
def test_a_node_says_its_mode_and_which_experts_it_trains(overrides: list[str], said: str) -> None:
    """A DiLoCo node's log said only that it trains every expert, as a centralized run's does: never its mode."""
    assert describe_experts(load_config(TINY, overrides)[0]) == said


def _config_cases(tmp_path: Path, corpus) -> list[tuple[list[str], tuple[str, ...]]]:  # type: ignore[no-untyped-def]
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model:\n  d_model: 64\n n_heads: [4\n")
    big_vocab = write_token_shard(tmp_path / "big_vocab.npy", np.arange(4096, dtype=np.uint16))
    other_eos = write_token_shard(
        tmp_path / "eos.npy", np.arange(4096, dtype=np.uint16), vocab_size=4096, eos_token_id=7
    )
    data = corpus.overrides(tmp_path / "out")
    return [
        ([str(tmp_path / "missing.yaml")], ("config file not found",)),
        ([str(bad_yaml)], ("bad.yaml", "line 3", "not valid YAML")),
        ([TINY, "--model.d_mdoel=3"], ("command line", "did you mean 'model.d_model'")),
        ([TINY, "--model.d_model=abc"], ("command line (--model.d_model=abc)", "expected int")),
        ([TINY, "--data.paths=x.npy"], ("command line", "--data.paths=[x.npy]")),
        ([TINY, "--resume=yes"], ("--resume=auto",)),
        ([TINY, *data, *FAST, f"--data.paths=[{tmp_path}/nothing/*.npy]"], ("data.paths: ", "matches no file")),
        (
            [TINY, *data, *FAST, "--eval_interval=1", "--data.validation_paths=[nope.npy]"],
            ("data.validation_paths: data path 'nope.npy' does not exist",),
        ),
        ([TINY, *data, *FAST, f"--tokenizer.identifier={tmp_path}/no_tokenizer"], ("no_tokenizer",)),
        ([TINY, *data, *FAST, f"--data.paths=[{big_vocab}]"], ("big_vocab.npy", "65536", "model.vocab_size")),
        ([TINY, *data, *FAST, f"--data.paths=[{other_eos}]"], ("eos.npy", "token 7", "model.eos_token_id=7")),
        ([TINY, *data, *FAST, "--resume"], ("nothing to resume", "holds no checkpoint yet", "--resume=auto")),
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_config_data_and_tokenizer_failures_are_one_line(
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first case through `python -m spes.train`, the others through the `main` it calls, in this process (a
    process each would only import torch again)."""
    for i, (argv, expected) in enumerate(_config_cases(tmp_path, tiny_corpus)):
        if i == 0:
            code, out = train(tmp_path, *argv, name=f"case{i}.log")
        else:
            code = main(argv)
            captured = capsys.readouterr()
            out = captured.out + captured.err  # the error line goes to stderr, so it comes last
        assert_one_line(code, out, *expected)
        assert "parameters" not in out, "the model was built before the data was checked"


@pytest.mark.timeout(120)
def test_a_shard_of_a_smaller_vocabulary_is_refused_as_preflight_refuses_it(
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its ids fit the embedding, so only its sidecar tells it came from another tokenizer: it was a warning, and
    the node trained on text its tokenizer reads as other words."""
    shard = write_token_shard(tmp_path / "small.npy", np.arange(4096, dtype=np.uint16) % 300, vocab_size=300)
    code = main([TINY, *tiny_corpus.overrides(tmp_path / "out"), *FAST, f"--data.paths=[{shard}]"])
    captured = capsys.readouterr()
    last = assert_one_line(code, captured.out + captured.err, "small.npy", "vocabulary of 300", "has 4096")
    assert "tokenizer.identifier" in last and "parameters" not in captured.out
    data = tiny_corpus.overrides(tmp_path / "out")[:2]
    valid = ["--eval_interval=1", f"--data.validation_paths=[{shard}]", f"--save_folder={tmp_path / 'out'}"]
    code = main([TINY, *data, *FAST, *valid])  # held-out shards too: the validation loss would be of other text
    captured = capsys.readouterr()
    assert assert_one_line(code, captured.out + captured.err, "small.npy", "vocabulary of 300").endswith(
        "or drop it from data.validation_paths"
    )


@pytest.mark.timeout(120)
def test_a_load_path_that_names_no_checkpoint_is_one_line_before_the_model_is_built(
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Missing, a file, an empty directory: the key, the path and what it should name, through `main`."""
    fix = (
        "point it at a checkpoint directory such as output/<run_name>/node0/step100, or a save folder holding 'latest'"
    )
    nowhere, file, empty = tmp_path / "nowhere" / "step100", tmp_path / "file", tmp_path / "empty"
    file.write_text("x")
    empty.mkdir()
    for path, refusal in {
        nowhere: f"load_path {nowhere}: no such directory ({fix})",
        file: f"load_path {file}: a file, not a directory ({fix})",
        empty: f"load_path {empty} holds no checkpoint: neither a checkpoint directory (a step<N> directory spes "
        f"saved) nor a save folder (holding such directories or a 'latest' file); {fix}",
    }.items():
        code = main([TINY, *tiny_corpus.overrides(tmp_path / "out"), *FAST, f"--load_path={path}"])
        captured = capsys.readouterr()
        assert assert_one_line(code, captured.out + captured.err) == f"error: {refusal}" and code == 2
        assert "parameters" not in captured.out, "the model was built before load_path was checked"


@pytest.mark.timeout(120)
def test_a_save_folder_another_node_is_using_is_refused_naming_its_pid(
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two nodes given one save_folder deleted each other's half-written checkpoints (one died on its vanished
    temporary directory) and interleaved their metrics; the second is now refused before the model is built, and a
    node that has finished lets the next one in."""
    folder = tmp_path / "out"
    folder.mkdir()
    node = [TINY, *tiny_corpus.overrides(folder), *FAST]
    held = hold_lock(folder / SAVE_FOLDER_LOCK)  # another open file: to flock, another node
    try:
        code = main(node)
    finally:
        os.close(held)
    captured = capsys.readouterr()
    assert assert_one_line(code, captured.out + captured.err) == (
        f"error: save_folder {folder} is in use by another node ({lock_holder()}): give each node its own "
        "save_folder (e.g. output/${run_name}/node${spes_config.peer_id}), or stop that process first"
    )
    assert "parameters" not in captured.out and not list(folder.glob("step*"))
    assert main([*node, "--max_duration=1st"]) == 0
    os.close(hold_lock(folder / SAVE_FOLDER_LOCK))  # released when the node ended


def test_a_fresh_start_into_a_folder_holding_saves_says_how_to_continue_that_run_or_start_over(tmp_path: Path) -> None:
    """The same command run again after its run stopped (no --resume) was told the folder held "another run's
    saves"."""
    folder = tmp_path / "out"
    (folder / "step4").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("")
    cfg, _ = load_config(TINY, [f"--save_folder={folder}"])
    with pytest.raises(ValueError) as refused:
        claim_save_folder(cfg, continuing=False, is_main=True, log=print)
    assert str(refused.value) == (
        f"save_folder {folder} already holds a run's saves (step4, metrics.jsonl): continue that run with --resume, "
        "or set save_overwrite=true to start over (it removes them), or choose another save_folder (or run_name)"
    )


def test_the_main_rank_checks_its_save_folder_once_and_an_unusable_one_is_still_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Holding the folder checked it, and claiming it checked it again; every rank (a dry run too) still refuses an
    unusable one before the model is built."""
    checked: list[str] = []
    check = spes.node._usable_folder
    monkeypatch.setattr(spes.node, "_usable_folder", lambda cfg: checked.append(cfg.save_folder) or check(cfg))
    cfg, _ = load_config(TINY, [f"--save_folder={tmp_path / 'out'}"])
    with holding_save_folder(cfg, CPU, print):
        claim_save_folder(cfg, continuing=False, is_main=True, log=print)
    assert checked == [str(tmp_path / "out")]
    (tmp_path / "file").write_text("x")
    cfg, _ = load_config(TINY, [f"--save_folder={tmp_path / 'file'}"])
    for info in (CPU, replace(CPU, rank=1, world_size=2, local_rank=1)):
        with pytest.raises(ValueError, match=r"save_folder .*file is a file, not a folder; choose another save_fold"):
            with holding_save_folder(cfg, info, print):
                pass


def _sigterm(cfg: object, info: object, log: object) -> None:
    """A start_node that receives SIGTERM while the node is being built."""
    os.kill(os.getpid(), signal.SIGTERM)
    raise AssertionError("SIGTERM did not interrupt the node")


@pytest.mark.timeout(60)
def test_a_signal_before_the_training_loop_ends_in_a_line_naming_what_the_save_folder_holds(
    tiny_corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM killed a node still being built (or joining its server) outright, saying nothing, and spes.torchrun
    said every rank had been asked to save; Ctrl-C's line could not say whether there was a checkpoint to continue.
    Under spes.torchrun the line is left for it."""
    folder = tmp_path / "out"
    node = [TINY, *tiny_corpus.overrides(folder), *FAST]
    monkeypatch.setattr(spes.node, "start_node", _sigterm)
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: None)  # NOTE: without the fix, no kill of pytest
    try:
        assert main(node) == 130
        assert capsys.readouterr().err == (
            f"error: interrupted without saving; save_folder {folder} holds no checkpoint yet: start again with "
            "--resume=auto (it starts afresh then)\n"
        )
        (folder / "step4").mkdir()
        (folder / "step4" / META_FILE).write_text("{}")
        (folder / "latest").write_text("step4\n")
        monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
        monkeypatch.delenv("RANK", raising=False)
        assert main(node) == 130 and capsys.readouterr().err == ""
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (tmp_path / "rank0.txt").read_text() == (
        f"error: interrupted without saving; save_folder {folder}'s latest checkpoint is step4: continue from it "
        "with --resume or --resume=auto\n"
    )


@pytest.mark.timeout(120)
def test_a_run_continued_from_an_older_checkpoint_of_its_save_folder_names_it_latest(
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rewind (load_path naming an older checkpoint of the save folder) left `latest` naming the newer one, so a
    crash before the rewound run's first save resumed the abandoned checkpoint, its metrics skipping steps."""
    folder = tmp_path / "out"
    node = [TINY, *tiny_corpus.overrides(folder), *FAST]
    assert main([*node, "--max_duration=8st", "--save_interval=4"]) == 0
    rewind = f"--load_path={os.path.relpath(folder / 'step4')}"  # relative, as typed; save_folder absolute
    assert main([*node, "--max_duration=6st", rewind]) == 0  # it ends as a crash would: unsaved
    assert (folder / "latest").read_text() == "step4\n" and (folder / "step8").is_dir()
    assert (
        f"note: {folder / 'latest'} now names step4, which this run continues; step8 (from before it) stay until this "
        "run saves those steps"
    ) in capsys.readouterr().out
    assert main([*node, "--max_duration=8st", "--resume"]) == 0
    steps = [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))


@pytest.mark.timeout(120)
def test_a_resume_over_other_windows_is_refused_before_the_node_joins_a_server(tiny_corpus, tmp_path: Path) -> None:
    """The loader's refusal came only from the trainer, after the join: a node resumed with another
    model.max_sequence_length joined the run first, or waited out its retries for a restarting server."""
    node = [*tiny_corpus.overrides(tmp_path / "out"), *FAST, "--save_interval=2"]
    assert main([TINY, *node]) == 0
    cfg, _ = load_config(TINY, [*node, "--model.max_sequence_length=32"])
    _apply_resume(cfg, "always")
    with pytest.raises(ValueError, match="saved with windows of 64 tokens but this run's model.max_sequence_length"):
        build_node(cfg, CPU, log=lambda _m: None)


def _never_built(*_args: object) -> None:
    raise AssertionError("the node built its model before the server was asked")


@pytest.mark.timeout(120)
def test_a_node_the_server_would_refuse_stops_before_building_its_model(
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DiLoCo node, one of another model size or one with a wrong token was refused only at its join, after
    allocating its weights (and loading its checkpoint): minutes for a 1B node. Its dry join now ends it first, with
    the server's line and the join's exit code, before `save_overwrite` removes an earlier run's saves."""
    from spes.sync.auth import TOKEN_ENV
    from spes.sync.server import spec_of_run
    from sync_helpers import TOKEN, running_server

    monkeypatch.setattr(spes.node, "parallelize", _never_built)
    run = [*tiny_corpus.overrides(tmp_path / "node"), *SMALL_NODE, "--spes_config.num_peers=1"]
    run += ["--spes_config.num_train_experts_per_node=8", "--max_duration=2st", "--save_interval=null"]

    def refusal(addr: str, *other: str) -> str:
        started = time.monotonic()
        code = main([TINY, *run, f"--spes_config.server_addr={addr}", *other])
        captured = capsys.readouterr()
        last = assert_one_line(code, captured.out + captured.err, "(before building the model)")
        assert code == 3 and "experts:" not in captured.out and time.monotonic() - started < 30, captured.out
        return last

    earlier = tmp_path / "node" / "metrics.jsonl"  # an earlier run's saves: a refused node must not remove them
    earlier.parent.mkdir()
    earlier.write_text('{"step": 1}\n')
    spec = spec_of_run(TINY, run)
    with running_server(spec) as (_, addr):
        assert "peer 0 has mode = 'diloco' but the run has mode = 'spes'" in refusal(addr, "--using_dilico=true")
        assert "peer 0's model differs from the run's" in refusal(addr, "--model.n_layers=3", "--save_overwrite=true")
    assert earlier.read_text() == '{"step": 1}\n'
    monkeypatch.setenv(TOKEN_ENV, "not-the-runs-token")
    with running_server(spec, token=TOKEN) as (_, addr):
        assert "failed (UNAUTHENTICATED)" in refusal(addr)


@pytest.mark.timeout(120)
def test_a_node_started_before_its_server_builds_and_leaves_the_wait_to_its_join(
    tiny_corpus, tmp_path: Path, dead_port: int
) -> None:
    """Nodes may start before the server: the dry join that finds none says so and the node builds on."""
    addr = f"127.0.0.1:{dead_port}"
    cfg, _ = load_config(TINY, [*tiny_corpus.overrides(tmp_path / "node"), f"--spes_config.server_addr={addr}"])
    logged: list[str] = []
    build_node(cfg, CPU, logged.append)
    notes = [line for line in logged if line.startswith("note: dry join of the parameter server")]
    asked = f"at spes_config.server_addr={addr} (before building the model) failed (UNAVAILABLE)"
    assert len(notes) == 1 and asked in notes[0], logged
    assert notes[0].endswith("building the model, then joining (waiting for the server as a join does)")
    assert any(line.startswith("SPES node, peer 0 of 4; experts:") for line in logged)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sync_failures_are_one_line(tiny_corpus, tmp_path: Path, dead_port: int) -> None:
    """No server; a server of another run layout; a round the other peer never joins."""
    node = [
        TINY,
        *tiny_corpus.overrides(tmp_path / "node"),
        *SMALL_NODE,
        "--spes_config.max_retries=0",
        "--spes_config.rpc_timeout_s=5",
        "--max_duration=2st",
        "--save_interval=null",
    ]
    code, out = train(tmp_path, *node, f"--spes_config.server_addr=127.0.0.1:{dead_port}", name="nobody.log")
    assert_one_line(
        code, out, f"spes_config.server_addr=127.0.0.1:{dead_port}", "is the parameter server running there"
    )
    two = [
        "--spes_config.num_peers=2",
        "--spes_config.num_train_experts_per_node=4",
        "--spes_config.sync_steps=1",
        "--spes_config.round_timeout_s=20",
    ]
    # NOTE: the server of a two-peer run, started from the run's YAML and overrides as a user would
    server = [TINY, *SMALL_NODE, *two, "--max_duration=2st", "--server.round_timeout_s=3"]
    with parameter_server(tmp_path / "server.log", *server) as addr:
        code, out = train(tmp_path, *node, f"--spes_config.server_addr={addr}", name="layout.log")
        assert_one_line(code, out, "num_peers")
        code, out = train(tmp_path, *node, *two, f"--spes_config.server_addr={addr}", name="timeout.log")
        assert_one_line(code, out, "round")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_busy_port_is_one_line(tmp_path: Path) -> None:
    with parameter_server(tmp_path / "first.log", "--total_peers", "1", "--num_train_experts_per_node", "8") as addr:
        port = addr.rsplit(":", 1)[1]
        proc = run_logged(
            [
                sys.executable,
                "-m",
                "spes.server",
                "--host",
                "127.0.0.1",
                "--port",
                port,
                "--total_peers",
                "1",
                "--num_train_experts_per_node",
                "8",
            ],
            tmp_path / "second.log",
            timeout=60,
        )
    assert_one_line(proc.returncode, proc.stdout, f"127.0.0.1:{port}", "--port")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_under_torchrun_the_scripts_end_with_the_error_line(tiny_corpus, tmp_path: Path, dead_port: int) -> None:
    """run_single_node.sh with 2 ranks and no server: the culprit's line comes last, no ChildFailedError block."""
    env = child_env(CONFIG=TINY, NPROC_PER_NODE="2", PYTHON=sys.executable)
    cmd = [
        "bash",
        str(REPO / "run_scripts" / "run_single_node.sh"),
        "0",
        *tiny_corpus.overrides(tmp_path / "node"),
        *SMALL_NODE,
        "--distributed_strategy=ddp",
        "--spes_config.max_retries=0",
        "--spes_config.rpc_timeout_s=5",
        f"--spes_config.server_addr=127.0.0.1:{dead_port}",
        "--max_duration=2st",
    ]
    proc = run_logged(cmd, tmp_path / "node.log", timeout=150, env=env)
    assert "ChildFailedError" not in proc.stdout
    assert_one_line(proc.returncode, proc.stdout, "127.0.0.1")
    bad = run_logged([*cmd, "--model.d_model=abc"], tmp_path / "bad.log", timeout=150, env=env)
    assert_one_line(bad.returncode, bad.stdout, "command line (--model.d_model=abc)")


def start_until(cmd: list[str], log: Path, ready: Callable[[], bool]) -> subprocess.Popen:
    """Start `cmd` in its own session, logging to `log`, and wait (120 s at most) until `ready()`."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=child_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.time() + 120
    while not ready():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(log.read_text()[-3000:])
        time.sleep(0.05)
    return proc


def _steps(folder: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_requeued_run_continues_from_its_last_checkpoint(tiny_corpus, tmp_path: Path) -> None:
    """Kill -9 mid-run and launch the same command again (what a SLURM requeue does): it resumes from the last
    checkpoint (`latest` or not), and metrics.jsonl holds every step once, in order."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "spes.train",
        TINY,
        *tiny_corpus.overrides(out),
        "--using_spes=false",
        "--eval_interval=null",
        "--log_interval=1",
        "--save_interval=5",
        "--max_duration=60st",
        "--save_num_checkpoints_to_keep=1",
        "--resume=auto",
    ]
    proc = start_until(cmd, tmp_path / "first.log", lambda: (out / "latest").exists() and len(_steps(out)) >= 7)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = (tmp_path / "first.log").read_text()
    assert "no checkpoint in" in first and "starting fresh" in first
    saved = int((out / "latest").read_text().strip().removeprefix("step"))
    assert 5 <= saved < 60 and max(_steps(out)) > saved  # rows past the checkpoint: they must go
    (out / "latest").unlink()  # as if killed after publishing step<saved>, before pointing `latest` at it
    again = run_logged(cmd, tmp_path / "second.log", timeout=150)
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"loaded {out / f'step{saved}'} (step {saved})" in again.stdout
    assert f"step {saved + 1}/60" in again.stdout and "step 1/60" not in again.stdout
    assert _steps(out) == list(range(1, 61))


ONE_RANK_TORCHRUN = [
    sys.executable,
    "-m",
    "spes.torchrun",
    "--standalone",
    "--nproc_per_node=1",
    "-m",
    "spes.train",
    TINY,
]
"""A node of one rank under spes.torchrun (its config's overrides follow)."""


def _sigterm_once_under_way(cmd: list[str], log: Path, ready: Callable[[], bool]) -> tuple[int, str]:
    """Start `cmd` (its output to `log`), SIGTERM it once `ready()`: its exit code and its output."""
    proc = start_until(cmd, log, ready)
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, log.read_text()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_to_spes_torchrun_saves_and_ends_in_one_line(tiny_corpus, tmp_path: Path) -> None:
    """What SLURM sends at a preemption: the rank saves at its next step, the launcher says so in one line."""
    cmd = [
        *ONE_RANK_TORCHRUN,
        *tiny_corpus.overrides(tmp_path),
        "--using_spes=false",
        "--eval_interval=null",
        "--log_interval=1",
        "--save_interval=null",
        "--max_duration=100000st",
    ]
    code, out = _sigterm_once_under_way(cmd, tmp_path / "run.log", (tmp_path / "metrics.jsonl").exists)
    saved = (tmp_path / "latest").read_text().strip()
    assert assert_one_line(code, out) == (
        f"error: stopped by SIGTERM: saved step {saved.removeprefix('step')}'s checkpoint in {tmp_path} and "
        "stopped; continue with --resume (or --resume=auto)"
    )
    assert code == 128 + signal.SIGTERM and "death signal" not in out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_to_spes_torchrun_before_the_first_step_says_nothing_was_saved(
    tiny_corpus, tmp_path: Path, dead_port: int
) -> None:
    """A node still waiting for its server: its ranks were killed outright and the launcher said each had been asked
    to save a checkpoint."""
    cmd = [
        *ONE_RANK_TORCHRUN,
        *tiny_corpus.overrides(tmp_path),
        *SMALL_NODE,
        f"--spes_config.server_addr=127.0.0.1:{dead_port}",
        "--spes_config.max_retries=8",
    ]
    log = tmp_path / "run.log"
    code, out = _sigterm_once_under_way(cmd, log, lambda: "retry 1/8" in log.read_text())
    assert assert_one_line(code, out) == (
        f"error: stopped by SIGTERM: interrupted without saving; save_folder {tmp_path} holds no checkpoint yet: "
        "start again with --resume=auto (it starts afresh then)"
    )
    assert code == 128 + signal.SIGTERM and "death signal" not in out
