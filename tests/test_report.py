"""bench/report.py: every figure of README.md and docs/ is the one its committed record gives, and every record says
what produced it (issue 30).

The documents are re-rendered from bench/results/ and must equal what is committed; outside the renderer's marks a
document states no measured figure; a record lacks none of its command, commit and machine (bar the older ones
listed in `records.KNOWN_GAPS`, a list that may only shrink); a figure whose record is not there yet says "not
measured yet" with the command that measures it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from common import git_commit  # noqa: E402
from records import CLEAN_COMMIT, DIRTY_COMMIT, KNOWN_GAPS, Records, provenance_gap  # noqa: E402
from report import RenderError, published, render_all, render_text, stray_figures  # noqa: E402
from tables import WHOLE_FILES  # noqa: E402

RESULTS = REPO / "bench" / "results"


def test_every_published_document_is_as_its_records_render_it() -> None:
    stale = [str(p.relative_to(REPO)) for p, text in render_all(Records(RESULTS)).items() if p.read_text() != text]
    assert not stale, f"{stale} differ from what the records give: run python bench/report.py (--check shows how)"


def test_prose_states_no_figure_the_renderer_does_not_fill() -> None:
    stray = {
        str(path.relative_to(REPO)): found
        for path in published(REPO)
        if str(path.relative_to(REPO)) not in WHOLE_FILES and (found := stray_figures(path.read_text()))
    }
    assert not stray, (
        f"figures typed by hand (put each in a <!--f:...--> mark, or write a setting in backticks): {stray}"
    )


def test_every_record_names_its_command_commit_and_machine() -> None:
    records = Records(RESULTS)
    gaps = {name: gap for name in records.names() if (gap := provenance_gap(records(name)))}
    new = {name: gap for name, gap in gaps.items() if name not in KNOWN_GAPS}
    assert not new, (
        f"records without their provenance (command, commit of a clean tree or with its diff's hash, machine): {new}"
    )
    fixed = sorted(set(KNOWN_GAPS) - set(gaps))
    assert not fixed, f"{fixed} no longer lack provenance: remove them from records.KNOWN_GAPS"
    assert gaps == KNOWN_GAPS


RUN = {"command": "python bench/x.py", "commit": "a" * 40, "machine": {"cpus": 2}}


@pytest.mark.parametrize(
    ("record", "gap"),
    [
        ({"command": "python bench/x.py", "commit": "a" * 40, "machine": {"cpus": 2}}, None),
        ({"command": "python bench/x.py", "commit": "a" * 40 + "-dirty-" + "b" * 16, "machine": {"cpus": 2}}, None),
        (
            {"command": "python bench/x.py", "commit": "a" * 40 + "-dirty", "machine": {"cpus": 2}},
            "dirty tree, diff not kept",
        ),
        ({"commit": "a" * 40, "machine": {"cpus": 2}}, "no command"),
        ({"command": "x", "commit": "58a7846 + a change", "machine": {}}, "commit not a full hash; no machine"),
        ({"command": "x", "machine": {"cpus": 2}}, "no commit"),
        # a record of parts run apart (mutation testing): each part its own run's; one from before parts named their
        # command has none
        ({"modules": {"a": {"commit": "a" * 40, "machine": {"cpus": 2}}, "b": {**RUN}}}, None),
        (
            {"modules": {"a": {**RUN, "command": ""}, "b": {**RUN, "commit": "a" * 40 + "-dirty"}}},
            ("dirty tree, diff not kept; no command"),
        ),
        ({"modules": {"a": {**RUN, "machine": {}}, "b": {"commit": "x"}}}, "commit not a full hash; no machine"),
        ({"command": "x", "commit": "a" * 40, "modules": {"a": {"lines": 3}}}, "no machine"),  # parts, not runs
    ],
)
def test_a_record_without_its_provenance_is_named(record: dict, gap: str | None) -> None:
    assert provenance_gap(record) == gap


def test_a_benchmark_names_a_dirty_tree_by_its_diff() -> None:
    commit = git_commit()
    assert CLEAN_COMMIT.fullmatch(commit) or DIRTY_COMMIT.fullmatch(commit), commit


def test_a_benchmark_on_a_machine_without_the_repository_names_the_commit_it_was_prepared_at(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPES_COMMIT", "c" * 40)  # NOTE: bench/prepare_gpu.sh's .whl/COMMIT, exported by run_gpu.sh
    assert git_commit() == "c" * 40


def write_record(directory: Path, name: str, record: dict) -> None:
    (directory / f"{name}.json").write_text(json.dumps({"command": "c", "commit": "a" * 40, "machine": {}, **record}))


def test_figures_are_filled_from_record_paths_and_a_missing_record_says_how_to_measure_it(tmp_path: Path) -> None:
    write_record(tmp_path, "bench_x", {"bytes": 3 * 2**20, "runs": [{"ratio": 0.5}]})
    text = (
        "<!--f:bench_x/bytes|mib:.1f-->old<!--/f--> MiB, <!--f:bench_x/runs/0/ratio:.0%-->?<!--/f-->; "
        "<!--f:mini_repro_codecs_seed7/arms/spes/final_val_loss-->5<!--/f-->"
    )
    assert render_text(text, Records(tmp_path)) == (
        "<!--f:bench_x/bytes|mib:.1f-->3.0<!--/f--> MiB, <!--f:bench_x/runs/0/ratio:.0%-->50%<!--/f-->; "
        "<!--f:mini_repro_codecs_seed7/arms/spes/final_val_loss-->not measured yet "
        "(run: `.venv/bin/python bench/mini_repro.py --codecs bf16 sparse --seed 7`)<!--/f-->"
    )
    # a named figure and a block whose record is missing say the same
    assert "not measured yet (run: `the benchmark that writes bench/results/bench_sync.json`)" in render_text(
        "a <!--f:sync.raw_gb_s-->x<!--/f--> b", Records(tmp_path)
    )
    block = "<!-- bench-train:start -->\nold\n<!-- bench-train:end -->"
    assert render_text(block, Records(tmp_path)) == (
        "<!-- bench-train:start -->\nnot measured yet (run: `the benchmark that writes bench/results/bench_train.json`)"
        "\n<!-- bench-train:end -->"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a\n<!--f:no.such.figure-->1<!--/f-->", r"doc.md:2: figure 'no.such.figure'"),
        ("<!--f:bench_x/nothing-->1<!--/f-->", r"bench_x.json has no nothing"),
        ("<!-- no-such-block:start -->\n<!-- no-such-block:end -->", r"doc.md:1: no block 'no-such-block'"),
        ("x\n<!-- bench-train:start -->\nold", r"doc.md:2: '<!-- bench-train:start -->' without its pair"),
        ("<!--f:bench_x/bytes-->1", r"'<!--f:' without its pair"),
    ],
)
def test_a_broken_mark_is_refused_naming_the_file_and_line(tmp_path: Path, text: str, message: str) -> None:
    write_record(tmp_path, "bench_x", {"bytes": 1})
    with pytest.raises(RenderError, match=message):
        render_text(text, Records(tmp_path), "doc.md")


def test_figures_outside_the_marks_are_found() -> None:
    text = (
        "SPES ends 1.3% above, at 1.83x the speed, loss 5.2311 over 1,638,400 tokens in 8.5 s.\n"
        "`0.5%` in code, <!--f:a/b-->4.7%<!--/f--> marked, [link](x_1.83x.md), sync_steps 10, 1 MiB chunks, 50 ms.\n"
        "```\n9.99%\n```\n<!-- t:start -->\n| 3.14% |\n<!-- t:end -->\nlast 2.5x\n"
    )
    assert stray_figures(text) == ["1: 1.3%", "1: 1.83x", "1: 5.2311", "1: 1,638,400", "1: 8.5 s", "9: 2.5x"]


def test_the_equal_memory_record_means_every_field_over_its_seeds() -> None:
    """mini_repro_memory.json's mean curves are the mean of its seeds' curves, field by field (issue 30: they were one
    seed's values but for the validation loss)."""
    from mini_repro_memory import mean_curve

    record = json.loads((RESULTS / "mini_repro_memory.json").read_text())
    for arm, mean in record["mean_curves"].items():
        seeds = [record["curves"][seed][arm] for seed in record["curves"]]
        assert mean == mean_curve(seeds)
        for key in ("local_val_loss_mean", "sync_seconds_peer0"):
            values = [s.get(key) for s in seeds]
            if values[0] != values[1]:
                assert mean[key] != values[0] and mean[key] != values[1], (arm, key)


@pytest.mark.parametrize(
    ("finals", "verdict"),
    [((4.0, 4.1), "lower in every seed"), ((4.4, 4.4), "higher in every seed"), ((4.0, 4.4), "mixed signs")],
)
def test_an_equal_memory_effect_says_whether_its_seeds_agree_on_its_sign(
    tmp_path: Path, finals: tuple[float, float], verdict: str
) -> None:
    """A small effect of one run is stated with each seed's sign, so prose cannot call a mixed one a gain."""
    curve = {"val_loss": [5.0, 4.2], "step": [0, 400]}
    mine = [{"val_loss": [5.0, f], "step": [0, 400]} for f in finals]
    curves = {
        "7": {"diloco_large": mine[0], "diloco_small": curve},
        "6198": {"diloco_large": mine[1], "diloco_small": curve},
    }
    mean = {"diloco_large": {"val_loss": [5.0, sum(finals) / 2]}, "diloco_small": curve}
    write_record(tmp_path, "mini_repro_memory", {"curves": curves, "mean_curves": mean})
    text = render_text("<!--f:memrepro.large_diloco_vs_small-->?<!--/f-->", Records(tmp_path))
    each = ", ".join(f"{(f - 4.2) / 4.2:+.2%} (seed {s})" for f, s in zip(finals, ("7", "6198"), strict=True))
    assert text.endswith(f"{each}, {verdict}<!--/f-->"), text


def test_no_committed_record_is_a_quick_run() -> None:
    """The figures are full runs': a `--quick` record (its `mode`) under bench/results/ must not be published."""
    records = Records(RESULTS)
    quick = [name for name in records.names() if records(name).get("mode") == "quick"]
    assert not quick, f"{quick} are --quick smoke runs: re-run them in full or remove them"


DIFFERENCES = REPO / "docs" / "differences.md"
NAMED_RECORD = re.compile(r"`([\w.*-]+)\.json`")


def difference_rows() -> list[list[str]]:
    """The cells of each row of docs/differences.md's table, its header and rule left out."""
    lines = [line for line in DIFFERENCES.read_text().splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines[2:]]


def test_every_difference_says_its_measured_effect_or_that_none_measures_it() -> None:
    """A row of docs/differences.md is a change to the numerics (the rule: each has a row): one that now matches the
    reference says "same"; any other names its effect's figure, rendered from a record, or says it is not measured."""
    rows = difference_rows()
    assert rows and all(len(row) == 5 for row in rows), [row[0] for row in rows if len(row) != 5]
    silent = [
        row[0]
        for row in rows
        if not (row[1].startswith("same") or row[2].startswith("same"))
        and "<!--f:" not in row[4]
        and "not measured" not in row[4]
        and not row[4].startswith("none")
    ]
    assert not silent, (
        f"rows of docs/differences.md that neither give a rendered figure nor say 'not measured': {silent}"
    )


def test_every_record_a_difference_names_is_committed() -> None:
    """The records a row of docs/differences.md cites (`name.json`, `name*.json` for a record's seeds) exist."""
    named = {m for row in difference_rows() for m in NAMED_RECORD.findall(row[3] + row[4])}
    missing = sorted(name for name in named if not list(RESULTS.glob(f"{name}.json")))
    assert named and not missing, f"docs/differences.md cites records not under bench/results/: {missing}"
