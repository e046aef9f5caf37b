"""Smoke tests of the benchmarks: every `bench/*.py --quick` runs and writes sane JSON; the pure helpers are right.

Performance itself is never asserted here (the CPU is shared): the benchmarks report ratios measured side by
side, and docs/benchmarks.md holds the full runs. Only exact facts are checked (byte counts, parameter counts).
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench_helpers import BENCH, REPO, corpus_flags, run_bench
from conftest import Corpus


def test_format_table_aligns_columns() -> None:
    from common import format_table

    lines = format_table(["a", "bbb"], [[1, 2.5], ["xyz", 12345.0]]).splitlines()
    assert len({len(line) for line in lines}) == 1
    assert lines[3].endswith("12,345")


def test_code_stats_spans_count_every_def_with_its_nesting() -> None:
    from code_stats import count_lines, measure

    text = (
        "# a comment\n"
        "class A:\n"
        "    def f(self):\n"
        "        def inner():\n"
        "            pass\n"
        "\n"
        "        return inner\n"
        "\n"
        "\n"
        "async def g():\n"
        "    pass\n"
    )
    assert count_lines(text) == {"lines": 11, "code": 7}
    stats = measure({"spes/x.py": text}, top=3)
    assert [(s["name"], s["line"], s["lines"]) for s in stats["largest_classes"]] == [("spes.x:A", 2, 6)]
    assert [(s["name"], s["lines"]) for s in stats["largest_functions"]] == [
        ("spes.x:A.f", 5),
        ("spes.x:A.f.inner", 2),
        ("spes.x:g", 2),
    ]
    assert stats["total"] == {"files": 1, "lines": 11, "code": 7}


def test_code_stats_measures_the_package(tmp_path: Path) -> None:
    stats, out = run_bench("code_stats", tmp_path, "--top", "3")
    assert stats["modules"]["spes/model.py"]["lines"] == len((REPO / "spes" / "model.py").read_text().splitlines())
    assert not any("_pb2" in path for path in stats["modules"])
    assert len(stats["largest_functions"]) == 3 and "largest classes" in out
    assert stats["rev"] == "working tree" and stats["machine"]["cpus"] > 0 and "ruff" not in stats["machine"]


def test_hottest_lines_counts_own_and_inclusive_samples(tmp_path: Path) -> None:
    from bench_sync import hottest_lines

    path = tmp_path / "raw.txt"
    path.write_text("thread (1);main (a.py:1);feed (wire.py:9) 3\nthread (1);main (a.py:1) 1\n")
    summary = hottest_lines(path)
    assert summary["samples"] == 4
    assert dict(map(tuple, summary["own"])) == {"feed (wire.py:9)": 0.75, "main (a.py:1)": 0.25}
    assert dict(map(tuple, summary["inclusive"]))["main (a.py:1)"] == 1.0


def test_paper_run_has_19_merge_rounds_of_500() -> None:
    from bench_wire import PAPER_1B, PAPER_MERGE, merge_round_share
    from spes.config import load_config

    assert merge_round_share(load_config(PAPER_1B)[0], PAPER_MERGE) == (19, 500)


@pytest.mark.timeout(120)
def test_bench_wire_quick_measured_equals_analytic(tmp_path: Path) -> None:
    results, stdout = run_bench("bench_wire", tmp_path, "--codecs", "fp32", "bf16", "int8", "sparse:topk=32")
    assert results["checks"] and all(c["equal"] for c in results["checks"])
    assert results["targets"]["spes_bf16_over_reference"] <= 0.5
    assert results["targets"]["spes_bf16_saving_vs_diloco_bf16"] >= 1 / 3
    rounds = {c["round"] for c in results["checks"]}
    assert rounds >= {"spes_int8_first", "spes_int8_merge", "spes_int8_plain", "spes_sparse:topk=32_plain"}
    assert results["measured"]["spes_sparse:topk=32_plain"][0]["up"] < results["measured"]["spes_int8_plain"][0]["up"]
    assert results["targets"]["spes_int8_amortized_over_reference"] <= 0.16
    assert "measured = analytic for every peer and round: yes" in stdout


@pytest.mark.timeout(300)
def test_bench_codec_quick_weighs_cpu_seconds_against_wire_seconds(tmp_path: Path) -> None:
    results, stdout = run_bench("bench_codec", tmp_path, "--codecs", "int8", "sparse", "--serial_selection")
    int8, sparse = results["codecs"]["int8"], results["codecs"]["sparse"]
    # the sparse codec again with its selections on one thread, on the same shapes and wire
    assert set(results["serial_selection"]) == {"sparse"} and results["serial_selection"]["sparse"]["peer_encode_s"] > 0
    assert results["serial_selection"]["sparse"]["bytes"] == sparse["bytes"] and results["clock"] == "cpu"
    assert "sparse with its selections on one thread" in stdout
    for codec in (int8, sparse):
        assert codec["peer_s"] == pytest.approx(codec["peer_encode_s"] + codec["peer_decode_s"])
        assert codec["peer_encode_s"] > 0 and codec["server_s"] > 0
        assert codec["bytes"] < codec["fp32_bytes"]
        assert codec["saved_s"]["100 Mbit/s"] == pytest.approx(10 * codec["saved_s"]["1000 Mbit/s"])
    assert sparse["bytes"] < int8["bytes"] and sparse["settings"] == {}
    assert "sparse: peer " in stdout
    # measured twice, in processes with 2 MiB and 4 KiB pages; the record's figures are the first's
    assert results["pages"]["2 MiB"]["codecs"] == results["codecs"]
    assert set(results["pages"]["4 KiB"]["codecs"]) == {"int8", "sparse"}
    assert results["huge_pages_seen"] == (results["pages"]["2 MiB"]["huge_page_kib"] > 0)
    refused = subprocess.run(
        [sys.executable, str(BENCH / "bench_codec.py"), "--quick", "--codecs", "bf16", "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert refused.returncode != 0 and "measure a held-model codec" in refused.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_memory_quick_within_5_percent(tmp_path: Path) -> None:
    results, _ = run_bench("bench_memory", tmp_path)
    assert all(c["within_5pct"] for c in results["checks"])
    spes, full = results["paper_1b"]["spes"], results["paper_1b"]["full"]
    assert spes["meta_vs_analytic_rel_err"] == 0 and full["meta_vs_analytic_rel_err"] == 0
    assert spes["analytic"]["static_bytes"] < full["analytic"]["static_bytes"]


@pytest.mark.timeout(240)
def test_bench_aggregate_quick(tmp_path: Path) -> None:
    results, _ = run_bench("bench_aggregate", tmp_path)
    cases = {(r["case"], r["dtype"]) for r in results["results"]}
    assert ("spes merge round", "fp32") in cases and ("diloco average", "bf16") in cases
    assert all(r["aggregate_gb_s"] > 0 and r["memcpy_gb_s"] > 0 for r in results["results"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_sync_quick(tmp_path: Path) -> None:
    results, _ = run_bench("bench_sync", tmp_path)
    for plane in ("grpc", "tcp"):
        m = results["measurements"][f"fp32_{plane}"]
        assert m["spes_rounds"][0]["bytes"] == m["raw_rounds"][0]["bytes"] > 0
        assert m["spes_over_raw_throughput"] > 0
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from report import panel_sync

    fig, ax = plt.subplots()
    panel_sync(ax, results)  # docs/benchmarks.png draws the full run's JSON, same keys
    assert len(ax.patches) == 2 * len(results["measurements"])
    plt.close(fig)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_train_quick(tmp_path: Path) -> None:
    results, _ = run_bench("bench_train", tmp_path)
    assert {r["variant"] for r in results["results"]} == {
        "spes/torch",
        "full/torch",
        "spes/grouped_mm",
        "full/grouped_mm",
    }
    spes = next(r for r in results["results"] if r["variant"] == "spes/torch")
    full = next(r for r in results["results"] if r["variant"] == "full/torch")
    assert spes["trainable_params"] < full["trainable_params"]


def test_link_bucket_paces_at_its_rate() -> None:
    from link_relay import Bucket

    bucket = Bucket(1000.0, burst=100)
    assert bucket.reserve(100, now=0.0) == 0.0  # the burst leaves at once
    assert bucket.reserve(500, now=0.0) == pytest.approx(0.5)  # then 1000 bytes/s
    assert bucket.reserve(500, now=0.5) == pytest.approx(1.0)  # queued behind the first 500
    assert bucket.reserve(50, now=10.0) == 10.0  # idle time refills up to the burst only


def test_wan_ideal_round_is_bytes_over_the_tighter_link_plus_round_trips() -> None:
    from bench_wan import LinkSpec

    link = LinkSpec(peer_mbit=8.0, server_mbit=16.0, rtt_ms=100.0)  # 1 MB/s per peer, 2 MB/s shared
    # uploads: 3 peers x 1 MB share the 2 MB/s server link (1.5 s); download: one peer's 2 MB at 1 MB/s (2 s)
    assert link.ideal_seconds([10**6] * 3, [2 * 10**6, 0, 0]) == pytest.approx(1.5 + 0.1 + 2.0 + 0.1)


def test_a_wire_of_fewer_bytes_is_measured_on_a_model_whose_ideal_round_is_as_long_as_bf16s() -> None:
    from bench_wan import FIRST_ROUND_S, SCALES, SPEEDS, LinkSpec, scale_for, scaled_round_bytes

    link = LinkSpec(20.0, 20.0, 50.0)
    assert scale_for("bf16", link) == SPEEDS[20.0] == 768
    floor = link.ideal_seconds(*scaled_round_bytes(768, "bf16"))
    chosen = scale_for("int8", link)  # a smaller model's int8 round would be shorter than bf16's, this one's is not
    assert link.ideal_seconds(*scaled_round_bytes(chosen, "int8")) >= floor
    assert all(link.ideal_seconds(*scaled_round_bytes(s, "int8")) < floor for s in SCALES if s > chosen)
    assert chosen == 192
    # no sparse round is as long as bf16's; the largest model whose first round of full values fits the bound
    sparse = scale_for("sparse", link)
    assert link.ideal_seconds(*scaled_round_bytes(sparse, "sparse", True)) <= FIRST_ROUND_S
    assert all(link.ideal_seconds(*scaled_round_bytes(s, "sparse", True)) > FIRST_ROUND_S for s in SCALES if s < sparse)
    assert link.ideal_seconds(*scaled_round_bytes(sparse, "sparse")) < floor and sparse == 48


@pytest.mark.timeout(60)
def test_link_relay_carries_every_byte_both_ways(tmp_path: Path) -> None:
    import socket
    import threading

    echo = socket.create_server(("127.0.0.1", 0))
    port = echo.getsockname()[1]

    def serve() -> None:
        conn, _ = echo.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    relay = subprocess.Popen(
        [
            sys.executable,
            str(BENCH / "link_relay.py"),
            "--ports",
            str(port),
            "--peers",
            "2",
            "--peer_mbit",
            "400",
            "--server_mbit",
            "400",
            "--rtt_ms",
            "10",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert relay.stdout is not None and relay.stdout.readline().strip() == "RELAYING"
        payload = bytes(range(256)) * 4096  # 1 MiB
        with socket.create_connection(("127.0.0.11", port), timeout=20) as conn:  # peer 1's address
            conn.sendall(payload)
            conn.shutdown(socket.SHUT_WR)
            got = bytearray()
            while chunk := conn.recv(65536):
                got += chunk
        assert bytes(got) == payload
    finally:
        relay.terminate()
        out, _ = relay.communicate(timeout=20)
        echo.close()
    counts = json.loads(out.strip().splitlines()[-1])
    assert counts == {"bytes_up": [0, len(payload)], "bytes_down": [0, len(payload)]}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_wan_quick(tmp_path: Path) -> None:
    """The sparse codec through the emulated link (the raw codecs take the same path with fewer steps): after the
    first (full) round, its rounds move exactly the steady-state bytes the run spec predicts, which the raw
    baseline moves too, and far fewer than the 1B's bf16 rounds would."""
    results, _ = run_bench("bench_wan", tmp_path, "--wires", "sparse", "--warmup", "1")
    (m,) = results["measurements"]
    assert m["spes_rounds"][0]["bytes"] == m["raw_rounds"][0]["bytes"] > 0  # the same bytes, read from the peers
    assert m["ideal_s"] > 0 and m["efficiency"] > 0 and m["raw_efficiency"] > 0
    (p,) = results["prediction_1b"]
    assert p["wire"] == "sparse" and 0 < p["bytes_per_peer"] < 2 * 1_000**3 / 16  # well under 1 bit per parameter


@pytest.mark.timeout(60)
def test_bench_wan_refuses_an_unknown_speed_before_timing_the_1b_step(tmp_path: Path) -> None:
    """--speeds is checked first: a typo costs seconds, not the minutes of --measure_step it would wait behind."""
    out = tmp_path / "x.json"
    cmd = [sys.executable, str(BENCH / "bench_wan.py"), "--speeds", "7", "--measure_step", "1", "--out", str(out)]
    refused = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=50)
    assert refused.returncode == 2 and "--speeds [7.0]: each speed must be one of" in refused.stderr
    assert "1B SPES node" not in refused.stdout and not out.exists()


@pytest.mark.parametrize("flag", [["--server_factor", "4"], ["--rtt_ms", "100"], ["--speeds", "20"]])
def test_bench_wan_from_json_refuses_the_flags_of_a_new_measurement(
    flag: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--from_json predicts from the record's links as measured: a --server_factor (docs/running.md's way to a
    faster server link) or another flag of a measurement given beside it changed nothing, silently."""
    from bench_wan import main

    out = tmp_path / "x.json"
    record = str(REPO / "bench" / "results" / "bench_wan.json")
    with pytest.raises(SystemExit) as refused:
        main(["--from_json", record, "--step_s", "4.76", "--out", str(out), *flag])
    assert refused.value.code == 2 and not out.exists()
    assert f"{flag[0]}: a flag of a new link measurement, but --from_json" in capsys.readouterr().err


def test_idle_share_blocking_and_overlapped() -> None:
    from common import idle_share

    assert idle_share(10.0, 1.0, 10) == 0.5  # a round as long as the steps between rounds: half the time
    assert idle_share(5.0, 1.0, 10, fragments=1) == 0.0  # hidden behind 10 steps
    assert idle_share(20.0, 1.0, 10, fragments=1) == 0.5  # waits 10 s of every 20
    assert idle_share(8.0, 1.0, 10, fragments=5, rtt_s=1.0) == 2.0 / 12.0  # 4 more rounds' round trips: 12 s


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_overlap_quick(tmp_path: Path, tiny_corpus: Corpus) -> None:
    results, stdout = run_bench(
        "bench_overlap",
        tmp_path,
        "--runs",
        str(tmp_path / "runs"),
        "--fragments",
        "2",
        "--sync_steps",
        "4",
        "--overlap_steps",
        "1",
        "--codecs",
        "fp32",
        "int8",
        *corpus_flags(tiny_corpus, valid=False),
    )
    (pair,) = results["pairs"]
    blocking, overlapped, coded = pair["blocking"], pair["overlapped"], pair["overlapped_int8"]
    assert blocking["tokens"] == overlapped["tokens"] == coded["tokens"] == 2 * 4 * 16 * 64  # 2 peers x 4 x 16 x 64
    assert blocking["rounds"] == [1, 1] and overlapped["rounds"] == coded["rounds"] == [2, 2]  # steps 2 and 4
    assert {"--spes_config.overlap_fragments=2", "--spes_config.overlap_steps=1"} <= set(results["overlap_flags"])
    assert all(b > 0 for b in overlapped["relay_bytes"]["bytes_up"] + overlapped["relay_bytes"]["bytes_down"])
    assert sum(coded["bytes_up"]) < sum(overlapped["bytes_up"])  # int8 deltas after the first (full) round
    for arm in (blocking, overlapped, coded):  # where the CPU went: the peers train, the server and relay move bytes
        assert arm["cpu_s"]["peers"] > arm["cpu_s"]["server"] > 0 < arm["cpu_s"]["relay"]
    assert results["codecs"] == {"overlapped": "fp32", "overlapped_int8": "int8"}
    assert results["ratio"] == pair["ratio"] == results["ratios"]["overlapped"] > 0
    assert results["ratios"]["overlapped_int8"] == pair["ratios"]["overlapped_int8"] > 0
    assert "overlapped / blocking tokens/s" in stdout and "overlapped_int8 / blocking tokens/s" in stdout


def test_bench_overlap_mini_repro_shape_is_the_mini_reproductions_run() -> None:
    """`--shape mini_repro` trains bench/mini_repro.py's model, peers, batch and merge warm-up (a valid config)."""
    from bench_overlap import Shape, mini_repro_shape
    from mini_repro import FULL
    from spes.config import load_config

    shape = mini_repro_shape()
    cfg, _ = load_config(REPO / "configs" / "tiny.yaml", list(shape.overrides))
    assert shape == Shape(4, shape.overrides) and cfg.spes_config.num_peers == 4
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.global_train_batch_size) == (
        FULL.d_model,
        FULL.n_layers,
        FULL.peer_batch,
    )
    assert cfg.server.merge_interval == FULL.merge_interval


def test_bench_overlap_refuses_arms_that_differ() -> None:
    from bench_overlap import check_premises

    arm = {
        "tokens_per_peer": [1024, 1024],
        "steps": [4, 4],
        "rounds": [2, 2],
        "bytes_up_per_round": [100.0, 100.0],
        "bytes_down_per_round": [120.0, 120.0],
        "bytes_up": [200.0, 200.0],
        "relay_bytes": {"bytes_up": [250, 250], "bytes_down": [300, 300]},
    }
    assert check_premises(arm, dict(arm)) == []
    fragmented = {**arm, "rounds": [4, 4], "bytes_up_per_round": [60.0, 60.0], "bytes_up": [240.0, 240.0]}
    assert check_premises(arm, fragmented, fragments=2) == []
    assert check_premises(arm, fragmented) == [
        "rounds differ: blocking [2, 2], overlapped [4, 4]",
        "bytes_up_per_round differ: blocking [100.0, 100.0], overlapped [60.0, 60.0]",
    ]
    assert "uploaded less" in check_premises(arm, {**fragmented, "bytes_up": [240.0, 100.0]}, fragments=2)[0]
    assert check_premises(arm, {**arm, "tokens_per_peer": [1024, 512]}) == [
        "tokens_per_peer differ: blocking [1024, 1024], overlapped [1024, 512]"
    ]
    bypassed = {**arm, "relay_bytes": {"bytes_up": [0, 250], "bytes_down": [300, 300]}}
    assert "did it bypass the link?" in check_premises(arm, bypassed)[0]
    coded = {**fragmented, "bytes_up": [60.0, 60.0], "relay_bytes": {"bytes_up": [70, 70], "bytes_down": [9, 9]}}
    assert check_premises(arm, coded, fragments=2, codec="int8") == []  # fewer bytes by design, same tokens
    assert "uploaded less" in check_premises(arm, coded, fragments=2)[0]
    assert check_premises(arm, {**coded, "steps": [4, 3]}, fragments=2, codec="int8") == [
        "steps differ: blocking [4, 4], overlapped [4, 3]"
    ]


def test_bench_fused_loss_quick(tmp_path: Path) -> None:
    results, out = run_bench("bench_fused_loss", tmp_path)
    whole, fused = results["arms"]["whole"], results["arms"]["fused"]
    assert (whole["fused_loss"], fused["fused_loss"]) == (False, True)
    assert whole["tokens_per_step"] == fused["tokens_per_step"] == 256
    assert results["loss_agreement"] <= 1e-4 and "fused / whole" in out


def test_bench_gpu_quick_records_every_variant_with_its_profile_and_syncs(tmp_path: Path) -> None:
    """The GPU benchmark's CPU smoke run (cut-down shape): each variant's figures, kernel table and sync count,
    measured in a process of its own; a junit file of the GPU tests summarized; the multi-GPU part says why it did
    not run."""
    import bench_gpu

    junit = tmp_path / "gpu_tests.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest" tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.test_x" name="test_a"/><testcase classname="tests.test_x" name="test_b">'
        '<failure message="boom"/></testcase></testsuite></testsuites>'
    )
    out = tmp_path / "bench_gpu.json"
    flags = ["--only", "torch,grouped_mm", "--pytest_junit", str(junit), "--preflight"]
    assert bench_gpu.main(["--quick", "--out", str(out), *flags]) == 0
    record = json.loads(out.read_text())
    assert record["status"] == "complete" and record["commit"] and record["machine"]["device"] == "cpu"
    assert [v["name"] for v in record["variants"]] == ["torch", "grouped_mm"]
    for v in record["variants"]:
        assert v["status"] == "ok", v
        assert v["step_s"] > 0 and v["tokens_per_s"] > 0 and v["tflops_done_per_token"] < v["tflops_per_token"]
        assert 0 < len(v["top_kernels"]) <= 20 and v["top_kernels"][0]["ms"] > 0
        ops = v["top_ops"]
        assert 0 < len(ops) <= 20 and ops[0]["name"].startswith("aten::") and ops[0]["shapes"].startswith("[[")
        assert v["profiled_kernel_ms"] >= sum(k["ms"] for k in v["top_kernels"]) and v["device_busy"] > 0
    torch_v, grouped = record["variants"]
    assert len({os.getpid(), torch_v["process"], grouped["process"]}) == 3
    assert grouped["syncs_per_step"]["count"] == 1 < torch_v["syncs_per_step"]["count"]
    assert record["multi_gpu"] == {
        "ran": False,
        "why": "0 GPU(s): the NCCL all-reduce and the FSDP2 step need at least two",
    }
    assert record["gpu_tests"]["tests"] == 3 and record["gpu_tests"]["failed"] == ["tests.test_x::test_b"]
    assert record["megablocks"]["importable"] in (True, False) and record["megablocks"]["why"]
    assert record["preflight_gpu"]["ran"] and "gpu: no CUDA device" in record["preflight_gpu"]["output"]
    assert record["preflight_agreement"] == {"compared": False, "why": "no 'ok step' line in the preflight's output"}


def test_bench_gpu_records_a_variant_that_hangs_and_goes_on(tmp_path: Path) -> None:
    """A variant's process still running at --variant_timeout_s is stopped and recorded as timed out; the record is
    complete all the same (an unknown --variant is refused naming the ones there are)."""
    import bench_gpu

    out = tmp_path / "bench_gpu.json"
    assert bench_gpu.main(["--quick", "--out", str(out), "--only", "torch", "--variant_timeout_s", "0.5"]) == 0
    record = json.loads(out.read_text())
    assert record["status"] == "complete"
    why = "still running after --variant_timeout_s 0.5"
    assert record["variants"] == [{"name": "torch", "status": "timeout", "why": why}]
    with pytest.raises(SystemExit, match="no variant named 'nope'.*grouped_mm"):
        bench_gpu.main(["--quick", "--out", str(out), "--variant", "nope"])


def test_bench_gpu_compares_the_preflights_step_with_its_cuda_defaults() -> None:
    """Issue 29: `spes.preflight --gpu` reports the benchmark's tokens/s and MFU. The step line (made by the
    preflight's own code) is compared with the run's CUDA-defaults variants, and only when it stepped that setting."""
    import bench_gpu
    from records import CUDA_DEFAULTS
    from spes import speed
    from spes.checks import ok, report
    from spes.config import load_config
    from spes.gpu_check import step_settings

    figures = {
        "tokens_per_s": 262_000.0, "micro_batches_per_step": 32, "micro_batch": 8, "step_s": 2.0,
        "per_micro_batch_s": 0.06, "fixed_s": 0.08, "mfu": 0.44, "mfu_done": 0.4, "trained_expert_share": 0.31,
        "peak_tflops": 989.0,
    }  # fmt: skip

    def preflight_output(*overrides: str) -> str:
        cfg = load_config(bench_gpu.CONFIG, list(overrides))[0].on_device("cuda")
        lines: list[str] = []
        step = f"node step ({step_settings(cfg, 'grouped_mm')}): {speed.describe(figures)}; peak memory 13 GiB"
        report([ok("block", "one block"), ok("step", step)], out=lines.append)
        return "\n".join(lines)

    rows = [
        {"name": CUDA_DEFAULTS, "status": "ok", "tokens_per_s": 250_000.0},
        {"name": bench_gpu.AGAIN, "status": "ok", "tokens_per_s": 270_000.0},
        {"name": "grouped_mm+fused+compile mb4", "status": "ok", "tokens_per_s": 100_000.0},
    ]
    got = bench_gpu.preflight_agreement(preflight_output(), rows)
    assert got["compared"] and got["ratio"] == pytest.approx(262_000 / 260_000)
    assert got["preflight_mfu"] == pytest.approx(0.44) and got["preflight_tokens_per_s"] == 262_000
    eager = bench_gpu.preflight_agreement(preflight_output("--compile=false"), rows)
    assert not eager["compared"] and "eager" in eager["why"] and CUDA_DEFAULTS in eager["why"]
    assert not bench_gpu.preflight_agreement("gpu: no CUDA device", rows)["compared"]
    assert not bench_gpu.preflight_agreement(preflight_output(), rows[2:])["compared"]


def test_bench_gpu_runs_cuda_graphs_only_without_checkpointing() -> None:
    """The reduce-overhead variant (CUDA graphs) compiles in that mode with static shapes and checkpoints nothing: a
    compiled module inside a non-reentrant checkpoint fails under CUDA graphs (pytorch/pytorch#154306)."""
    import bench_gpu

    graphed = [v for v in bench_gpu.variants(quick=False) if v.compile_mode == "reduce-overhead"]
    assert len(graphed) == 1
    assert bench_gpu.compile_option(graphed[0], quick=False) == {"dynamic": False, "mode": "reduce-overhead"}
    assert "--activation_checkpointing=null" in graphed[0].overrides()


def test_bench_gpu_loss_chunk_variant_sets_the_heads_chunk_for_itself_only(tmp_path: Path) -> None:
    """A variant's `loss_chunk` is the chunk `fused_loss`'s head uses while it runs (more chunks for a smaller one),
    and the product's constant is back afterwards."""
    import bench_gpu
    import spes.head_loss

    kept = spes.head_loss.LOSS_CHUNK_ELEMENTS
    h, labels = torch.randn(64, 8), torch.randint(0, 32, (64,))
    weight = torch.randn(32, 8)
    calls = []

    def counting(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return spes.head_loss.chunk_loss_sums(*args)  # type: ignore[arg-type]

    with bench_gpu.loss_chunk(32 * 16):  # 16 tokens of 32 logits a chunk
        fns = spes.head_loss.ChunkFns(sums=counting)
        spes.head_loss.head_loss_sums(h, weight, labels, logit_z_weight=None, chunk_fns=fns)
        assert spes.head_loss.LOSS_CHUNK_ELEMENTS == 32 * 16
    assert len(calls) == 64 // 16 and spes.head_loss.LOSS_CHUNK_ELEMENTS == kept
    with bench_gpu.loss_chunk(None):
        assert spes.head_loss.LOSS_CHUNK_ELEMENTS == kept


def test_bench_gpu_liger_variant_computes_the_heads_contract_with_liger_for_itself_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The liger variant's model takes its head and loss from liger-kernel's fused linear cross entropy, mapped to
    spes.head_loss's (ce + w z, ce, z) and the same gradients (here a stand-in computing liger 0.8.5's contract from
    the whole logits: the real one needs a GPU), and spes.head_loss's afterwards; without liger-kernel the variant
    fails naming the fix."""
    import types

    import bench_gpu
    import spes.head_loss
    import spes.model

    def liger_contract(h, w, labels, *, ignore_index, lse_square_scale, reduction, return_z_loss, accum_dtype):  # type: ignore[no-untyped-def]
        assert (ignore_index, reduction, return_z_loss, accum_dtype) == (-100, "sum", True, torch.float32)
        logits = (h @ w.T).float()
        kept = labels != ignore_index
        wz = (lse_square_scale * torch.logsumexp(logits, -1).square() * kept).sum()
        return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") + wz, wz

    with pytest.raises(RuntimeError, match="prepare_gpu.sh"), bench_gpu.head("liger"):
        pass
    package = types.ModuleType("liger_kernel")
    package.__spec__ = importlib.machinery.ModuleSpec("liger_kernel", None)
    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = liger_contract  # type: ignore[attr-defined]
    for name, module in (("liger_kernel", package), ("liger_kernel.transformers.functional", functional)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", types.ModuleType("liger_kernel.transformers"))
    kept = spes.model.head_loss_sums
    h, w = torch.randn(40, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True)
    labels = torch.randint(0, 30, (40,))
    labels[5] = -100
    for z_weight in (None, 1e-2):
        with bench_gpu.head("liger"):
            got = spes.model.head_loss_sums(h, w, labels, logit_z_weight=z_weight)
            assert spes.model.head_loss_sums is not kept
        want = spes.head_loss.head_loss_sums(h, w, labels, logit_z_weight=z_weight)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got[0], (h, w)), torch.autograd.grad(want[0], (h, w)))
    assert spes.model.head_loss_sums is kept


def test_bench_gpu_records_a_failing_variant_and_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of memory and any other error are a variant's results (the row its process writes); a variant past the
    time budget is recorded as skipped."""
    import torch

    import bench_gpu
    from spes import speed

    build = speed.build_timed_node

    def failing(cfg, device):  # type: ignore[no-untyped-def]
        if cfg.device_train_microbatch_size == 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        if cfg.model.moe_backend == "torch":
            raise RuntimeError("compile failed")
        return build(cfg, device)

    monkeypatch.setattr(speed, "build_timed_node", failing)
    rows = [bench_gpu.run_variant(v, torch.device("cpu"), quick=True) for v in bench_gpu.variants(quick=True)]
    status = {v["name"]: (v["status"], v.get("error", "")) for v in rows}
    assert status["grouped_mm+fused"][0] == "oom" and "9.00 GiB" in status["grouped_mm+fused"][1]
    assert status["torch"] == ("error", "RuntimeError: compile failed")
    assert status["grouped_mm"][0] == "ok"
    out = tmp_path / "bench_gpu.json"
    bench_gpu.main(["--quick", "--out", str(out), "--budget_s", "-1"])
    assert {v["status"] for v in json.loads(out.read_text())["variants"]} == {"skipped"}


def test_report_renders_the_gpu_section_from_the_records(tmp_path: Path) -> None:
    """Without bench_gpu.json the section says so and advises from the older GPU record; with it, one row per
    variant and the fastest setting that fits each GPU class; a README without the markers is refused."""
    from report import gpu_section, update_readme

    shutil.copy(REPO / "bench" / "results" / "bench_wan_gpu_steps.json", tmp_path)
    section = gpu_section(tmp_path)
    assert section.startswith("No GPU benchmark record yet")
    assert "| 48 GB (L40S, A6000) | `moe_backend: torch`, micro-batch 2" in section and "28.1" in section
    assert "| 24 GB (RTX 4090, L4) | no measured setting fits" in section

    def variant(name: str, mb: int, tps: float, gib: float) -> dict:
        settings = {"micro_batch": mb, "fused_loss": True, "compile": False, "checkpointing": True}
        return {
            "name": name, "status": "ok", "settings": settings, "moe_backend": "grouped_mm", "step_s": 3.0,
            "tokens_per_s": tps, "mfu": 0.3, "mfu_done": 0.27, "peak_memory_bytes": gib * 2**30,
            "syncs_per_step": {"count": 1}, "timed_steps_s": {"1": [1.0], "4": [1.0, 1.1, 1.2]}, "device_busy": 0.9,
        }  # fmt: skip

    # a record from before `device_busy`: the kernel table's total (ms / share) less the optimizer's range over
    # the projected step of 2 micro-batches: (180 - 10) ms / (0.02 + 2 * 0.1) s = 77%
    older = {k: v for k, v in variant("mb4", 4, 150_000.0, 19.0).items() if k != "device_busy"}
    kernels = [{"name": "gemm", "ms": 90.0, "share": 0.5}, {"name": "Optimizer.step#AdamW.step", "ms": 10.0}]
    older.update(top_kernels=kernels, fixed_s=0.02, per_micro_batch_s=0.1)
    record = {
        "mode": "full", "commit": "abc", "machine": {"name": "NVIDIA H100 80GB HBM3", "torch": "2.11"},
        "variants": [variant("mb8", 8, 180_000.0, 35.0), older, {"name": "mb16", "status": "oom", "settings": {}}],
    }  # fmt: skip
    (tmp_path / "bench_gpu.json").write_text(json.dumps(record))
    section = gpu_section(tmp_path)
    assert "| mb8 | 3.00 | 180,000 | 30.0% / 27.0% | 35.0 | 1 | 18% | 90% |" in section and "| mb16 | oom |" in section
    assert "| mb4 | 3.00 | 150,000 | 30.0% / 27.0% | 19.0 | 1 | 18% | 77% |" in section
    assert "| 80 GB (A100 / H100 80GB) | `moe_backend: grouped_mm`, micro-batch 8, `fused_loss` | 180,000 |" in section
    assert "| 24 GB (RTX 4090, L4) | `moe_backend: grouped_mm`, micro-batch 4, `fused_loss` | 150,000 |" in section
    later = {**record, "variants": [variant("mb8 again", 8, 120_000.0, 35.0)]}  # a later run: its figure counts
    (tmp_path / "bench_gpu_head.json").write_text(json.dumps(later))
    section = gpu_section(tmp_path)
    assert "**`bench_gpu.json`**" in section and "**`bench_gpu_head.json`**" in section
    assert "micro-batch 8, `fused_loss` | 180,000 |" not in section
    assert "| 80 GB (A100 / H100 80GB) | `moe_backend: grouped_mm`, micro-batch 4, `fused_loss` | 150,000 |" in section

    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- gpu-table:start -->\nold\n<!-- gpu-table:end -->\nrest\n")
    update_readme(readme, "new")
    assert readme.read_text() == "intro\n<!-- gpu-table:start -->\nnew\n<!-- gpu-table:end -->\nrest\n"
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="markers"):
        update_readme(readme, "new")


def test_the_readme_gpu_section_is_the_rendered_one() -> None:
    from report import GPU_MARKERS, gpu_section

    text = (REPO / "README.md").read_text()
    rendered = text.split(GPU_MARKERS[0], 1)[1].split(GPU_MARKERS[1], 1)[0].strip("\n")
    assert rendered == gpu_section(REPO / "bench" / "results"), "run bench/report.py --no_png"


def test_bench_quickstart_times_each_stage_from_its_line_to_the_next(tmp_path: Path) -> None:
    from bench_quickstart import timed_stages

    script = tmp_path / "qs.sh"
    script.write_text(
        "echo 'quickstart [1/3] install: x'; sleep 1\n"
        "echo 'quickstart [2/3] corpus: y'\n"
        "echo 'quickstart [3/3] train: z'; sleep 1; echo 'SPES run summary'\n"
    )
    stages, tail = timed_stages(["bash", str(script)], tmp_path, dict(os.environ), timeout=60)
    assert list(stages) == ["install", "corpus", "train"] and "SPES run summary" in tail
    assert stages["install"] > 0.5 and stages["train"] > 0.5  # each stage holds its own sleep
    assert sum(stages.values()) < 60
    script.write_text("echo 'quickstart [1/3] install: x'; exit 3\n")
    with pytest.raises(SystemExit, match="exited with 3"):
        timed_stages(["bash", str(script)], tmp_path, dict(os.environ), timeout=60)
    script.write_text("echo 'quickstart [1/3] install: x'; sleep 60 & wait\n")  # silent, its child holding stdout
    started = time.monotonic()
    with pytest.raises(SystemExit, match="ran past 1 s"):
        timed_stages(["bash", str(script)], tmp_path, dict(os.environ), timeout=1)
    assert time.monotonic() - started < 30  # half the 60 s its child holds stdout: not waited out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_quickstart_quick_times_the_three_stages_of_a_fresh_clone(tmp_path: Path) -> None:
    """main() as `--quick` runs it, on a clone lent this interpreter's environment and a 1 MB corpus (so nothing is
    downloaded): the clone's quickstart ends with its summary and the record names the three stages."""
    corpus = tmp_path / "corpus"
    build = [sys.executable, str(REPO / "data_process_scripts" / "build_default_corpus.py"), "--max_mb", "1"]
    subprocess.run([*build, "--output_dir", str(corpus), "--quiet"], check=True, timeout=120, capture_output=True)
    venv = Path(sys.executable).parents[1]
    record, stdout = run_bench("bench_quickstart", tmp_path, "--venv", str(venv), "--corpus", str(corpus), timeout=560)
    assert list(record["stages"]) == ["install", "corpus", "train"] and "SPES run summary" in stdout
    assert record["mode"] == "quick" and record["lent"] == {".venv": str(venv), "data/default": str(corpus)}
    assert "already built" in stdout and "started server" in stdout
    peers = [row.split() for row in stdout.splitlines() if re.match(r"\s*\d+\s+10\s", row)]  # peer, steps, ...
    assert len(peers) == 4 and all(row[-6] == "1" for row in peers), stdout  # each peer's rounds: one sync


def test_quickstart_says_each_stage_with_its_time_from_the_record(tmp_path: Path) -> None:
    """The stage lines of run_scripts/quickstart.sh, with and without a committed record of a fresh clone."""
    text = (REPO / "run_scripts" / "quickstart.sh").read_text()
    stage = "stage() {" + text.split("\nstage() {")[1].split("\nstage 1 ")[0]
    script = tmp_path / "stage.sh"
    script.write_text(stage + '\nstage 1 install "what it does"\nstage 3 train "what it does"\n')
    (tmp_path / "bench" / "results").mkdir(parents=True)
    plain = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert plain.splitlines() == ["quickstart [1/3] install: what it does", "quickstart [3/3] train: what it does"]
    record = {"stages": {"install": 250.0, "corpus": 20.0, "train": 40.0}}
    (tmp_path / "bench" / "results" / "bench_quickstart.json").write_text(json.dumps(record))
    timed = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert timed.splitlines() == [
        "quickstart [1/3] install: what it does; on a fresh clone: 4 min",
        "quickstart [3/3] train: what it does; on a fresh clone: 40 s",
    ]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_config_given_relative_to_the_working_directory(tmp_path: Path) -> None:
    """`--config configs/tiny.yaml`, as a user types it in the repository root, is measured and named as typed (it
    used to end in a traceback after the measurement); a config that is not a file is refused before measuring."""
    results, _ = run_bench("bench_train", tmp_path, "--config", "configs/tiny.yaml")
    assert results["config"] == "configs/tiny.yaml"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_memory.py"), "--quick", "--config", "configs/nope.yaml"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2 and "'configs/nope.yaml' is not a file" in proc.stderr.splitlines()[-1]


def test_a_quick_run_never_overwrites_the_committed_record(tmp_path: Path) -> None:
    """`--quick` without `--out` writes bench/results/<name>_quick.json (ignored by git), a full run <name>.json and
    one with --device cuda <name>_gpu.json (the CPU's record stays); an explicit --out is taken as given, and a
    benchmark that names its own records (`--out` default None) keeps it."""
    from common import RESULTS_DIR, parser

    p = parser("bench_x", None)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    assert p.parse_args(["--quick"]).out == RESULTS_DIR / "bench_x_quick.json"
    assert p.parse_args([]).out == RESULTS_DIR / "bench_x.json"
    assert p.parse_args(["--device", "cuda"]).out == RESULTS_DIR / "bench_x_gpu.json"
    assert p.parse_args(["--device", "cuda", "--quick"]).out == RESULTS_DIR / "bench_x_gpu_quick.json"
    assert p.parse_args(["--quick", "--out", str(tmp_path / "x.json")]).out == tmp_path / "x.json"
    p.set_defaults(out=None)
    assert p.parse_args(["--quick"]).out is None
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "bench/results/bench_memory_quick.json"], cwd=REPO, check=False
    )
    assert ignored.returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_server_memory_quick(tmp_path: Path) -> None:
    """--quick sets what it is not told: an explicit size is measured, the quick peers and rounds fill the rest."""
    results, _ = run_bench("bench_server_memory", tmp_path, "--sizes_mb", "8")
    (case,) = results["cases"]
    assert results["mode"] == "quick" and (round(case["model_mb"]), case["peers"], results["rounds"]) == (8, 2, 2)
    assert case["peak_rss_mb"] >= case["idle_rss_mb"] > 0
    assert case["bound_mb"] == case["model_mb"] + case["staged_mb"]


def test_a_missing_corpus_names_only_the_flags_the_benchmark_has() -> None:
    """bench_overlap reads no validation shards, so its refusal must not send the user to a --valid it lacks."""
    import argparse

    from common import check_corpus

    with pytest.raises(SystemExit, match=r"pass --tokenizer and --train$"):
        check_corpus(argparse.Namespace(tokenizer="/nonexistent/tokenizer", train="x/*.npy"))
    with pytest.raises(SystemExit, match=r"pass --tokenizer, --train and --valid$"):
        check_corpus(argparse.Namespace(tokenizer="/nonexistent/tokenizer", train="x/*.npy", valid="y/*.npy"))


def test_bench_wan_takes_codecs_as_the_other_benchmarks_name_them() -> None:
    """bench_wire, bench_codec, bench_overlap and mini_repro take `--codecs`; bench_wan's `--wires` answers to it too
    (the committed records' commands keep `--wires`)."""
    from bench_wan import build_parser

    assert build_parser().parse_args(["--codecs", "int8", "sparse"]).wires == ["int8", "sparse"]
    assert build_parser().parse_args(["--wires", "bf16"]).wires == ["bf16"]
