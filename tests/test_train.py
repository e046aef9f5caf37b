"""`python -m spes.train`, the command line itself: `--help`, its flags (`--resume` and the note it leaves), the
config's refusals and exit codes, every failure ending in one line and a non-zero exit (no traceback on screen, yet
none lost: docs/running.md's exit codes and tracebacks), also under torchrun through the project's scripts. What the
node it starts decides (its save folder, checkpoint, data, server, signals, a requeue) is tests/test_node.py's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dist_helpers import SMALL_NODE, child_env, run_logged, without_torch
from node_runs import REPO, TINY, assert_one_line, train
from spes.config import load_config
from spes.node import start_checkpoint
from spes.save_folder import META_FILE
from spes.train import apply_resume, main, parse_args


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
    assert apply_resume(cfg, "always") == [note] and cfg.load_path == str(save)
    assert apply_resume(cfg, "always") == []  # load_path is save_folder already: nothing passed over
    for resume, loaded, said in ((None, start, []), ("auto", save / "step4", [note])):
        cfg, _ = load_config(TINY, [f"--save_folder={save}", f"--load_path={start}"])
        assert apply_resume(cfg, resume) == []
        logged: list[str] = []
        assert start_checkpoint(cfg, logged.append) == loaded and logged == said, (resume, logged)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_config_failures_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The first case through `python -m spes.train`, the others through the `main` it calls, in this process (a
    process each would only import torch again)."""
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model:\n  d_model: 64\n n_heads: [4\n")
    code, out = train(tmp_path, str(tmp_path / "missing.yaml"), name="missing.log")
    assert_one_line(code, out, "config file not found")
    for argv, expected in [
        ([str(bad_yaml)], ("bad.yaml", "line 3", "not valid YAML")),
        ([TINY, "--model.d_mdoel=3"], ("command line", "did you mean 'model.d_model'")),
        ([TINY, "--model.d_model=abc"], ("command line (--model.d_model=abc)", "expected int")),
        ([TINY, "--data.paths=x.npy"], ("command line", "--data.paths=[x.npy]")),
        ([TINY, "--resume=yes"], ("--resume=auto",)),
    ]:
        code = main(argv)
        captured = capsys.readouterr()
        assert_one_line(code, captured.out + captured.err, *expected)  # the error line goes to stderr: it comes last
        assert "parameters" not in captured.out, argv


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
