"""bench/mutation.py's command line: a module's run takes minutes to an hour, so what the flags get wrong is refused
before any module runs, and a module with nothing to run is not run. No mutant runs here: `run_module` is replaced
by a recorder."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import usage_error

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import mutation  # noqa: E402
from records import provenance_gap  # noqa: E402

MERGE, ROUNDS = "spes/sync/merge.py", "spes/sync/rounds.py"


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[str, ...]]]:
    """The modules `main` had mutated, each with the mutants it rechecked; none is run."""
    calls: list[tuple[str, tuple[str, ...]]] = []

    def run_module(module: str, tests: tuple[str, ...], timeout_s: float, recheck: tuple[str, ...] = ()) -> dict:
        calls.append((module, recheck))
        return {"score": 1.0, "mutants": 1, "score_without_equivalent": 1.0, "by_status": {"killed": 1}}

    monkeypatch.setattr(mutation, "run_module", run_module)
    return calls


def recheckable(monkeypatch: pytest.MonkeyPatch, survivors: dict[str, tuple[str, ...] | None]) -> None:
    """`rechecked` as a record with these survivors per module would answer (None: no complete record)."""

    def rechecked(previous: dict[str, Any] | None, module: str) -> tuple[str, ...]:
        found = survivors[module]
        if found is None:
            raise SystemExit(f"error: --recheck needs a complete record of {module}: run it whole first")
        return found

    monkeypatch.setattr(mutation, "rechecked", rechecked)


def test_a_recheck_of_a_module_whose_record_has_no_survivor_runs_nothing(
    runs: list, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: an empty list of mutants to recheck read as "recheck nothing in particular", so the whole module ran."""
    out = tmp_path / "mutation.json"
    out.write_text(json.dumps({"modules": {MERGE: {"commit": "abc", "complete": True, "survivors": []}}}))
    before = out.read_text()
    recheckable(monkeypatch, {MERGE: (), ROUNDS: ("spes.sync.rounds.x__mutmut_3",)})
    mutation.main([MERGE, ROUNDS, "--recheck", "--out", str(out)])
    assert runs == [(ROUNDS, ("spes.sync.rounds.x__mutmut_3",))]
    assert f"{MERGE}: nothing to recheck, its record has every mutant killed" in capsys.readouterr().out
    assert json.loads(out.read_text())["modules"][MERGE] == json.loads(before)["modules"][MERGE]


def test_a_module_that_cannot_be_rechecked_is_refused_before_any_module_runs(
    runs: list, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    recheckable(monkeypatch, {MERGE: ("spes.sync.merge.x__mutmut_1",), ROUNDS: None})
    with pytest.raises(SystemExit, match=f"needs a complete record of {ROUNDS}"):
        mutation.main([MERGE, ROUNDS, "--recheck", "--out", str(tmp_path / "mutation.json")])
    assert runs == []


@pytest.mark.parametrize("minutes", ["0", "-5", "nan"])
def test_a_timeout_of_no_minutes_is_refused(
    minutes: str, runs: list, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [MERGE, "--timeout_min", minutes, "--out", str(tmp_path / "m.json")]
    line = usage_error(capsys, lambda: mutation.main(argv))
    assert line.endswith(f"error: --timeout_min must be a number of minutes above 0, got {float(minutes):g}")
    assert runs == []


def test_a_record_that_is_not_json_is_refused_naming_it(
    runs: list, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "mutation.json"
    out.write_text('{"modules": ')
    line = usage_error(capsys, lambda: mutation.main([MERGE, "--out", str(out)]))
    assert f"error: --out {out} is not a readable JSON record (" in line and line.endswith("move that file away")
    out.write_text("[]")
    line = usage_error(capsys, lambda: mutation.main([MERGE, "--out", str(out)]))
    assert line.endswith(
        f"error: --out {out} holds no record (a JSON object): give another --out, or move that file away"
    )
    assert runs == []


def test_a_module_is_named_from_the_root_or_from_here_and_listed_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(REPO / "bench")
    mutation.main(["--list", MERGE, "../spes/sync/merge.py", str(REPO / MERGE), "./../spes/sync/rounds.py"])
    assert capsys.readouterr().out.splitlines() == [
        f"{MERGE}: {' '.join(mutation.MODULES[MERGE])}",
        f"{ROUNDS}: {' '.join(mutation.MODULES[ROUNDS])}",
    ]


def test_a_name_that_is_no_module_is_told_apart_from_a_module_without_tests(
    runs: list, capsys: pytest.CaptureFixture[str]
) -> None:
    line = usage_error(capsys, lambda: mutation.main(["spes/sync/merg.py"]))
    assert line.endswith("error: no such module: spes/sync/merg.py (name it as --list does, e.g. spes/sync/merge.py)")
    line = usage_error(capsys, lambda: mutation.main(["spes/gc_schedule.py"]))
    assert line.endswith(
        "no covering tests listed for ['spes/gc_schedule.py']: add the module to MODULES in bench/mutation.py"
    )
    assert runs == []


def test_an_equivalent_mutant_that_timed_out_is_left_out_of_the_score_without_equivalents() -> None:
    """A timeout counts as caught, and an equivalent mutant is left out of the total: one that timed out under load
    was both, scoring the other mutants above 1."""
    found = {"m.x_f__mutmut_1": "killed", "m.x_f__mutmut_2": "timeout", "m.x_f__mutmut_3": "survived"}
    survivors = [
        {"name": "m.x_f__mutmut_2", "status": "timeout", "equivalent": "no behaviour changes"},
        {"name": "m.x_f__mutmut_3", "status": "survived", "equivalent": None},
    ]
    result = mutation.summary("m.py", (), found, survivors, 1.0, True)
    assert (result["score"], result["score_without_equivalent"]) == (round(2 / 3, 4), 0.5)


def test_each_module_names_the_command_that_ran_it_and_one_from_before_keeps_its_record(
    runs: list, tmp_path: Path
) -> None:
    """The record holds many runs: each module's part names its own (the file's one `command` named the last run
    only). A part written before parts named their command keeps none: which command wrote it is not known."""
    out = tmp_path / "mutation.json"
    older = {"commit": "a" * 40, "machine": {"cpus": 2}, "complete": True, "survivors": []}
    out.write_text(
        json.dumps({"command": "python bench/mutation.py x", "commit": "b" * 40, "modules": {ROUNDS: older}})
    )
    mutation.main([MERGE, "--timeout_min", "5", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["modules"][MERGE]["command"] == (
        f"{Path(sys.executable).name} bench/mutation.py {MERGE} --timeout_min 5 --out {out}"
    )
    assert record["modules"][ROUNDS] == older
    assert sorted(record) == ["modules", "tool"] and out.read_text() == json.dumps(record, indent=1) + "\n"
    assert provenance_gap(record) is None


def test_a_mutants_location_is_the_line_it_changes_in_a_method_as_in_a_function(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """mutmut shows a method's mutant dedented out of its class: matched as it was, every method's mutant was placed
    at its def line."""
    (tmp_path / "m.py").write_text(
        "class C:\n    def f(self):\n        x = 1\n        return x\n\n\ndef g():\n    x = 1\n    return x\n"
    )
    monkeypatch.setattr(mutation, "REPO_ROOT", tmp_path)
    dedented = "--- m.py\n+++ m.py\n@@ -1 +1 @@\n def f(self):\n-    x = 1\n+    x = 2\n     return x"
    assert mutation.location("m.py", "m.xǁCǁf__mutmut_1", dedented) == "m.py:3 (f)"
    function = "--- m.py\n+++ m.py\n@@ -1 +1 @@\n def g():\n-    x = 1\n+    x = 2\n     return x"
    assert mutation.location("m.py", "m.x_g__mutmut_1", function) == "m.py:8 (g)"
