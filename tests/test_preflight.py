"""Node preflight against a real parameter server on loopback: every check passes for a matching tiny node, each
kind of mistake fails with its own line and exit 1, and the server's state is the same afterwards."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from conftest import usage_error
from data_fixtures import write_token_shard
from dist_helpers import without_torch
from http_fixtures import http_server
from spes.config import load_config
from spes.model import Transformer, count_params
from spes.preflight import (
    Devices,
    _refused_join,
    activation_bytes_per_sequence,
    check_disk,
    check_memory,
    main,
    memory_need,
    model_state_bytes,
    run_position,
)
from spes.shards import ShardInfo, write_shard_info
from spes.sync.client import ServerStatus
from spes.sync.peer import model_manifest, node_spec
from spes.sync.protocol import SyncError
from spes.sync.server import spec_of_run
from spes.tokenizer import LoadedTokenizer
from sync_helpers import TOKEN, make_client, running_server, tiny_spec, write_pki
from terminal_helpers import with_reader_gone

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
RUN = spec_of_run(None, ["--spes_config.num_peers=4", "--spes_config.num_train_experts_per_node=2"])
"""The spec of a server started without the run's YAML: it learns the model from the first node to join."""


def shard_for(path: Path, tokenizer: LoadedTokenizer, vocab_size: int, eos_token_id: int = 0) -> Path:
    """128 sequences of 64 random ids below `vocab_size`, recorded as written with `tokenizer` and its EOS."""
    tokens = np.random.default_rng(0).integers(0, vocab_size, 64 * 128).astype(np.uint16)
    shard = write_token_shard(path, tokens, with_sidecar=False)
    write_shard_info(
        shard,
        ShardInfo(
            tokenizer_fingerprint=tokenizer.fingerprint,
            vocab_size=vocab_size,
            eos_token_id=eos_token_id,
            dtype="uint16",
            num_tokens=len(tokens),
            num_documents=1,
            source_files=("synthetic",),
        ),
    )
    return shard


@pytest.fixture
def node(tmp_path: Path, tokenizer: LoadedTokenizer) -> list[str]:
    """Overrides that make configs/tiny.yaml (peer 0 of 4, 2 experts each) a node with real local data."""
    shard = shard_for(tmp_path / "train.npy", tokenizer, tokenizer.vocab_size)
    return [
        TINY,
        f"--model.vocab_size={tokenizer.vocab_size}",
        f"--model.embedding_size={tokenizer.vocab_size}",
        f"--tokenizer.identifier={tokenizer.path}",
        f"--data.paths=[{shard}]",
        "--max_duration=4st",
        f"--save_folder={tmp_path / 'out'}",
        "--spes_config.rpc_timeout_s=10",
        "--link_mb=2",
        "--step_time_s=10",
    ]  # NOTE: a stated step time, so a loaded CPU cannot make the link check fail


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPES_TOKEN", TOKEN)


@pytest.fixture
def server(token: None) -> Iterator[str]:
    with running_server(RUN, token=TOKEN, data_port=0) as (_, addr):
        yield addr


def status(addr: str) -> ServerStatus:
    with make_client(addr, tiny_spec(num_peers=4), 0, token=TOKEN) as client:
        return client.status()


def preflight(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, str]]:
    """Run `python -m spes.preflight` in-process: (exit status, check name -> its line(s))."""
    rc = main(list(argv))
    lines: dict[str, str] = {}
    last = ""
    for line in capsys.readouterr().out.splitlines():
        parts = line.split()
        if len(parts) > 1 and parts[0] in ("ok", "FAIL", "skip"):
            last = parts[1]
            lines[last] = line
        elif line.strip().startswith("->"):
            lines[last] += "\n" + line
    return rc, lines


def test_every_check_passes_for_a_matching_node_and_the_server_is_unchanged(
    server: str, node: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    before = status(server)
    rc, lines = preflight(capsys, *node, f"--spes_config.server_addr={server}")
    assert rc == 0, lines
    assert set(lines) == {"devices", "memory", "server", "settings", "link", "disk", "data"}
    assert all(line.startswith("ok") for line in lines.values()), lines
    assert "tcp plane" in lines["link"] and "RTT" in lines["link"] and "MiB/s" in lines["link"]
    assert "no peer has joined yet" in lines["settings"]
    assert re.search(r"; run [0-9a-f]{16}: no round completed yet$", lines["settings"]), lines["settings"]
    assert "note" not in lines["data"]  # the shard's sidecar names this tokenizer
    assert status(server) == before


def test_the_grpc_plane_is_measured_when_the_node_uses_it(
    server: str, node: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    before = status(server)
    rc, lines = preflight(capsys, *node, f"--spes_config.server_addr={server}", "--spes_config.data_plane=grpc")
    assert rc == 0, lines
    assert "grpc plane" in lines["link"]
    assert status(server) == before


def test_a_wrong_token_fails_the_server_check(
    server: str, node: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = status(server)
    monkeypatch.setenv("SPES_TOKEN", "not-the-token")
    rc, lines = preflight(capsys, *node, f"--spes_config.server_addr={server}")
    assert rc == 1
    assert lines["server"].startswith("FAIL") and "UNAUTHENTICATED" in lines["server"]
    assert "-> set SPES_TOKEN" in lines["server"]
    assert lines["settings"].startswith("skip") and lines["link"].startswith("skip")
    assert status(server) == before


def test_a_mismatched_expert_count_fails_the_settings_check(
    server: str, node: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    before = status(server)
    rc, lines = preflight(
        capsys, *node, f"--spes_config.server_addr={server}", "--spes_config.num_train_experts_per_node=4"
    )
    assert rc == 1
    assert lines["server"].startswith("ok")
    assert lines["settings"].startswith("FAIL")
    assert "has experts_per_block = 4 but the run has experts_per_block = 2" in lines["settings"]
    assert "spes_config.num_train_experts_per_node" in lines["settings"]
    assert status(server) == before


def test_a_model_other_than_the_runs_fails_once_a_peer_has_joined(
    server: str, node: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, _ = load_config(node[0], [*node[1:6], f"--spes_config.server_addr={server}", "--spes_config.peer_id=1"])
    with torch.device("meta"):
        manifest, _ = model_manifest(Transformer.for_run(cfg))
    with make_client(server, node_spec(cfg, manifest), 1, token=TOKEN) as client:
        client.join()
    before = status(server)
    rc, lines = preflight(capsys, *node, f"--spes_config.server_addr={server}")
    assert rc == 0 and "matches the run's" in lines["settings"]
    rc, lines = preflight(capsys, *node, f"--spes_config.server_addr={server}", "--model.d_model=32")
    assert rc == 1
    assert lines["settings"].startswith("FAIL") and "model differs from the run's" in lines["settings"]
    assert status(server) == before


def test_a_missing_data_path_fails_the_data_check(
    server: str, node: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = status(server)
    missing = tmp_path / "nowhere" / "shard.npy"
    rc, lines = preflight(capsys, *node, f"--spes_config.server_addr={server}", f"--data.paths=[{missing}]")
    assert rc == 1
    assert lines["data"].startswith("FAIL") and f"data path '{missing}' does not exist" in lines["data"]
    assert [n for n, line in lines.items() if line.startswith("FAIL")] == ["data"]
    assert status(server) == before


def test_too_few_tokens_or_another_vocabulary_fail_the_data_check(
    server: str, node: list[str], tokenizer: LoadedTokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, lines = preflight(capsys, *node, f"--spes_config.server_addr={server}", "--max_duration=100st")
    assert rc == 1 and lines["data"].startswith("FAIL")
    assert "128 sequences" in lines["data"] and "the run reads 1,600" in lines["data"]
    assert "shorten max_duration" in lines["data"]
    other = shard_for(tmp_path / "other.npy", tokenizer, 1000)
    rc, lines = preflight(capsys, *node, f"--spes_config.server_addr={server}", f"--data.paths=[{other}]")
    assert rc == 1 and lines["data"].startswith("FAIL")
    assert "written for a vocabulary of 1000" in lines["data"] and "re-tokenize" in lines["data"]
    other = shard_for(tmp_path / "other_eos.npy", tokenizer, tokenizer.vocab_size, eos_token_id=1)
    rc, lines = preflight(capsys, *node, f"--spes_config.server_addr={server}", f"--data.paths=[{other}]")
    assert rc == 1 and lines["data"].startswith("FAIL")
    assert f"{other} ends its documents with token 1 but model.eos_token_id is 0" in lines["data"]


def test_a_bare_olmo_shard_is_checked_by_its_largest_id(
    server: str, node: list[str], tokenizer: LoadedTokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = np.random.default_rng(0).integers(0, tokenizer.vocab_size, 64 * 128).astype(np.uint16)
    bare = write_token_shard(tmp_path / "bare.npy", tokens, with_sidecar=False)
    rc, lines = preflight(capsys, *node, f"--spes_config.server_addr={server}", f"--data.paths=[{bare}]")
    assert "uint16, 8,192 tokens = 128 sequences" in lines["data"]
    assert lines["data"].endswith(
        "; note: no shard has a sidecar, so the tokenizer they were written with cannot be checked"
    )
    other = write_token_shard(tmp_path / "other.npy", tokens, vocab_size=tokenizer.vocab_size)  # another fingerprint
    rc, lines = preflight(capsys, *node, f"--spes_config.server_addr={server}", f"--data.paths=[{other}]")
    assert lines["data"].endswith("; note: written with another tokenizer file of the same vocabulary size")
    tokens[-1] = tokenizer.vocab_size
    beyond = write_token_shard(tmp_path / "beyond.npy", tokens, with_sidecar=False)
    rc, lines = preflight(capsys, *node, f"--spes_config.server_addr={server}", f"--data.paths=[{beyond}]")
    assert rc == 1 and lines["data"].startswith("FAIL")
    assert f"no sidecar (largest id seen {tokenizer.vocab_size})" in lines["data"]


def test_a_shard_at_a_url_is_checked_by_range_reads_as_training_reads_it(
    server: str,
    node: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`data.url_reads: range` (the default): the check reads the shard's header, sidecar and first tokens from the
    server; a download would have filled SPES_DATA_CACHE."""
    monkeypatch.setenv("SPES_DATA_CACHE", str(tmp_path / "cache"))
    with http_server() as served:
        served.files["/train.npy"] = (tmp_path / "train.npy").read_bytes()
        served.files["/train.npy.json"] = (tmp_path / "train.npy.json").read_bytes()
        url = f"{served.url}/train.npy"
        rc, lines = preflight(capsys, *node, f"--spes_config.server_addr={server}", f"--data.paths=[{url}]")
        assert lines["data"].startswith("ok") and "8,192 tokens = 128 sequences" in lines["data"], lines["data"]
        assert not (tmp_path / "cache").exists() and all(r for _, p, r in served.asked if p == "/train.npy")
        reads = re.fullmatch(
            r"ok +reads +a window reads from its URL in ([\d.]+) ms \(median of 1\); a step's 16 windows per rank take "
            r"~([\d.e-]+) s over 1 loader process\(es\); step ~10 s \(measured \(--step_time_s\)\)",
            lines["reads"],
        )
        assert reads is not None and rc == 0, lines["reads"]
        # NOTE: a window's time is printed to 0.1 ms and the step's to 3 significant digits (up to 0.5% off)
        slack = 16 * 0.05e-3 + 5e-3 * float(reads[2])
        assert float(reads[2]) == pytest.approx(16 * float(reads[1]) / 1e3, abs=slack)
        asked = [r for _, p, r in served.asked if p == "/train.npy"]
        assert asked[-1] == f"bytes={128 + 64 * 64 * 2}-{128 + 65 * 64 * 2 - 1}"  # window 64 of 128, in the middle
        rc, lines = preflight(
            capsys,
            *node,
            f"--spes_config.server_addr={server}",
            f"--data.paths=[{url}]",
            "--data.num_workers=2",
            "--step_time_s=1e-9",
        )
        assert rc == 1 and lines["reads"].startswith("FAIL") and "over 2 loader process(es)" in lines["reads"]
        assert re.search(r"set data.num_workers=\d+ \(loader processes read in parallel\)", lines["reads"])
        rc, lines = preflight(
            capsys, *node, f"--spes_config.server_addr={server}", f"--data.paths=[{url}]", "--data.url_reads=download"
        )
        assert lines["data"].startswith("ok") and (tmp_path / "cache").is_dir() and "reads" not in lines


def test_a_headerless_uint32_file_of_the_first_implementation_is_read_as_training_reads_it(
    server: str, node: list[str], tokenizer: LoadedTokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its tokenize_data.py writes flat uint32 memmaps named .npy (no numpy header): np.load calls them pickles."""
    headerless = tmp_path / "tokenized_0_0.npy"
    np.random.default_rng(1).integers(0, tokenizer.vocab_size, 64 * 128).astype(np.uint32).tofile(headerless)
    rc, lines = preflight(
        capsys,
        *node,
        f"--spes_config.server_addr={server}",
        f"--data.paths=[{headerless}]",
        "--data.memmap_dtype=uint32",
    )
    assert lines["data"].startswith("ok") and "uint32, 8,192 tokens = 128 sequences" in lines["data"], lines["data"]


def test_a_config_that_cannot_fit_the_memory_budget_fails_the_memory_check(
    server: str, node: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    before = status(server)
    cfg, _ = load_config(node[0], node[1:7])
    static, per_seq = memory_need(cfg, 1)
    budget_gb = (static + 2.5 * per_seq) / 0.9 / 2**30  # room for 2 sequences, the config asks for 8
    rc, lines = preflight(capsys, *node, f"--spes_config.server_addr={server}", f"--memory_budget_gb={budget_gb}")
    assert rc == 1
    assert lines["memory"].startswith("FAIL") and "largest micro-batch that fits: 2" in lines["memory"]
    assert "device_train_microbatch_size=2 (the largest that fits and divides the 16" in lines["memory"]
    assert [n for n, line in lines.items() if line.startswith("FAIL")] == ["memory"]
    assert status(server) == before


def test_a_slow_link_at_these_sync_steps_fails_the_link_check(
    server: str, node: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, lines = preflight(
        capsys,
        *node,
        f"--spes_config.server_addr={server}",
        "--step_time_s=1e-7",
        "--spes_config.sync_steps=1",
        "--max_sync_fraction=0.01",
    )
    assert rc == 1
    assert lines["link"].startswith("FAIL") and "-> raise spes_config.sync_steps to" in lines["link"]
    # the advice meets the stated --max_sync_fraction, not only the default 10%: followed, the check passes
    assert "(link time <= 1%)" in lines["link"], lines["link"]
    round_s = float(re.search(r"~([0-9.e+-]+) s; step", lines["link"]).group(1))
    advised = int(re.search(r"sync_steps to (\d+)", lines["link"]).group(1))
    assert round_s / (advised * 1e-7 + round_s) <= 0.01 * 1.01, lines["link"]


def test_an_unreachable_server_fails_in_seconds(
    token: None, node: list[str], capsys: pytest.CaptureFixture[str], dead_port: int
) -> None:
    rc, lines = preflight(capsys, *node, f"--spes_config.server_addr=127.0.0.1:{dead_port}")
    assert rc == 1
    assert lines["server"].startswith("FAIL") and "UNAVAILABLE" in lines["server"]
    assert "-> start the server" in lines["server"]


def test_a_certificate_for_another_peer_fails_the_server_check(
    token: None, node: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pki = write_pki(tmp_path)
    other = pki.issue("peer-1")
    with running_server(RUN, token=TOKEN, tls_client_ca=pki.ca, tls_peer_ids=True, **pki.server) as (_, addr):
        tls = [f"--spes_config.server_addr={addr}", f"--spes_config.tls_ca={pki.ca}"]
        rc, lines = preflight(
            capsys,
            *node,
            *tls,
            f"--spes_config.tls_cert={other['tls_cert']}",
            f"--spes_config.tls_key={other['tls_key']}",
        )
        assert rc == 1
        assert lines["server"].startswith("FAIL") and "PERMISSION_DENIED" in lines["server"]
        assert "common name peer-<peer_id>" in lines["server"]
        # no client certificate: gRPC says only `Socket closed`; the probe's handshake says why, and the setting
        rc, lines = preflight(capsys, *node, *tls)
        assert rc == 1 and "UNAVAILABLE" in lines["server"]
        assert (
            "the server requires a client certificate (mutual TLS): give this node spes_config.tls_cert/tls_key "
            "signed by the server's --tls_client_ca (" in lines["server"]
        )
        own = pki.issue("peer-0")
        rc, lines = preflight(
            capsys, *node, *tls, f"--spes_config.tls_cert={own['tls_cert']}", f"--spes_config.tls_key={own['tls_key']}"
        )
        assert rc == 0, lines


def test_a_bad_override_is_a_config_error(node: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*node, "--spes_config.num_peerz=3"]) == 2
    assert "did you mean 'spes_config.num_peers'" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_help_and_a_refused_config_are_answered_without_torch(tmp_path: Path) -> None:
    """Importing torch (and the model, the sync wing) took most of the two seconds `--help` or a mistyped key took:
    the checks import it, once the config holds; the lines and exit codes are as before."""
    code, out, err = without_torch(tmp_path, "spes.preflight", "--help")
    assert code == 0 and out.startswith("usage: python -m spes.preflight") and "--memory_budget_gb" in out and not err
    (tmp_path / "typo.yaml").write_text("model:\n  d_modle: 64\n")
    refused = {
        ("typo.yaml",): "error: typo.yaml: unknown config key 'model.d_modle'; did you mean 'model.d_model'?",
        (TINY, "--spes_config.num_peerz=3"): "error: command line (--spes_config.num_peerz=3): unknown config key "
        "'spes_config.num_peerz'; did you mean 'spes_config.num_peers'?",
        ("gone.yaml",): "error: config file not found: gone.yaml (pass a YAML file, e.g. configs/tiny.yaml)",
        (TINY, "--nproc=0"): "python -m spes.preflight: error: argument --nproc: 0 must be an integer >= 1",
        (TINY, "--link_mbb", "16"): "python -m spes.preflight: error: unrecognized arguments: --link_mbb; did you "
        "mean --link_mb?",  # was: "unexpected arguments ['16']"
    }
    for argv, line in refused.items():
        code, out, err = without_torch(tmp_path, "spes.preflight", *argv)
        assert (code, out, err[-1]) == (2, "", line), argv


def test_a_save_folder_the_node_would_refuse_to_start_in_fails_the_disk_check(tmp_path: Path) -> None:
    """Preflight passed a node whose save folder held an earlier run's saves (a quickstart, a centralized try), and
    the node then stopped at start: continue that run with --resume, or save_overwrite=true."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    cfg, _ = load_config(TINY, [f"--save_folder={out}"])
    disk = check_disk(cfg)
    assert disk.failed and f"save_folder {out} already holds a run's saves (metrics.jsonl)" in disk.fix, disk
    assert disk.fix.startswith("the node would refuse to start: ")
    for taken in ("--try_load_latest_save=true", "--save_overwrite=true"):  # --resume=auto; a start over them
        assert not check_disk(load_config(TINY, [f"--save_folder={out}", taken])[0]).failed, taken
    assert (out / "metrics.jsonl").exists()  # save_overwrite is checked, never carried out
    empty, _ = load_config(TINY, [f"--save_folder={tmp_path / 'empty'}", f"--load_path={tmp_path / 'empty'}"])
    assert "nothing to resume" in check_disk(empty).fix  # --resume of a folder without a checkpoint
    upcycled, _ = load_config(TINY, [f"--save_folder={tmp_path / 'new'}", f"--load_path={tmp_path / 'init'}"])
    assert not check_disk(upcycled).failed  # its load_path is made before the node starts, which names it if not


def test_resume_is_taken_as_the_node_takes_it(node: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """`run_single_node.sh N --preflight --resume=auto` checked a requeued node as a fresh one: the script dropped
    --resume (preflight took it for a config key), so the dry join was refused as a fresh node's in a run with
    completed rounds, naming --resume=auto, the flag the user had given."""
    centralized = [*node, "--using_spes=false"]
    rc, lines = preflight(capsys, *centralized, "--resume")
    assert rc == 1 and "nothing to resume" in lines["disk"] and "--resume=auto" in lines["disk"], lines
    assert preflight(capsys, *centralized, "--resume=auto")[0] == 0
    assert main([*centralized, "--resume=always"]) == 2
    assert "'--resume=always' is not an option; use --resume or --resume=auto" in capsys.readouterr().err


def test_model_state_bytes_count_what_the_node_builds(node: list[str]) -> None:
    cfg, _ = load_config(node[0], node[1:3])
    with torch.device("meta"):
        counts = count_params(Transformer.for_run(cfg))
    state = model_state_bytes(cfg)
    assert (state.params, state.trained) == (counts.total, counts.trainable)
    assert state.total == 4 * counts.total + 12 * counts.trainable
    # FSDP2 shards the state over the node's processes; activation checkpointing keeps less
    fsdp, _ = load_config(node[0], [*node[1:3], "--distributed_strategy=fsdp"])
    assert memory_need(fsdp, 4)[0] == -(-state.total // 4)
    ckpt, _ = load_config(node[0], [*node[1:3], "--activation_checkpointing=whole_layer"])
    assert activation_bytes_per_sequence(ckpt) < activation_bytes_per_sequence(cfg)


def test_without_a_stated_step_time_it_is_estimated_from_flops_and_a_matmul_test(node: list[str]) -> None:
    from spes.preflight import estimated_step_s, find_devices

    cfg, _ = load_config(node[0], node[1:3])
    seconds, how = estimated_step_s(cfg, find_devices(1))
    assert 0 < seconds < 60 and how.startswith("estimated from") and "TFLOP/s measured matmul rate" in how


def test_more_processes_than_the_strategy_can_use_fail_the_devices_check(
    server: str, node: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, lines = preflight(capsys, *node, f"--spes_config.server_addr={server}", "--nproc=2")
    assert rc == 1
    assert lines["devices"].startswith("FAIL") and "the launch uses 2 process(es)" in lines["devices"]
    assert "'distributed_strategy' = 'single' cannot run on 2 processes" in lines["devices"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_devices_answers_the_launch_scripts_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NPROC_PER_NODE", raising=False)
    assert main(["--devices"]) == 0
    assert capsys.readouterr().out.startswith("1 the CPU (no CUDA GPU)")
    monkeypatch.setenv("NPROC_PER_NODE", "3")
    assert main(["--devices"]) == 0
    assert capsys.readouterr().out.startswith("3 the CPU")


# -- the launch scripts -------------------------------------------------------------------------------------------
def stand_in_python(tmp_path: Path, devices: str) -> Path:
    """An interpreter that answers the device count like spes.preflight on a machine with `devices` GPUs and
    prints any other command instead of running it."""
    script = tmp_path / "python"
    script.write_text(f"""#!/usr/bin/env bash
if [ "$1 $2 $3" = "-m spes.preflight --devices" ]; then
  {devices}
fi
echo "RUN $*"
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def launch(tmp_path: Path, python: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "NPROC_PER_NODE"}
    return subprocess.run(
        ["bash", "run_scripts/run_single_node.sh", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**environ, "CONFIG": TINY, "PYTHON": str(python), **env},
        timeout=60,
    )


def test_run_single_node_launches_on_every_device_its_interpreter_counts(tmp_path: Path) -> None:
    python = stand_in_python(tmp_path, 'echo "8 8 CUDA GPU(s) (stand-in)"; exit 0')
    proc = launch(tmp_path, python, "3", "--max_duration=2st", DATA_SEED="9198")
    assert proc.returncode == 0, proc.stderr
    assert "node 3: 8 process(es) on 8 CUDA GPU(s) (stand-in)" in proc.stdout
    assert "RUN -m spes.torchrun --standalone --nproc_per_node=8 -m spes.train" in proc.stdout
    assert "--spes_config.peer_id=3 --data.seed=9198 --max_duration=2st" in proc.stdout


def test_run_single_node_preflight_runs_the_checks_instead_of_training(tmp_path: Path) -> None:
    python = stand_in_python(tmp_path, 'echo "4 4 CUDA GPU(s) (stand-in)"; exit 0')
    proc = launch(tmp_path, python, "1", "--preflight", "--max_duration=2st", DATA_SEED="7198")
    assert proc.returncode == 0, proc.stderr
    assert f"RUN -m spes.preflight {TINY} --nproc 4 --spes_config.peer_id=1 --data.seed=7198 --max_duration=2st" in (
        proc.stdout
    )
    assert "torch.distributed.run" not in proc.stdout
    resumed = launch(tmp_path, python, "1", "--resume=auto", "--preflight", DATA_SEED="7198")  # a requeued node's
    assert f"RUN -m spes.preflight {TINY} --nproc 4 --spes_config.peer_id=1 --data.seed=7198 --resume=auto" in (
        resumed.stdout
    )


def test_run_single_node_refuses_to_guess_when_its_interpreter_cannot_count(tmp_path: Path) -> None:
    python = stand_in_python(tmp_path, 'echo "ModuleNotFoundError: No module named torch" >&2; exit 1')
    proc = launch(tmp_path, python, "0")
    assert proc.returncode == 2
    assert "could not count this machine's devices" in proc.stderr and "NPROC_PER_NODE" in proc.stderr
    assert "RUN" not in proc.stdout


def test_run_single_node_names_an_nproc_per_node_that_is_no_count(tmp_path: Path) -> None:
    """It said its interpreter could not count the devices and advised setting NPROC_PER_NODE, the culprit."""
    python = stand_in_python(tmp_path, 'echo "2 2 CUDA GPU(s) (stand-in)"; exit 0')
    for bad in ("abc", "0", "-1"):
        proc = launch(tmp_path, python, "0", NPROC_PER_NODE=bad)
        assert proc.returncode == 2 and "RUN" not in proc.stdout
        assert proc.stderr.splitlines() == [
            f"error: NPROC_PER_NODE='{bad}' must be a positive integer (processes on this node), or unset (every GPU, "
            "else 1)"
        ]
    assert "RUN -m spes.torchrun --standalone --nproc_per_node=2 " in launch(tmp_path, python, "0").stdout


def test_run_single_node_tells_a_nodes_own_file_by_its_peer_id_not_its_path(tmp_path: Path) -> None:
    """CONFIG=./configs/spes_1b/node_1.yaml (or its absolute path, or a copy) gave node 1 the file's data.seed +
    1000, node 2's order: the script took every CONFIG but the literal default path for one file for every node."""
    real = f'exec {shlex.quote(sys.executable)} "$@"'  # the seed is read by the project's interpreter
    python = stand_in_python(tmp_path, f'echo "1 the CPU (stand-in)"; exit 0\nfi\nif [ "$1" = -c ]; then\n  {real}')
    own = REPO / "configs" / "spes_1b" / "node_1.yaml"
    (tmp_path / "mine").mkdir()
    copy = tmp_path / "mine" / "node_1.yaml"
    copy.write_text(own.read_text())
    for config in ("./configs/spes_1b/node_1.yaml", str(own), str(copy)):
        proc = launch(tmp_path, python, "1", CONFIG=config)
        assert proc.returncode == 0, proc.stderr
        assert "--spes_config.peer_id=1 --data.seed=7198" in proc.stdout, config  # the file's own
    for config, node, seed in (("configs/spes_1b/node_0.yaml", "1", 7198), (TINY, "2", 8198)):  # one for every node
        proc = launch(tmp_path, python, node, CONFIG=config)
        assert proc.returncode == 0, proc.stderr
        assert f"--spes_config.peer_id={node} --data.seed={seed}" in proc.stdout, config


@pytest.mark.slow
def test_run_single_node_preflight_for_real(server: str, node: list[str]) -> None:
    """The script's --preflight end to end with the project's interpreter (no stand-in)."""
    proc = subprocess.run(
        [
            "bash",
            "run_scripts/run_single_node.sh",
            "0",
            "--preflight",
            *node[1:],
            f"--spes_config.server_addr={server}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "CONFIG": TINY, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "node 0: 1 process(es) on the CPU" in proc.stdout
    assert "preflight passed" in proc.stdout


def test_run_cluster_nodes_launch_on_every_device_their_interpreter_counts(tmp_path: Path) -> None:
    python = stand_in_python(tmp_path, 'echo "${NPROC_PER_NODE:-8} 8 CUDA GPU(s) (stand-in)"; exit 0')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "NPROC_PER_NODE"}
    env.update(
        SLURM_JOB_ID="1",
        SPES_CLUSTER_ROLE="node",
        SLURM_PROCID="1",
        SERVER_ADDR="10.0.0.1:50051",
        CONFIG=TINY,
        PYTHON=str(python),
    )
    script = ["bash", "run_scripts/run_cluster.sh"]
    proc = subprocess.run(script, cwd=REPO, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "node 1 on" in proc.stdout and "8 process(es) on 8 CUDA GPU(s) (stand-in)" in proc.stdout
    assert "RUN -m spes.torchrun --standalone --nproc_per_node=8 -m spes.train" in proc.stdout
    proc = subprocess.run(
        script, cwd=REPO, capture_output=True, text=True, env={**env, "SLURM_GPUS_ON_NODE": "2"}, timeout=60
    )
    assert "--nproc_per_node=2 " in proc.stdout  # what SLURM allotted wins over the count


# -- the link test's server side ----------------------------------------------------------------------------------
def test_the_link_test_is_authenticated_bounded_and_counted_nowhere(token: None) -> None:
    import grpc

    from spes.sync import plane_tcp as transport
    from spes.sync.proto import spes_pb2 as pb
    from spes.sync.proto import spes_pb2_grpc as pb_grpc

    with running_server(RUN, token=TOKEN, data_port=0) as (srv, addr):
        before = status(addr)
        for plane in ("grpc", "tcp"):
            with make_client(addr, tiny_spec(num_peers=4), 0, token=TOKEN, data_plane=plane) as client:
                client.connection.use_data_plane(pb.JoinReply(data_port=srv.data_port))
                assert client.connection.measure_link(3 << 20).plane == plane
        with grpc.insecure_channel(addr) as channel:
            probe = pb_grpc.ParameterServerStub(channel).Probe
            for bearer, size, code in (
                ("wrong", 1, grpc.StatusCode.UNAUTHENTICATED),
                (TOKEN, transport.PROBE_MAX_BYTES + 1, grpc.StatusCode.INVALID_ARGUMENT),
            ):
                with pytest.raises(grpc.RpcError) as refused:
                    list(
                        probe(
                            iter([pb.ProbeMessage(reply_bytes=size)]),
                            timeout=10,
                            metadata=(("authorization", f"Bearer {bearer}"),),
                        )
                    )
                assert refused.value.code() == code
        for secret, size, name in (
            ("wrong", 1, "UNAUTHENTICATED"),
            (TOKEN, transport.PROBE_MAX_BYTES + 1, "INVALID_ARGUMENT"),
        ):
            with transport.connect("127.0.0.1", srv.data_port, None, 10) as sock:
                transport.send_hello(sock, pb.DataHello(op=pb.DATA_OP_PROBE, token=secret, up_bytes=size))
                assert transport.recv_reply(sock).error.code == name
        assert status(addr) == before


def test_another_protocol_version_fails_the_server_check(
    server: str, node: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import spes.sync.client

    monkeypatch.setattr(spes.sync.client, "PROTOCOL_VERSION", 2)  # a node running an older spes
    rc, lines = preflight(capsys, *node, f"--spes_config.server_addr={server}")
    assert rc == 1
    assert lines["server"].startswith("FAIL") and "speaks wire protocol v2" in lines["server"]
    assert "-> run the same spes version" in lines["server"] and lines["settings"].startswith("skip")


def test_a_server_older_than_preflight_is_named(
    token: None, node: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from spes.sync.plane_grpc import SpesServicer

    join = SpesServicer.Join

    def old_join(self: SpesServicer, request: object, context: object) -> object:
        request.dry_run = False  # type: ignore[attr-defined]  # NOTE: a server that knows no dry_run field
        return join(self, request, context)  # type: ignore[arg-type]

    monkeypatch.setattr(SpesServicer, "Join", old_join)
    with running_server(RUN, token=TOKEN) as (_, addr):
        rc, lines = preflight(capsys, *node, f"--spes_config.server_addr={addr}")
    assert rc == 1
    assert lines["server"].startswith("FAIL") and "predates preflight" in lines["server"]
    assert "-> update the parameter server" in lines["server"]


@pytest.mark.parametrize(("micro", "measured_gib"), [(2, 28.1), (4, 44.3), (8, 76.7)])
def test_the_memory_estimate_covers_the_measured_gpu_peak_of_the_1b_node(micro: int, measured_gib: float) -> None:
    """Peak GPU memory of one step of the 1B SPES node, measured on an H200 (amp_bf16, one process;
    bench/results/bench_wan_gpu_steps.json): the estimate must not promise a micro-batch that does not fit,
    nor waste a GPU by asking for far more than it used."""
    cfg, _ = load_config(REPO / "configs" / "spes_1b" / "node_0.yaml", [f"--device_train_microbatch_size={micro}"])
    static, per_seq = memory_need(cfg, 1)
    estimate_gib = (static + micro * per_seq) / 2**30
    assert measured_gib <= estimate_gib <= 1.1 * measured_gib


def test_with_fused_loss_the_estimate_counts_one_chunk_of_logits_instead_of_the_batch() -> None:
    node = REPO / "configs" / "spes_1b" / "node_0.yaml"
    whole, _ = load_config(node, [])
    fused, _ = load_config(node, ["--fused_loss=true"])
    (static_w, seq_w), (static_f, seq_f) = memory_need(whole, 1), memory_need(fused, 1)
    assert static_f > static_w and seq_f < seq_w / 10
    assert static_f + 8 * seq_f < (static_w + 8 * seq_w) / 3


def test_a_node_whose_logits_do_not_fit_is_told_to_fuse_its_loss() -> None:
    """The 1B node on a 48 GB GPU: micro-batch 8 needs ~80 GiB, most of it the LM head's logits."""
    cfg, _ = load_config(REPO / "configs" / "spes_1b" / "node_0.yaml", [])
    gpu = Devices(nproc=1, kind="cuda", memory_bytes=48 * 10**9, describe="1 x a 48 GB GPU")
    check = check_memory(cfg, gpu, None)
    assert check.status == "FAIL" and check.fix is not None
    assert check.fix.startswith("set fused_loss=true (the LM head and loss a chunk at a time: ~")
    assert "or set device_train_microbatch_size=" in check.fix
    fused, _ = load_config(REPO / "configs" / "spes_1b" / "node_0.yaml", ["--fused_loss=true"])
    assert check_memory(fused, gpu, None).status == "ok"


@pytest.mark.parametrize(
    ("flag", "rule"),
    [
        ("--link_mb=0", "argument --link_mb: 0 must be a finite number in (0, 256]"),
        ("--link_mb=inf", "argument --link_mb: inf must be a finite number in (0, 256]"),
        ("--memory_budget_gb=nan", "argument --memory_budget_gb: nan must be a finite number > 0"),
        ("--memory_budget_gb=0", "argument --memory_budget_gb: 0 must be a finite number > 0"),
        ("--step_time_s=-1", "argument --step_time_s: -1 must be a finite number > 0"),
        ("--max_sync_fraction=1.5", "argument --max_sync_fraction: 1.5 must be a finite number in (0, 1]"),
        ("--nproc=0", "argument --nproc: 0 must be an integer >= 1"),
        ("--link_mb=lots", "argument --link_mb: 'lots' is not a number"),
    ],
)
def test_a_number_flag_out_of_its_range_is_refused_naming_it(
    capsys: pytest.CaptureFixture[str], flag: str, rule: str
) -> None:
    assert usage_error(capsys, lambda: main([TINY, flag])) == f"python -m spes.preflight: error: {rule}"


def test_the_sample_output_in_running_md_is_what_this_version_prints() -> None:
    """docs/running.md's sample preflight of configs/tiny.yaml: its protocol version, manifest size and the launch
    script's first line are this version's (they had gone stale: v5, 41 tensors, a 'data seed' the script no longer
    prints)."""
    from spes.preflight import manifest
    from spes.sync.protocol import PROTOCOL_VERSION

    doc = (REPO / "docs" / "running.md").read_text()
    sample = doc.split("Sample output (`configs/tiny.yaml`", 1)[1].split("```", 2)[1]
    shapes, _ = manifest(load_config(TINY)[0])
    assert f"protocol v{PROTOCOL_VERSION}," in sample
    assert f"manifest of {len(shapes)} tensors" in sample
    script = (REPO / "run_scripts" / "run_single_node.sh").read_text()
    echo = re.search(r'echo "(node \$NODE_ID: .*)"', script).group(1)
    assert echo.endswith(", config $CONFIG$ELSEWHERE")  # ELSEWHERE: empty when started in the repository, as there
    first = sample.strip().splitlines()[0]
    assert re.fullmatch(r"node 0: 1 process\(es\) on .+, config configs/tiny\.yaml", first), first


def test_the_settings_line_says_where_the_run_stands() -> None:
    status = ServerStatus(12, -1, 2, (0, 1), (), 0, 0, "spes", run_id="0123456789abcdef")
    assert run_position(status) == (
        "run 0123456789abcdef: round 12 complete (a node starting before that step loads its global model as soon as "
        "it joins)"
    )
    assert run_position(dataclasses.replace(status, current_round=-1, run_id="")) == "the run: no round completed yet"


def test_a_refused_tls_handshake_fails_the_server_check_with_what_it_means() -> None:
    cfg = load_config(REPO / "configs" / "tiny.yaml")[0]
    refused = SyncError(
        "join failed (UNAVAILABLE): the server's TLS certificate has expired", grpc.StatusCode.UNAVAILABLE
    )
    server, settings = _refused_join(cfg, refused)
    assert (server.status, server.fix) == ("FAIL", "fix what the line names (docs/running.md, Security)")
    assert server.detail.endswith("certificate has expired") and settings.status == "skip"
    down = SyncError("join failed (UNAVAILABLE): Connection refused", grpc.StatusCode.UNAVAILABLE, retryable=True)
    assert _refused_join(cfg, down)[0].fix.startswith("start the server, or check spes_config.server_addr")


def test_a_node_of_another_run_is_not_told_to_match_its_config() -> None:
    """A requeued node asked about as a fresh one was told to make its config match the run's: its config did,
    its run did not (resume it, join with the run's id, or give the server a fresh --state_dir)."""
    from spes.sync.protocol import Reason

    cfg = load_config(REPO / "configs" / "tiny.yaml")[0]
    line = "preflight join failed (FAILED_PRECONDITION): peer 2 starts a fresh run, but this server holds run 0123"
    other = SyncError(line, grpc.StatusCode.FAILED_PRECONDITION, reason=Reason.OTHER_RUN)
    server, settings = _refused_join(cfg, other)
    assert server.status == "ok" and (settings.status, settings.detail) == ("FAIL", line)
    assert settings.fix == (
        "the node and the server hold different runs: resume, join or restart as the line says (docs/running.md, "
        "Run identity)"
    )
    mismatch = SyncError("peer 2 has 3 experts per block", grpc.StatusCode.FAILED_PRECONDITION)
    assert _refused_join(cfg, mismatch)[1].fix.startswith("make this node's config match the run's")


@pytest.mark.timeout(120)
def test_a_node_resuming_a_checkpoint_is_asked_about_as_the_run_its_checkpoint_names(
    server: str, node: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Preflight's dry join named no run: a node about to resume a run with completed rounds was refused as a fresh
    node, and one resuming another run's checkpoint passed; one whose run record is damaged, which the node refuses
    to start on, was asked about as a fresh node and passed."""
    from spes.sync.node_files import RUN_FILE, write_run_id
    from spes.train import main as train

    config = [*node[:7], "--max_duration=1st"]
    assert train([*config, "--using_spes=false", "--save_interval=1", "--eval_interval=null"]) == 0
    checkpoint = tmp_path / "out" / "step1"
    write_run_id(checkpoint / RUN_FILE, "0123456789abcdef")
    capsys.readouterr()
    rc, lines = preflight(capsys, *node, f"--spes_config.server_addr={server}", f"--load_path={checkpoint}")
    assert rc == 1 and lines["settings"].startswith("FAIL"), lines
    assert "belongs to run 0123456789abcdef (its checkpoint or spes_config.run_id)" in lines["settings"]
    rc, lines = preflight(capsys, *node, f"--spes_config.server_addr={server}", f"--load_path={tmp_path / 'none'}")
    assert lines["settings"].startswith("ok"), lines  # a checkpoint not made yet (an upcycled start): a fresh node
    assert rc == 1 and "already holds a run's saves (step1" in lines["disk"]  # where the first train saved
    (checkpoint / RUN_FILE).write_text('{"run_id": "0123')
    joining = [f"--spes_config.server_addr={server}", f"--load_path={checkpoint}"]
    rc, lines = preflight(capsys, *node, *joining)
    damaged = f"{checkpoint / RUN_FILE}: not a run record"
    assert rc == 1 and lines["settings"].startswith("FAIL") and damaged in lines["settings"], lines
    assert "python -m spes.status names the run" in lines["settings"] and "refuses to start" in lines["settings"]
    assert train([*config, "--eval_interval=null", *joining]) == 2
    assert damaged in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_reader_that_stops_early_costs_preflight_neither_its_verdict_nor_a_traceback(
    tiny_corpus, tmp_path: Path
) -> None:
    """`preflight ... | head -n 2`: each line after the reader had gone ended it in a BrokenPipeError traceback
    (exit 1, whatever the checks found)."""
    argv = ["-m", "spes.preflight", TINY, *tiny_corpus.overrides(tmp_path), "--using_spes=false"]
    proc = with_reader_gone(argv, 50)
    assert (proc.returncode, proc.stderr) == (0, "")


def test_ctrl_c_during_a_check_is_one_line_and_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C during the link test (seconds against a far server) ended preflight in a KeyboardInterrupt traceback."""

    def interrupted(*_args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("spes.preflight.run_checks", interrupted)
    assert main([TINY, "--using_spes=false"]) == 130
    assert capsys.readouterr().err == "preflight interrupted: nothing was changed; run it again to check\n"
