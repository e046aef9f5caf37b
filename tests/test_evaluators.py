"""In-loop downstream evaluations: the `evaluators:` entries, and a real run scoring lm-eval tasks at eval steps."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import tensorboard_scalars
from dist_helpers import run_ranks
from hf_fixtures import cache_repo
from peer_nodes import CPU
from spes import evaluators
from spes.config import TrainConfig, load_config
from spes.distributed import DistInfo
from spes.evaluators import DownstreamEvals, Evaluator, evaluators_of, lm_eval_scores, parse_evaluators
from spes.model import Transformer
from spes.schema import ConfigError
from spes.tokenizer import LoadedTokenizer
from spes.train import main

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"


def test_entries_map_olmo_labels_and_leave_lm_evaluators_to_validation() -> None:
    entries = [
        {"label": "openbook_qa", "type": "downstream"},
        {"label": "c4-validation", "type": "lm"},
        {"label": "spes_local", "limit": 10},
    ]
    assert parse_evaluators(entries) == [
        Evaluator(label="openbook_qa", task="openbookqa", limit=None),
        Evaluator(label="spes_local", task="spes_local", limit=10),
    ]


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"label": "piqa", "limits": 3}, r"'evaluators\[0\].limits' is unknown"),
        ({"type": "downstream"}, r"'evaluators\[0\].label' = None must name a task"),
        ({"label": "piqa", "type": "icl"}, r"'evaluators\[0\].type' = 'icl' must be downstream or lm"),
        ({"label": "piqa", "limit": 0}, r"'evaluators\[0\].limit' = 0 must be a positive integer"),
    ],
)
def test_bad_entries_are_named(entry: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_evaluators([entry])


def test_downstream_evals_need_an_exportable_model_and_an_interval(tmp_path: Path) -> None:
    cfg, _ = load_config(TINY, [f"--save_folder={tmp_path}", "--evaluators=[{label: piqa}]", "--eval_interval=5"])
    evals = DownstreamEvals(cfg, is_main=True, device=None, log=print)  # type: ignore[arg-type]
    assert [step for step in range(1, 13) if evals.due(step)] == [5, 10]  # eval_interval's multiples only
    no_qk_norm, _ = load_config(
        TINY, ["--model.attention_layer_norm=false", "--evaluators=[{label: piqa}]", "--eval_interval=5"]
    )
    with pytest.raises(ConfigError, match="'evaluators' needs a model that exports to Hugging Face"):
        DownstreamEvals(no_qk_norm, is_main=True, device=None, log=print)  # type: ignore[arg-type]
    no_interval = TrainConfig(evaluators=[{"label": "piqa"}], eval_interval=None)
    no_interval.model.attention_layer_norm = True
    with pytest.raises(ConfigError) as refused:
        DownstreamEvals(no_interval, is_main=True, device=None, log=print)  # type: ignore[arg-type]
    assert str(refused.value) == (
        "config key 'evaluators' is set but 'eval_interval' is not: set how many steps apart the downstream tasks run"
    )


def test_only_the_local_suite_needs_validation_data_and_only_evaluators_make_steps_due(tmp_path: Path) -> None:
    def evals(*overrides: str) -> DownstreamEvals:
        cfg, _ = load_config(TINY, [f"--save_folder={tmp_path}", "--data.validation_paths=[]", *overrides])
        return DownstreamEvals(cfg, is_main=True, device=None, log=print)  # type: ignore[arg-type]

    with pytest.raises(ConfigError) as refused:
        evals("--evaluators=[{label: piqa}, {label: spes_local}]", "--eval_interval=5")
    assert str(refused.value) == "evaluator 'spes_local' builds its tasks from data.validation_paths, which is empty"
    every_step = evals("--evaluators=[{label: piqa}]", "--eval_interval=1")
    assert all(every_step.due(step) for step in range(1, 4))
    assert not any(evals("--evaluators=[{label: c4, type: lm}]", "--eval_interval=5").due(step) for step in (5, 10))


def test_scores_are_read_from_the_newest_lm_eval_results(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "results_1.json").write_text(
        json.dumps(
            {"results": {"piqa": {"alias": "piqa", "acc,none": 0.5, "acc_stderr,none": 0.1, "acc_norm,none": 0.25}}}
        )
    )
    assert lm_eval_scores(tmp_path) == {"eval/piqa/acc": 0.5, "eval/piqa/acc_norm": 0.25}
    assert lm_eval_scores(tmp_path / "m" / "none") == {}


def test_scores_are_the_numbers_of_metric_and_filter_keys_of_the_newest_file_by_time(tmp_path: Path) -> None:
    """Newest by time, not by name; the alias, the stderrs and a metric that is not a number are not scores."""
    newer, older = tmp_path / "results_1.json", tmp_path / "a" / "results_9.json"
    older.parent.mkdir()
    older.write_text(json.dumps({"results": {"piqa": {"acc,none": 0.1}}}))
    metrics = {"alias": "piqa", "acc,none": 1, "acc_stderr,none": 0.1, "note,none": "n/a"}
    newer.write_text(json.dumps({"results": {"piqa": metrics, "arc_easy": {"acc_norm,none": 0.5}}}))
    os.utime(older, (1_000, 1_000))
    scores = lm_eval_scores(tmp_path)
    assert scores == {"eval/piqa/acc": 1.0, "eval/arc_easy/acc_norm": 0.5} and type(scores["eval/piqa/acc"]) is float
    (tmp_path / "results_0.json").write_text(json.dumps({"config": {}}))  # newest, and without results
    assert lm_eval_scores(tmp_path) == {}


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            {"label": "piqa", "zz": 1, "aa": 2},
            "config key 'evaluators[1].aa' is unknown; an evaluator has ['label', 'type', 'limit']",
        ),
        ({"label": ""}, "config key 'evaluators[1].label' = '' must name a task, e.g. piqa or spes_local"),
        ({"label": "piqa", "type": "icl"}, "config key 'evaluators[1].type' = 'icl' must be downstream or lm"),
        (
            {"label": "piqa", "limit": True},
            "config key 'evaluators[1].limit' = True must be a positive integer or null",
        ),
        ({"label": "piqa", "limit": 2.5}, "config key 'evaluators[1].limit' = 2.5 must be a positive integer or null"),
    ],
)
def test_a_bad_entry_is_named_by_its_index_and_key_in_full(entry: dict, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_evaluators([{"label": "piqa", "type": "lm", "limit": 1}, entry])
    assert str(refused.value) == message


STAND_IN = r"""
import json, os, sys
from pathlib import Path

program = "lm_eval" if Path(sys.argv[0]).name == "__main__.py" else Path(sys.argv[0]).name
args = sys.argv[1:]
call = {"program": program, "args": args, "cwd": os.getcwd(), "pythonpath": os.environ["PYTHONPATH"]}
with open(os.environ["STAND_IN_CALLS"], "a") as calls:
    calls.write(json.dumps(call) + "\n")
value = lambda flag: args[args.index(flag) + 1]
if program == "eval_tools.py":
    missing, unknown = (os.environ.get(f"STAND_IN_{what}", "").split(",") for what in ("MISSING", "UNKNOWN"))
    status = {
        t: {"dataset": None, "available": False, "reason": "lm-eval has no such task"}
        if t in unknown
        else {"dataset": f"x/{t}", "available": t not in missing, "reason": f"no data set x/{t}"}
        for t in value("--tasks").split(",")
    }
    Path(value("--status")).write_text(json.dumps(status))
elif program == "build_local_tasks.py":
    tasks = os.environ.get("STAND_IN_LOCAL_TASKS", "spes_next_text,spes_heldout_ppl").split(",")
    manifest = {"tasks": [t for t in tasks if t]}
    if tasks != [""]:  # a manifest of no task, as the first ones were written, without skipped_tasks
        manifest["skipped_tasks"] = {"spes_long": "the window is too short"}
    Path(value("--out")).mkdir(parents=True, exist_ok=True)
    (Path(value("--out")) / "manifest.json").write_text(json.dumps(manifest))
else:
    results = {t: {"alias": t, "acc,none": len(t) / 100} for t in value("--tasks").split(",")}
    (Path(value("--output_path")) / "model").mkdir()
    (Path(value("--output_path")) / "model" / "results_1.json").write_text(json.dumps({"results": results}))
if (value("--tasks") if program == "lm_eval" else program) in os.environ.get("STAND_IN_FAILS", "").split(","):
    sys.exit("stand-in failed")  # after writing its results, as a run that crashes at its end
"""
"""eval_scripts' two scripts and lm-eval in one: it records each call (program, arguments, working directory,
PYTHONPATH) and answers as the real one would; the environment says which tasks lm-eval does not have
(STAND_IN_UNKNOWN) and which lack data (STAND_IN_MISSING), what
the local suite holds (STAND_IN_LOCAL_TASKS) and what fails (STAND_IN_FAILS: a script's name or lm-eval's tasks)."""


@pytest.fixture
def stand_ins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder of the stand-ins, as eval_scripts/ and ahead of lm-eval on PYTHONPATH; the test's working
    directory is `tmp_path`. lm-eval takes minutes a task: these tests hold what spes asks of it and reads back."""
    root = tmp_path / "stand_ins"
    (root / "lm_eval").mkdir(parents=True)
    for path in (root / "eval_tools.py", root / "build_local_tasks.py", root / "lm_eval" / "__main__.py"):
        path.write_text(STAND_IN)
    (root / "lm_eval" / "__init__.py").write_text("")  # a package, not a namespace one: found before lm-eval's own
    monkeypatch.setattr(evaluators, "EVAL_SCRIPTS", root)
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.setenv("STAND_IN_CALLS", str(root / "calls.jsonl"))
    monkeypatch.chdir(tmp_path)
    return root


def recorded(stand_ins: Path) -> list[dict[str, Any]]:
    """Each stand-in run so far, as it recorded itself."""
    path = stand_ins / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def calls(stand_ins: Path) -> list[tuple[str, list[str], str]]:
    """(program, arguments, working directory) of each stand-in run so far; each found spes on its PYTHONPATH."""
    found = recorded(stand_ins)
    assert all(c["pythonpath"] == os.pathsep.join([str(evaluators.REPO), str(stand_ins)]) for c in found)
    return [(c["program"], c["args"], c["cwd"]) for c in found]


def evals_config_overrides(tmp_path: Path, tokenizer: LoadedTokenizer, entries: str) -> list[str]:
    """configs/tiny.yaml's overrides for these `evaluators:`, the session's tokenizer and a save folder `run`
    relative to the working directory."""
    return [
        "--save_folder=run",
        f"--tokenizer.identifier={tokenizer.path.parent}",
        "--model.vocab_size=512",
        "--model.embedding_size=512",
        "--device_eval_batch_size=3",
        "--eval_interval=5",
        f"--data.validation_paths=[{tmp_path / 'a.npy'}, {tmp_path / 'b.npy'}]",
        f"--evaluators={entries}",
    ]


def evals_config(tmp_path: Path, tokenizer: LoadedTokenizer, entries: str) -> TrainConfig:
    """configs/tiny.yaml as `evals_config_overrides` has it."""
    return load_config(TINY, evals_config_overrides(tmp_path, tokenizer, entries))[0]


def test_tasks_without_data_are_left_out_at_start_by_label_in_one_note(
    stand_ins: Path, tokenizer: LoadedTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAND_IN_MISSING", "cb,piqa")
    entries = "[{label: piqa}, {label: commitment_bank}, {label: cb}, {label: spes_local}, {label: openbook_qa}]"
    said: list[str] = []
    evals = evaluators_of(evals_config(tmp_path, tokenizer, entries), CPU, said.append)
    assert evals is not None and evals.disabled == {"commitment_bank", "cb", "piqa"} and evals.device == CPU.device
    folder = tmp_path / "run" / "downstream"
    status = ["available", "--tasks", "cb,openbookqa,piqa", "--status", str(folder / "task_status.json")]
    assert calls(stand_ins) == [("eval_tools.py", status, str(tmp_path))]
    assert said == [
        "note: downstream evaluators left out of this run: cb (no data set x/cb), piqa (no data set x/piqa); a data "
        "set must be in the Hugging "
        "Face cache (HF_HOME) or downloadable from here (not HF_HUB_OFFLINE=1)"
    ]
    assert (folder / "task_status.log").is_file()


def test_tasks_lm_eval_does_not_have_are_refused_at_start_by_name(
    stand_ins: Path, tokenizer: LoadedTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAND_IN_UNKNOWN", "piqa_typo,zz")
    monkeypatch.setenv("STAND_IN_MISSING", "cb")
    entries = "[{label: zz}, {label: piqa}, {label: piqa_typo}, {label: commitment_bank}]"
    with pytest.raises(ConfigError) as refused:
        evaluators_of(evals_config(tmp_path, tokenizer, entries), CPU, print)
    assert str(refused.value) == (
        "config key 'evaluators' names tasks lm-eval does not have: piqa_typo, zz; check their spelling "
        "(python -m lm_eval --tasks list names them all)"
    )


def test_the_data_check_runs_on_the_main_rank_for_lm_evals_own_tasks_only(
    stand_ins: Path, tokenizer: LoadedTokenizer, tmp_path: Path
) -> None:
    other_rank = DistInfo(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"))
    assert evaluators_of(evals_config(tmp_path, tokenizer, "[{label: piqa}]"), other_rank, print) is not None
    assert evaluators_of(evals_config(tmp_path, tokenizer, "[{label: spes_local}]"), CPU, print) is not None
    assert evaluators_of(evals_config(tmp_path, tokenizer, "[{label: c4, type: lm}]"), CPU, print) is None
    assert calls(stand_ins) == []


def test_a_data_check_that_fails_is_noted_with_its_log_and_leaves_every_task_in(
    stand_ins: Path, tokenizer: LoadedTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAND_IN_FAILS", "eval_tools.py")
    said: list[str] = []
    evals = evaluators_of(evals_config(tmp_path, tokenizer, "[{label: piqa}]"), CPU, said.append)
    log = tmp_path / "run" / "downstream" / "task_status.log"
    assert evals is not None and evals.disabled == set()
    assert said == [f"note: could not check the downstream tasks' data (log: {log})"]
    assert "stand-in failed" in log.read_text()


def lm_eval_args(stand_ins: Path, step: int, label: str, tasks: str, *limit: str) -> list[str]:
    """What spes asks of lm-eval for one evaluator at `step` (the model of evals_config, exported to run/)."""
    folder = stand_ins.parent / "run" / "downstream"
    return [
        *("--model", "hf", "--model_args", f"pretrained={folder / 'hf'},dtype=float32", "--tasks", tasks),
        *("--num_fewshot", "0", "--include_path", str(stand_ins / "tasks"), "--batch_size", "3"),
        *("--output_path", str(folder / "raw" / f"step{step}" / label), "--device", "cpu", *limit),
    ]


def test_each_task_runs_in_lm_eval_on_the_exported_model_and_one_that_fails_is_left_out(
    stand_ins: Path, tokenizer: LoadedTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAND_IN_FAILS", "cb")
    cfg = evals_config(tmp_path, tokenizer, "[{label: piqa, limit: 3}, {label: spes_local}, {label: commitment_bank}]")
    said: list[str] = []
    evals = DownstreamEvals(cfg, is_main=True, device=torch.device("cpu"), log=said.append)
    model = Transformer(cfg.model)
    folder = tmp_path / "run" / "downstream"
    stale = folder / "raw" / "step7" / "piqa" / "before" / "results_1.json"  # an earlier try at this step
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"results": {"piqa": {"acc,none": 0.99}}}))
    os.utime(stale, (2**31, 2**31))  # newer than what this run writes: read, were it left there

    scores = evals.run(model, 7)
    assert scores == {"eval/piqa/acc": 0.04, "eval/spes_next_text/acc": 0.14, "eval/spes_heldout_ppl/acc": 0.16}
    assert (folder / "hf" / "config.json").is_file() and (folder / "hf" / "tokenizer.json").is_file()
    build = [
        *("--shards", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), "--tokenizer", str(tokenizer.path.parent)),
        *("--out", str(folder / "tasks"), "--max_tokens", "64", "--window_tokenizer", str(folder / "hf")),
    ]
    local = "spes_next_text,spes_heldout_ppl"
    assert calls(stand_ins) == [
        ("lm_eval", lm_eval_args(stand_ins, 7, "piqa", "piqa", "--limit", "3"), str(tmp_path)),
        ("build_local_tasks.py", build, str(tmp_path)),
        ("lm_eval", lm_eval_args(stand_ins, 7, "spes_local", local), str(folder / "tasks")),
        ("lm_eval", lm_eval_args(stand_ins, 7, "commitment_bank", "cb"), str(tmp_path)),
    ]
    failed = folder / "raw" / "step7" / "commitment_bank" / "lm_eval.log"
    assert said == [
        "note: downstream task spes_long skipped: the window is too short",
        f"note: downstream evaluator commitment_bank skipped for the rest of the run: lm_eval failed (log: {failed})",
        "step 7 downstream: piqa/acc 0.0400, spes_heldout_ppl/acc 0.1600, spes_next_text/acc 0.1400",
    ]
    assert "stand-in failed" in failed.read_text()

    assert evals.run(model, 14) == scores
    assert [(program, args[-1]) for program, args, _ in calls(stand_ins)[4:]] == [
        ("lm_eval", "3"),
        ("build_local_tasks.py", str(folder / "hf")),
        ("lm_eval", "cpu"),
    ]


def test_off_the_main_rank_a_run_exports_and_evaluates_nothing(
    stand_ins: Path, tokenizer: LoadedTokenizer, tmp_path: Path
) -> None:
    cfg = evals_config(tmp_path, tokenizer, "[{label: piqa}, {label: spes_local}]")
    evals = DownstreamEvals(cfg, is_main=False, device=torch.device("cpu"), log=print)
    assert evals.run(Transformer(cfg.model), 5) == {}
    assert calls(stand_ins) == [] and not (tmp_path / "run").exists()


def test_a_local_suite_that_cannot_be_built_is_left_out_and_one_of_no_task_runs_nothing(
    stand_ins: Path, tokenizer: LoadedTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = evals_config(tmp_path, tokenizer, "[{label: spes_local}]")
    model = Transformer(cfg.model)
    said: list[str] = []
    evals = DownstreamEvals(cfg, is_main=True, device=torch.device("cpu"), log=said.append)
    monkeypatch.setenv("STAND_IN_LOCAL_TASKS", "")
    assert evals.run(model, 5) == {} and evals.disabled == set()  # built again at the next step: nothing to disable
    assert said == ["step 5 downstream: no task ran"]
    monkeypatch.setenv("STAND_IN_FAILS", "build_local_tasks.py")
    said.clear()
    assert evals.run(model, 10) == {} and evals.run(model, 15) == {}
    log = tmp_path / "run" / "downstream" / "build_local_tasks.log"
    assert said == [
        f"note: downstream evaluator spes_local skipped for the rest of the run: its task data could not be built "
        f"(log: {log})",
        "step 10 downstream: no task ran",
        "step 15 downstream: no task ran",
    ]
    assert [program for program, _, _ in calls(stand_ins)] == ["build_local_tasks.py"] * 2
    assert "stand-in failed" in log.read_text()


def test_the_tokenizer_exported_with_the_model_is_read_from_a_path_or_the_hub_cache(
    stand_ins: Path, tokenizer: LoadedTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = evals_config(tmp_path, tokenizer, "[{label: piqa}]")
    model = Transformer(cfg.model)
    cfg.tokenizer.identifier = str(tmp_path / "none")
    with pytest.raises(FileNotFoundError) as refused:
        DownstreamEvals(cfg, is_main=True, device=torch.device("cpu"), log=print).run(model, 5)
    assert str(refused.value).startswith(f"tokenizer '{tmp_path / 'none'}' is not a local file or directory")
    cache_repo(tmp_path / "hf_home", "org/tok", tokenizer.path.parent)  # only the tokenizer's files, as spes fetches
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg.tokenizer.identifier = "org/tok"
    assert DownstreamEvals(cfg, is_main=True, device=torch.device("cpu"), log=print).run(model, 5) == {
        "eval/piqa/acc": 0.04
    }
    exported = tmp_path / "run" / "downstream" / "hf" / "tokenizer.json"
    assert exported.read_bytes() == tokenizer.path.read_bytes()


def _fsdp_worker(args: dict[str, Any], info: DistInfo) -> list[float]:
    """A model sharded over the ranks (FSDP2), evaluated: rank 0's export holds the whole embedding (its first row)."""
    from safetensors import safe_open

    from spes.distributed import apply_fsdp

    os.chdir(args["cwd"])
    evaluators.EVAL_SCRIPTS = Path(args["stand_ins"])
    cfg, _ = load_config(TINY, args["overrides"])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    first_row = model.embed.weight[0].tolist()
    apply_fsdp(model, cfg, info)
    DownstreamEvals(cfg, is_main=info.is_main, device=info.device, log=print).run(model, 5)
    if not info.is_main:
        return first_row
    with safe_open(str(Path(args["cwd"]) / "run" / "downstream" / "hf" / "model.safetensors"), "pt") as weights:
        exported = weights.get_tensor("model.embed_tokens.weight")
    assert exported.shape == (cfg.model.embedding_size, cfg.model.d_model)
    assert exported[0].tolist() == first_row
    return first_row


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_fsdp_model_is_gathered_whole_for_its_evaluation(
    stand_ins: Path, tokenizer: LoadedTokenizer, tmp_path: Path
) -> None:
    overrides = evals_config_overrides(tmp_path, tokenizer, "[{label: piqa}]")
    args = {"cwd": str(tmp_path), "stand_ins": str(stand_ins), "overrides": overrides}
    run_ranks(2, "test_evaluators:_fsdp_worker", args, tmp_path / "ranks", timeout=60)
    assert [call["program"] for call in recorded(stand_ins)] == ["lm_eval"]  # by rank 0 alone


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_training_run_scores_downstream_tasks_at_eval_steps(
    tiny_corpus,
    tmp_path: Path,  # type: ignore[no-untyped-def]
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = tmp_path / "tiny_evals.yaml"
    config.write_text(
        TINY.read_text() + "\nevaluators:\n"
        "  - {label: spes_local, type: downstream, limit: 4}\n"
        "  - {label: piqa, type: downstream, limit: 4}   # not cached, offline: left out at start\n"
    )
    args = [
        str(config),
        "--using_spes=false",
        *tiny_corpus.overrides(tmp_path / "run"),
        "--max_duration=6st",
        "--eval_interval=3",
        "--save_interval=null",
        "--log_interval=3",
        f"--tensorboard.log_dir={tmp_path / 'tb'}",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    for step in (3, 6):
        assert 0.0 <= records[step]["eval/spes_next_text/acc"] <= 1.0
        assert records[step]["eval/spes_heldout_ppl/bits_per_byte"] > 0
    assert records[3]["eval/spes_heldout_ppl/bits_per_byte"] != records[6]["eval/spes_heldout_ppl/bits_per_byte"]
    # offline, with no cached piqa: named once at start with its reason, never run (no minute-long failure later)
    assert out.count("downstream evaluators left out of this run: piqa (no data set baber/piqa)") == 1
    assert out.index("left out of this run") < out.index("step 3/6") and "lm_eval failed" not in out
    assert "step 6 downstream: spes_heldout_ppl/bits_per_byte" in out
    manifest = json.loads((tmp_path / "run" / "downstream" / "tasks" / "manifest.json").read_text())
    assert manifest["settings"]["max_tokens"] == 64  # the same local task files eval_full.sh builds, fitted

    scalars = tensorboard_scalars(tmp_path / "tb")
    assert set(scalars["eval/spes_next_text/acc"]) == {3, 6}
