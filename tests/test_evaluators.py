"""In-loop downstream evaluations: the `evaluators:` entries, and a real run scoring lm-eval tasks at eval steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import tensorboard_scalars
from spes.config import TrainConfig, load_config
from spes.evaluators import DownstreamEvals, Evaluator, lm_eval_scores, parse_evaluators
from spes.schema import ConfigError
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
    with pytest.raises(ConfigError, match="'eval_interval' is not"):
        DownstreamEvals(no_interval, is_main=True, device=None, log=print)  # type: ignore[arg-type]


def test_scores_are_read_from_the_newest_lm_eval_results(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "results_1.json").write_text(
        json.dumps(
            {"results": {"piqa": {"alias": "piqa", "acc,none": 0.5, "acc_stderr,none": 0.1, "acc_norm,none": 0.25}}}
        )
    )
    assert lm_eval_scores(tmp_path) == {"eval/piqa/acc": 0.5, "eval/piqa/acc_norm": 0.25}
    assert lm_eval_scores(tmp_path / "m" / "none") == {}


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
