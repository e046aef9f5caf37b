"""bench/mini_repro.py and bench/mini_repro_memory.py: a report is refused unless its runs trained on equal logged
tokens and ran to the end at one commit with the same premises (seeds, model, schedule, data); runs resume."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from bench_helpers import corpus_flags, run_bench
from conftest import Corpus


def _metrics(folder: Path, tokens_per_step: int, steps: int = 4) -> None:
    folder.mkdir(parents=True)
    lines = [
        {
            "step": s,
            "tokens": s * tokens_per_step,
            "val_loss": 5.0,
            "merged_val_loss": 5.0,
            "sync_s": 0.1,
            "sync_mb_up": 1.0,
            "sync_mb_down": 1.0,
        }
        for s in range(2, steps + 1, 2)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_mini_repro_refuses_unequal_token_budgets(tmp_path: Path) -> None:
    from mini_repro import check_equal_tokens, collect

    _metrics(tmp_path / "centralized", 4 * 512)
    for run in ("spes", "diloco"):
        for p in range(4):
            _metrics(tmp_path / run / f"node{p}", 512 if run == "spes" else 1024)  # DiLoCo peers: twice the batch
    curves = collect(tmp_path)
    assert curves["spes"]["tokens"] == curves["centralized"]["tokens"] == [4096, 8192]
    with pytest.raises(SystemExit, match=r"centralized trained on 8,192 tokens, diloco on 16,384"):
        check_equal_tokens(curves, tmp_path)
    curves["diloco"] = curves["spes"]
    check_equal_tokens(curves, tmp_path)


def test_mini_repro_overlap_compares_every_arm_at_equal_tokens(tmp_path: Path) -> None:
    from mini_repro import QUICK, overlap_variants

    variants = overlap_variants([2, 1], [1.0], [1], QUICK.sync_steps)
    arms = ["spes", "spes_overlap_d2", "spes_overlap_d1"]
    for run in arms:
        for p in range(4):
            _metrics(tmp_path / run / f"node{p}", 512)
    result = _compare(tmp_path, "spes", variants, "vs_blocking")
    assert result["tokens"] == dict.fromkeys(arms, 8192)
    assert [result["arms"][arm]["vs_blocking"] for arm in arms] == [0.0, 0.0, 0.0]
    assert result["arms"]["spes_overlap_d1"]["flags"] == [
        "--spes_config.overlap_sync=true",
        "--spes_config.overlap_steps=1",
    ]
    shutil.rmtree(tmp_path / "spes_overlap_d1" / "node3")
    _metrics(tmp_path / "spes_overlap_d1" / "node3", 256)
    with pytest.raises(SystemExit, match="unequal token budgets.*spes_overlap_d1 on 7,168"):
        _compare(tmp_path, "spes", variants, "vs_blocking")


def test_a_report_only_record_names_the_runs_command_and_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    from mini_repro import rendered_from

    monkeypatch.setattr(sys, "argv", ["bench/mini_repro.py", "--codecs", "int8", "--report-only", "--seed", "7"])
    assert rendered_from("a" * 40) == {
        "command": f"{Path(sys.executable).name} bench/mini_repro.py --codecs int8 --seed 7",
        "commit": "a" * 40,
    }
    assert rendered_from(None)["commit"] == "unknown"


def test_a_memory_record_names_the_runs_command_and_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """As mini_repro's: a record is the runs' (their commit, their command), not a re-render's, nor the tree's after
    the run wrote its report into docs/ (which made every full run's record name a dirty tree)."""
    import argparse

    from mini_repro_memory import ARMS, SEEDS, memory_setup, results_record

    monkeypatch.setattr(sys, "argv", ["bench/mini_repro_memory.py", "--report-only"])
    per_seed = {SEEDS[0]: {arm.name: {"tokens_final": 1} for arm in ARMS}}
    args = {"quick": True, "report_only": True}
    rest = (memory_setup(True), SEEDS[:1], {}, {}, {"commit": "b" * 40}, {}, per_seed, {})
    record = results_record(argparse.Namespace(**args), *rest)
    assert record["commit"] == "b" * 40 and record["command"].endswith("bench/mini_repro_memory.py")
    monkeypatch.setattr(sys, "argv", ["bench/mini_repro_memory.py"])  # a full run: docs/ is written before the record
    assert results_record(argparse.Namespace(**{**args, "report_only": False}), *rest)["commit"] == "b" * 40


def _record(runs: Path, commands: dict, commit: str = "a" * 40, **premises: object) -> None:
    """Each arm's run.json as `run_arms` leaves it once the arm has ended, its premises changed by `premises`."""
    from mini_repro import premises as resolve

    for arm, (cmd, _) in commands.items():
        info = {"commit": commit, "argv": cmd, "premises": {**resolve(cmd), **premises}, "complete": True}
        (runs / arm).mkdir(parents=True, exist_ok=True)
        (runs / arm / "run.json").write_text(json.dumps(info))


def _compare(runs: Path, base: str, variants: dict[str, list[str]], vs: str, record: bool = True) -> dict:
    """The comparison `mini_repro.py --report-only` writes from the arms' logs in `runs` (a 1,000-parameter model)."""
    from mini_repro import DEFAULT_SEED, QUICK, arm_commands, compare_arms

    commands = arm_commands(base, QUICK, QUICK.overrides("tok", "t/*.npy", "v/*.npy", DEFAULT_SEED), runs, variants)
    if record:
        _record(runs, commands)
    return compare_arms(commands, runs, base, variants, vs, 1000, DEFAULT_SEED)


def test_mini_repro_overlap_names_an_arm_per_fragments_delay_and_correction(tmp_path: Path) -> None:
    from mini_repro import QUICK, overlap_variants

    variants = overlap_variants(None, [1.0, 0.5], [1, 3], QUICK.sync_steps)
    arms = ["spes", "spes_overlap_d3", "spes_overlap_d3_c0.5", "spes_overlap_d1_f3", "spes_overlap_d1_f3_c0.5"]
    for run in arms:
        for p in range(4):
            _metrics(tmp_path / run / f"node{p}", 512)
    result = _compare(tmp_path, "spes", variants, "vs_blocking")
    assert list(result["arms"]) == arms
    assert result["arms"]["spes_overlap_d3_c0.5"]["flags"] == [
        "--spes_config.overlap_sync=true",
        "--spes_config.overlap_steps=3",
        "--spes_config.overlap_correction=0.5",
    ]
    assert result["arms"]["spes_overlap_d1_f3"]["flags"] == [
        "--spes_config.overlap_sync=true",
        "--spes_config.overlap_steps=1",
        "--spes_config.overlap_fragments=3",
    ]


def test_mini_repro_codecs_name_an_arm_per_codec_and_schedule_and_count_bits(tmp_path: Path) -> None:
    """`--codecs int8 sparse:topk=128 --overlap --dilico`: DiLoCo on fp32 is the base; each codec gets an arm
    alone and one per overlapped schedule; bits per parameter per peer and round come from the logged bytes."""
    from common import CodecChoice
    from mini_repro import QUICK, codec_variants, overlap_variants

    overlaps = overlap_variants([1], [1.0], [1], QUICK.sync_steps)
    variants = {
        **overlaps,
        **codec_variants([CodecChoice.parse("int8"), CodecChoice.parse("sparse:topk=128")], overlaps),
    }
    arms = ["diloco", *variants]
    assert arms == [
        "diloco",
        "spes_overlap_d1",
        "codec_int8",
        "codec_sparse_topk128",
        "codec_int8_spes_overlap_d1",
        "codec_sparse_topk128_spes_overlap_d1",
    ]
    assert variants["codec_sparse_topk128"] == ["--spes_config.codec=sparse", "--spes_config.codec_settings.topk=128"]
    for run in arms:
        for p in range(4):
            _metrics(tmp_path / run / f"node{p}", 512)
    result = _compare(tmp_path, "diloco", variants, "vs_fp32")
    arm = result["arms"]["codec_sparse_topk128"]
    assert arm["vs_fp32"] == 0.0 and arm["within_target"]
    # every logged round moved 1 MiB up and 1 MiB down per peer: 16 Mibit over 1,000 parameters
    assert arm["bits_per_param"] == {"mean": 8 * 2**21 / 1000, "last": 8 * 2**21 / 1000}


def _run_quick(name: str, tmp_path: Path, corpus: Corpus, *flags: str, timeout: float) -> tuple[dict, str]:
    """`bench/<name>.py --quick` on the test corpus, its runs and rendered docs under `tmp_path`: its JSON and
    stdout."""
    folders = ["--runs", str(tmp_path / "runs"), "--docs", str(tmp_path / "docs")]
    return run_bench(name, tmp_path, *folders, *corpus_flags(corpus), *flags, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mini_repro_quick(tmp_path: Path, tiny_corpus: Corpus) -> None:
    results, stdout = _run_quick("mini_repro", tmp_path, tiny_corpus, "--seed", "7", timeout=580)
    assert (tmp_path / "docs" / "mini_repro.png").stat().st_size > 0
    report = (tmp_path / "docs" / "mini_repro.md").read_text()
    assert "| SPES (4 peers) |" in report and "## Seeds" in report and "\n| 7 | " in report
    assert results["seed"] == 7 and results["commit"] and "mini_repro.py" in results["command"]
    # the equal-token invariant on the trainers' own counters: 6 steps x 16 (centralized) or 4 x 4 (peers) x 64
    peer_tokens = [
        [
            json.loads(line)["tokens"]
            for line in (tmp_path / "runs" / run / f"node{p}" / "metrics.jsonl").read_text().splitlines()
        ][-1]
        for run in ("spes", "diloco")
        for p in range(4)
    ]
    assert peer_tokens == [6 * 4 * 64] * 8
    assert results["tokens"] == {"centralized": 6 * 16 * 64, "spes": 6 * 16 * 64, "diloco": 6 * 16 * 64}
    assert "centralized 6,144; spes 6,144 (= 1,536 + 1,536 + 1,536 + 1,536)" in report
    assert "6,144" in stdout
    for run in ("centralized", "spes", "diloco"):
        assert results["curves"][run]["val_loss"]
    assert results["curves"]["spes"]["bytes"][-1] < results["curves"]["diloco"]["bytes"][-1]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mini_repro_memory_quick(tmp_path: Path, tiny_corpus: Corpus) -> None:
    results, stdout = _run_quick("mini_repro_memory", tmp_path, tiny_corpus, timeout=880)
    sizes = results["sizes"]
    budget = sizes["budget"]["total"]
    # measured: the SPES node at the large size fits the budget, the next size up and DiLoCo at the large size do not
    assert sizes["large"] > sizes["small"] and sizes["spes_nodes"][str(sizes["large"])]["total"] <= budget
    assert sizes["spes_nodes"][str(sizes["large"] + 4)]["total"] > budget and sizes["full_large"]["total"] > budget
    tokens = results["tokens"]
    assert {t for name, t in tokens.items() if name != "single_small"} == {6 * 16 * 64}
    assert tokens["single_small"] == 6 * 4 * 64
    report = (tmp_path / "docs" / "mini_repro_memory.md").read_text()
    assert "SPES-specific cost" in report and "25% of the run" in report and "OVER the budget" in report
    assert (tmp_path / "docs" / "mini_repro_memory.png").stat().st_size > 0

    def merged(arm: str) -> bool:
        lines = (tmp_path / "runs" / "seed6198" / arm / "node0" / "metrics.jsonl").read_text().splitlines()
        return any(json.loads(line).get("merged") for line in lines)

    assert merged("spes_large") and not merged("spes_large_nomerge")
    # only peer 0 evaluates (spes.launch --eval_peers 1), and the whole comparison's wall time is on record
    peer1 = (tmp_path / "runs" / "seed6198" / "spes_large" / "node1" / "metrics.jsonl").read_text()
    assert "sync_s" in peer1 and "val_loss" not in peer1
    assert results["run"]["total_wall_s"] > 0 and set(results["walls_s"]["6198"]) == set(tokens)
    assert "The whole comparison (7 arms x 1 seeds) took" in report


def _three_runs(runs: Path, seed: int = 7) -> dict:
    """The three runs' logs (equal tokens) and what `run_arms` records of them, at `seed`; their commands."""
    from mini_repro import QUICK, run_commands

    commands = run_commands(QUICK, QUICK.overrides("tok", "train/*.npy", "valid/*.npy", seed), runs)
    _metrics(runs / "centralized", 4 * 512)
    for run in ("spes", "diloco"):
        for p in range(4):
            _metrics(runs / run / f"node{p}", 512)
    _record(runs, commands)
    return commands


def test_the_three_runs_are_reported_only_at_one_commit_seed_and_model(tmp_path: Path) -> None:
    """A doctored run.json (another seed, model, commit, or an arm that never ended) is refused by name."""
    from mini_repro import checked_runs

    commands = _three_runs(tmp_path)
    assert checked_runs(tmp_path, 7)[1]["commit"] == "a" * 40
    with pytest.raises(SystemExit, match=r"arm centralized .* ran with seed=7, not 6198 \(as this report states\)"):
        checked_runs(tmp_path, 6198)
    for doctored, match in (
        ({"seed": 8}, r"arm diloco .* ran with seed=8, not 7 \(as this report states\)"),
        ({"model.n_layers": 3}, r"arm diloco .* ran with model.n_layers=3, not 2 \(as centralized\)"),
        ({"data.validation_paths": ["other/*.npy"]}, r"data.validation_paths=\['other/\*.npy'\]"),
    ):
        _record(tmp_path, {"diloco": commands["diloco"]}, **doctored)
        with pytest.raises(SystemExit, match=match):
            checked_runs(tmp_path, 7)
    _record(tmp_path, {"diloco": commands["diloco"]}, commit="b" * 40)
    with pytest.raises(SystemExit, match="ran at different commits"):
        checked_runs(tmp_path, 7)
    (tmp_path / "spes" / "run.json").write_text(json.dumps({"commit": "a" * 40, "argv": commands["spes"][0]}))
    with pytest.raises(SystemExit, match="spes in .* did not run to the end"):
        checked_runs(tmp_path, 7)


def test_a_comparison_arm_at_another_seed_is_refused(tmp_path: Path) -> None:
    from mini_repro import QUICK, arm_commands, overlap_variants

    variants = overlap_variants([1], [1.0], [1], QUICK.sync_steps)
    for run in ("spes", "spes_overlap_d1"):
        for p in range(4):
            _metrics(tmp_path / run / f"node{p}", 512)
    commands = arm_commands("spes", QUICK, QUICK.overrides("tok", "t/*.npy", "v/*.npy", 6198), tmp_path, variants)
    _record(tmp_path, commands)
    _record(tmp_path, {"spes_overlap_d1": commands["spes_overlap_d1"]}, seed=7)
    with pytest.raises(SystemExit, match="arm spes_overlap_d1 .* ran with seed=7, not 6198"):
        _compare(tmp_path, "spes", variants, "vs_blocking", record=False)


def test_memory_arms_may_differ_only_in_their_expert_count(tmp_path: Path) -> None:
    """mini_repro_memory: each arm at its size's expert count and its seed; anything else equal across arms."""
    from mini_repro_memory import ARMS, QUICK, arm_commands

    sizes = {"small": 8, "large": 16}
    commands = {}
    for seed in (6198, 7):
        common = QUICK.overrides("tok", "train/*.npy", "valid/*.npy", seed)
        arms = arm_commands(QUICK, common, sizes, tmp_path / f"seed{seed}")
        commands.update({f"seed{seed}/{name}": command for name, command in arms.items()})
    _record(tmp_path, commands)
    from mini_repro import check_arms_alike

    expect = {f"seed{s}/{a.name}": {"seed": s, "model.moe_num_experts": sizes[a.size]} for s in (6198, 7) for a in ARMS}
    vary = ("seed", "data.seed", "model.moe_num_experts")
    assert check_arms_alike(tmp_path, expect, vary) == "a" * 40
    _record(tmp_path, {"seed7/spes_large": commands["seed7/diloco_small"]})  # the small model, recorded as the large
    with pytest.raises(SystemExit, match="seed7/spes_large .* model.moe_num_experts=8, not 16"):
        check_arms_alike(tmp_path, expect, vary)


def test_run_arms_resumes_reruns_what_changed_and_keeps_foreign_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An arm complete at this clean commit with the same command is kept; an interrupted one, one with another
    command (another seed) or at a dirty tree starts over in a fresh folder; a folder the script did not write is
    refused before anything runs (re-running used to fail in spes.launch after re-training the centralized run)."""
    import mini_repro
    from mini_repro import QUICK, run_arms, run_commands

    ran: list[str] = []

    def fake_run_all(todo: dict, runs: Path, lanes: int, done) -> dict:
        for arm in todo:
            assert not (runs / arm / "leftover").exists()
            if arm == "diloco" and "interrupt" in ran:
                raise KeyboardInterrupt
            ran.append(arm)
            done(arm, 1.0)
        return {}

    monkeypatch.setattr(mini_repro, "run_all", fake_run_all)
    monkeypatch.setattr(mini_repro, "git_commit", lambda: "c" * 40)
    commands = run_commands(QUICK, QUICK.overrides("tok", "t/*.npy", "v/*.npy", 7), tmp_path)
    assert run_arms(commands, tmp_path) == ["centralized", "spes", "diloco"]
    assert run_arms(commands, tmp_path) == []
    (tmp_path / "diloco" / "leftover").write_text("")
    ran.append("interrupt")
    with pytest.raises(KeyboardInterrupt):
        run_arms(run_commands(QUICK, QUICK.overrides("tok", "t/*.npy", "v/*.npy", 8), tmp_path), tmp_path)
    assert not json.loads((tmp_path / "diloco" / "run.json").read_text()).get("complete")
    ran.clear()
    assert run_arms(run_commands(QUICK, QUICK.overrides("tok", "t/*.npy", "v/*.npy", 8), tmp_path), tmp_path) == [
        "diloco"
    ]
    monkeypatch.setattr(mini_repro, "git_commit", lambda: "c" * 40 + "-dirty-0123")
    assert run_arms(commands, tmp_path) == ["centralized", "spes", "diloco"]
    shutil.rmtree(tmp_path / "spes")
    (tmp_path / "spes").mkdir()
    (tmp_path / "spes" / "mine.txt").write_text("")
    ran.clear()
    with pytest.raises(SystemExit, match=r"spes holds a run this script did not record .* Nothing was run"):
        run_arms(commands, tmp_path)
    assert ran == [] and (tmp_path / "spes" / "mine.txt").exists()


def test_the_setup_table_states_the_config_of_the_runs_or_its_drift(tmp_path: Path) -> None:
    """The setup's facts come from the config; for a record whose parameter counts the config no longer gives (the
    config changed since the runs) the table says so instead of silently describing today's config."""
    from mini_repro import FULL, config_facts, param_counts

    params = param_counts(FULL.overrides("tok", "t/*.npy", "v/*.npy", 6198))
    facts = config_facts(FULL, params)
    assert (facts["experts"], facts["top_k"], facts["vocab"], facts["codec"], facts["drift"]) == (
        8,
        2,
        4096,
        "fp32",
        None,
    )
    drift = config_facts(FULL, {**params, "total": params["total"] + 1})["drift"]
    assert f"the runs recorded {params['total'] + 1:,}: it changed since they ran" in drift
