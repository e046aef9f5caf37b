"""Evaluation scripts: local task data from held-out text, reference-task detection, convert + lm_eval end to end."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from conftest import Corpus, LaunchedRun, usage_error, wait_until

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "eval_scripts"
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHON": sys.executable,
}


def script(name: str) -> ModuleType:
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)


DOCS = [f"Document {d} says: " + " ".join(f"word{d}_{i}" for i in range(400)) for d in range(6)]


def test_next_text_items_are_deterministic_and_correct() -> None:
    build = script("build_local_tasks")
    settings = build.TaskSettings(num_choice_items=30, context_chars=200, continuation_chars=60)
    items = build.next_text_items(DOCS, settings)
    assert items == build.next_text_items(DOCS, settings) and len(items) == 30
    assert items != build.next_text_items(
        DOCS, build.TaskSettings(num_choice_items=30, context_chars=200, continuation_chars=60, seed=7)
    )
    for item in items:
        doc, real = DOCS[item["doc"]], item["choices"][item["label"]]
        assert item["context"] + real in doc  # the real continuation follows the context
        assert real[0].isspace() and not item["context"][-1].isspace()  # cut between words
        assert len(set(item["choices"])) == 4
        for i, choice in enumerate(item["choices"]):
            if i != item["label"]:
                assert choice not in doc  # distractors come from other documents
    assert sorted({item["label"] for item in items}) == [0, 1, 2, 3]


def test_perplexity_docs_cut_at_words() -> None:
    build = script("build_local_tasks")
    docs = build.perplexity_docs([*DOCS, "too short"], build.TaskSettings(num_ppl_docs=4, ppl_max_chars=500))
    assert len(docs) == 4 and all(DOCS[d["doc"]].startswith(d["text"]) for d in docs)
    assert all(500 <= len(d["text"]) < 520 for d in docs)


def test_build_skips_when_up_to_date_and_refuses_tiny_input(tmp_path: Path) -> None:
    build = script("build_local_tasks")
    settings = build.TaskSettings(num_choice_items=10, context_chars=200, continuation_chars=60)
    first = build.build(DOCS, tmp_path, settings, source="test")
    assert not first["skipped"] and first["next_text_items"] == 10
    assert build.build(DOCS, tmp_path, settings, source="test")["skipped"]
    assert not build.build(DOCS[:5], tmp_path, settings, source="test")["skipped"]
    with pytest.raises(ValueError, match="too small"):
        build.build(["short text"], tmp_path / "x", settings, source="test")


def test_continuations_fit_the_model_window_and_too_short_a_window_skips_the_task(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    build = script("build_local_tasks")
    settings = build.TaskSettings(num_choice_items=10, context_chars=200, continuation_chars=300, max_tokens=40)
    items = build.next_text_items(DOCS, settings, tokenizer)
    assert len(items) == 10
    lengths = [len(tokenizer.encode_batch([c])[0]) for item in items for c in item["choices"]]
    assert max(lengths) <= 40 // 4 and min(lengths) >= 1
    for item in items:  # still the real continuation, cut at a word
        assert item["context"] + item["choices"][item["label"]] in DOCS[item["doc"]]
    built = build.build(DOCS, tmp_path / "ok", settings, source="test", tokenizer=tokenizer)
    assert built["tasks"] == ["spes_next_text", "spes_heldout_ppl"] and built["skipped_tasks"] == {}
    short = build.TaskSettings(num_choice_items=10, max_tokens=build.MIN_CHOICE_WINDOW - 1)
    built = build.build(DOCS, tmp_path / "short", short, source="test", tokenizer=tokenizer)
    assert built["tasks"] == ["spes_heldout_ppl"] and built["next_text_items"] == 0
    assert "context of 15 tokens is shorter than the 16" in built["skipped_tasks"]["spes_next_text"]
    assert build.fit_tokens(" " + "x" * 500, 2, tokenizer) is None  # one word longer than the budget


def test_documents_from_shards_round_trip_the_text(tiny_corpus) -> None:  # type: ignore[no-untyped-def]
    build = script("build_local_tasks")
    docs = build.documents_from_shards([tiny_corpus.valid], str(tiny_corpus.tokenizer))
    originals = [json.loads(line)["text"] for line in (tiny_corpus.root / "valid.jsonl").read_text().splitlines()]
    assert docs == originals


def test_builder_cli_errors(tmp_path: Path) -> None:
    build = script("build_local_tasks")
    assert build.main(["--source", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert build.main(["--shards", str(tmp_path / "*.npy"), "--out", str(tmp_path / "o")]) == 2
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    assert build.main(["--text", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o")]) == 2


def test_builder_names_the_file_line_or_folder_at_fault(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A line that is not JSON, a file that is not UTF-8, a corpus without its tokenizer, and an --out holding a
    manifest.json of something else (a rebuild deletes it first): each a one-line error naming the culprit."""
    build = script("build_local_tasks")
    out = tmp_path / "out"

    def error(*argv: str) -> str:
        assert build.main([*argv, "--out", str(out)]) == 2
        return capsys.readouterr().err

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\nnot json\n')
    assert error("--text", str(bad)) == f"error: {bad}:2: expected a JSON object with a string 'text' field\n"
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"text": "caf\xe9"}\n')
    assert error("--text", str(latin1)).startswith(f"error: {latin1}: not UTF-8 text (invalid continuation byte")
    (tmp_path / "corpus" / "valid").mkdir(parents=True)
    assert error("--source", str(tmp_path / "corpus")) == (
        f"error: {tmp_path / 'corpus'} has no tokenizer/ (the tokenizer of its valid/ shards): pass --shards "
        f"{tmp_path / 'corpus' / 'valid'} --tokenizer <that tokenizer's directory> instead\n"
    )
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    out.mkdir()
    (out / "manifest.json").write_text('{"mine": 1}')
    assert error("--text", str(docs), "--num_choice_items", "5") == (
        f"error: {out / 'manifest.json'} was not written by build_local_tasks.py; choose an --out of its own for "
        "the task data\n"
    )
    assert (out / "manifest.json").read_text() == '{"mine": 1}' and sorted(out.iterdir()) == [out / "manifest.json"]


@pytest.mark.parametrize(
    ("flag", "rule"),
    [
        ("--num_choices=1", "--num_choices must be >= 2, got 1"),
        ("--context_chars=0", "--context_chars must be >= 1, got 0"),
        ("--ppl_max_chars=100", "--ppl_max_chars must be >= 200, got 100"),
        ("--max_tokens=-1", "--max_tokens must be >= 0, got -1"),
        (
            "--max_tokens=64",
            "--max_tokens needs --window_tokenizer (the model's tokenizer, e.g. its HF model directory)",
        ),
    ],
)
def test_builder_refuses_settings_that_make_no_task(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, rule: str
) -> None:
    build = script("build_local_tasks")
    argv = ["--text", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"), flag]
    assert usage_error(capsys, lambda: build.main(argv)).endswith(f": error: {rule}")


def test_summarize_lm_eval_results(tmp_path: Path) -> None:
    tools = script("eval_tools")
    run = tmp_path / "raw" / "local" / "model"
    run.mkdir(parents=True)
    (run / "results_2026.json").write_text(
        json.dumps(
            {
                "results": {
                    "spes_next_text": {"alias": "spes_next_text", "acc,none": 0.5, "acc_stderr,none": 0.1},
                    "spes_heldout_ppl": {"bits_per_byte,none": 3.25, "bits_per_byte_stderr,none": "N/A"},
                },
                "n-shot": {"spes_next_text": 0, "spes_heldout_ppl": 0},
                "n-samples": {"spes_next_text": {"original": 40, "effective": 8}},
            }
        )
    )
    (tmp_path / tools.STATUS_FILE).write_text(
        json.dumps({"sciq": {"shots": 0, "dataset": "allenai/sciq", "available": False}})
    )
    assert tools.summarize(tmp_path) == 0
    table = (tmp_path / "results.md").read_text()
    assert "| spes_next_text | 0 | acc | 0.5000 | 0.1000 | 8 |" in table
    assert "| spes_heldout_ppl | 0 | bits_per_byte | 3.2500 |  |  |" in table
    assert "Not run (data set not available locally): sciq (allenai/sciq)" in table
    assert json.loads((tmp_path / "results.json").read_text())["tasks"]["spes_next_text"]["samples"] == 8


def test_available_names_unknown_tasks_alone_and_writes_its_status_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A task lm-eval does not know is not blamed on the data sets' cache; the status file is written whole."""
    tools = script("eval_tools")
    unknown = {"shots": None, "dataset": None, "available": False, "reason": "lm-eval has no such task"}
    monkeypatch.setattr(tools, "reference_status", lambda tasks: {"nosuch": unknown})
    written: list[Path] = []
    monkeypatch.setattr(tools, "write_atomic", lambda path, text: written.append(path))
    assert tools.available(tmp_path / "status.json", {"nosuch": None}) == 0
    assert capsys.readouterr().err == "tasks skipped: nosuch (lm-eval has no such task)\n"
    assert written == [tmp_path / "status.json"]


@pytest.mark.parametrize(
    ("hub_off", "why"),
    [
        ("HF_HUB_OFFLINE=1 is set", "not in the local Hugging Face cache (HF_HUB_OFFLINE=1 is set)"),
        ("the Hub is unreachable", "not in the local Hugging Face cache (the Hub is unreachable)"),
        ("", "neither in the local Hugging Face cache nor downloadable"),
    ],
)
def test_available_blames_a_missing_data_set_on_what_turned_the_hub_off(
    hub_off: str, why: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reason given is the one decided before eval_full.sh set HF_HUB_OFFLINE itself, not a guess at both."""
    tools = script("eval_tools")
    missing = {"shots": 0, "dataset": "allenai/sciq", "available": False, "reason": "no data set allenai/sciq"}
    monkeypatch.setattr(tools, "reference_status", lambda tasks: {"sciq": missing})
    assert tools.available(None, {"sciq": 0}, hub_off) == 0
    assert capsys.readouterr().err == f"tasks skipped: sciq (no data set allenai/sciq); data sets are {why}\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE=1 is set"),
        ({"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}, "the Hub is unreachable"),
    ],
)
def test_hub_off_says_whether_the_user_or_the_network_turned_the_hub_off(env: dict[str, str], said: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "eval_tools.py"), "hub_off"],
        env={**ENV, **env},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert (done.returncode, done.stdout) == (0, said + "\n"), done.stderr[-2000:]


@pytest.mark.timeout(120)
def test_reference_dataset_detection_is_offline(tmp_path: Path) -> None:
    """A local data set counts as available; a hub data set that is not cached does not (and nothing is fetched)."""
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "test.jsonl").write_text('{"a": 1}\n')
    code = (
        "import eval_tools as t; "
        f"print(t.dataset_is_local({str(tmp_path / 'local')!r}, None), t.dataset_is_local('allenai/sciq', None))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=SCRIPTS, env=ENV, capture_output=True, text=True, timeout=100
    )
    assert done.stdout.split() == ["True", "False"], done.stderr[-2000:]
    assert "Retrying" not in done.stderr


def test_shell_scripts_refuse_bad_input(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), env=ENV, capture_output=True, text=True, timeout=60)

    assert run(str(SCRIPTS / "convert_to_hf.sh"), "only_one_arg").returncode == 2
    done = run(str(SCRIPTS / "convert_to_hf.sh"), str(tmp_path), "latest", "1B")
    assert done.returncode == 2 and "holds no checkpoint (no latest file, no step<N> directory)" in done.stderr
    done = run(str(SCRIPTS / "convert_to_hf.sh"), str(tmp_path), "7", "1B")
    assert done.returncode == 2 and "holds no checkpoint" in done.stderr
    done = run(str(SCRIPTS / "eval_full.sh"), str(tmp_path))
    assert done.returncode == 2 and "not a Hugging Face model directory" in done.stderr
    done = subprocess.run(
        [str(SCRIPTS / "eval_full.sh"), "org/not-cached"],
        env={**ENV, "HF_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        done.returncode == 2
        and "error: model 'org/not-cached' is not a local path and not in the Hugging Face cache" in done.stderr
        and "Traceback" not in done.stderr
    )


def run_script(name: str, *args: str, env: dict[str, str] = ENV, cwd: Path | None = None) -> tuple[int, str]:
    """Run one of the shell scripts; its exit status and stderr."""
    done = subprocess.run([str(SCRIPTS / name), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stderr


def test_convert_names_the_folder_a_user_passed_instead_of_a_save_folder(tmp_path: Path) -> None:
    """A launch's output folder, the server's state, a checkpoint itself, a missing path: each is named for what it
    is, with the folder to pass instead (before: 'is it a spes run?' for all of them)."""
    run = tmp_path / "my run"
    for node in ("node0", "node1"):
        (run / node / "step20").mkdir(parents=True)
        (run / node / "latest").write_text("step20")
    (run / "node0" / "step20" / "meta.json").write_text("{}")
    (run / "server_state").mkdir()
    (run / "server_state" / "state.json").write_text("{}")
    expected = {
        run: f"holds the save folders of the nodes, not a checkpoint: pass one of them, e.g. {run / 'node0'}",
        run / "server_state": f"is the parameter server's state, which holds no checkpoint: pass a node's save "
        f"folder, e.g. {run / 'node0'}",
        run / "node0" / "step20": f"is a checkpoint, not a save folder: pass the save folder it is in, {run / 'node0'} "
        "with step 20",
        Path("nope"): f"does not exist (relative to {tmp_path}; expected a spes save_folder, e.g. "
        "output/<run_name>/node0)",
    }
    for run_dir, why in expected.items():
        code, err = run_script("convert_to_hf.sh", str(run_dir), "latest", "1B", cwd=tmp_path)
        assert (code, err) == (2, f"error: run directory {run_dir} {why}\n")
    (run / "node1" / "latest").unlink()
    code, err = run_script("convert_to_hf.sh", str(run / "node1"), "latest", "1B")
    assert (code, err) == (
        2,
        f"error: {run / 'node1'} has no 'latest' file naming the latest checkpoint; available: step20\n",
    )
    code, err = run_script("convert_to_hf.sh", str(run / "node1"), "step21", "1B")  # a name such a line lists
    assert (code, err) == (2, f"error: checkpoint {run / 'node1' / 'step21'} does not exist; available: step20\n")
    code, err = run_script("convert_to_hf.sh", "--overwrite", str(run / "node0"), "latest", "1B")
    assert code == 2 and "flags go after <RUN_DIR> <SAVE_STEP|latest> <MODEL_SIZE> (got --overwrite" in err


def fake_hf_dir(path: Path, tokenizer: Path | None = None) -> Path:
    """A folder eval_full.sh takes for a model (config.json, the tokenizer's files): enough for what it checks
    before lm_eval runs."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    if tokenizer is not None:
        for f in tokenizer.iterdir():
            (path / f.name).write_bytes(f.read_bytes())
    return path


def test_eval_full_refuses_what_would_lose_results_or_cannot_run(tmp_path: Path) -> None:
    """Results inside the model folder (a re-export replaces it whole), earlier results (unless OVERWRITE=1), a
    folder of other files, a model without a tokenizer, a ',' in the path, and flags: refused before anything is
    written, with the culprit named."""
    model = fake_hf_dir(tmp_path / "hf" / "tiny-step20")
    code, err = run_script("eval_full.sh", str(model))
    assert (code, err) == (
        2,
        f"error: {model} has no tokenizer (tokenizer.json); export it again with eval_scripts/convert_to_hf.sh ... "
        "--overwrite --tokenizer <the run's tokenizer>\n",
    )
    (model / "tokenizer.json").write_text("{}")
    code, err = run_script("eval_full.sh", str(model), env={**ENV, "OUT_DIR": str(model / "eval")})
    assert code == 2 and err.startswith(f"error: OUT_DIR {model / 'eval'} is inside the model folder {model}")
    assert f"choose a folder beside it, e.g. {model}-eval" in err
    beside = Path(f"{model}-eval")
    (beside / "raw").mkdir(parents=True)
    (beside / "results.json").write_text("{}")
    code, err = run_script("eval_full.sh", str(model))  # the default folder: beside the model
    assert code == 2 and err.startswith(f"error: {beside} holds the results of an earlier evaluation; set OVERWRITE=1")
    code, err = run_script("eval_full.sh", str(model), env={**ENV, "OUT_DIR": str(tmp_path / "hf")})
    assert code == 2 and "is not an empty folder and holds no eval_full.sh results" in err
    comma = fake_hf_dir(tmp_path / "a,b", tokenizer=model)
    code, err = run_script("eval_full.sh", str(comma))
    assert code == 2 and "has a ',' in its path, which lm_eval's --model_args cannot carry" in err
    for flags in (["--limit"], ["--limit", "5"]):  # the second was three arguments: only the usage line
        code, err = run_script("eval_full.sh", str(model), *flags)
        assert code == 2 and "takes no flags (got --limit): its settings are environment variables" in err
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["tiny-step20", "tiny-step20-eval"]
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "tokenizer.json"]


STAND_IN_LM_EVAL = """import json, os, sys, time
from pathlib import Path
args = sys.argv[1:]
if os.environ.get("STAND_IN_HANG"):
    Path(os.environ["STAND_IN_HANG"]).write_text("started")
    time.sleep(300)
out = Path(args[args.index("--output_path") + 1]) / "model"
out.mkdir(parents=True)
results = {t: {"acc,none": float(os.environ["STAND_IN_ACC"])} for t in args[args.index("--tasks") + 1].split(",")}
(out / "results_1.json").write_text(json.dumps({"results": results}))
"""


def stand_in_evaluation(tiny_corpus: Corpus, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A model folder and the environment that evaluates it on the local suite alone with the stand-in lm_eval
    (STAND_IN_LM_EVAL: the accuracy it reports is the environment's STAND_IN_ACC)."""
    stand_in = tmp_path / "stand_in"
    (stand_in / "lm_eval").mkdir(parents=True)
    (stand_in / "lm_eval" / "__init__.py").write_text("")
    (stand_in / "lm_eval" / "__main__.py").write_text(STAND_IN_LM_EVAL)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "valid").symlink_to(Path(tiny_corpus.valid).parent)
    (corpus / "tokenizer").symlink_to(tiny_corpus.tokenizer)
    model = fake_hf_dir(tmp_path / "hf" / "tiny-step20", tokenizer=tiny_corpus.tokenizer)
    env = {
        **ENV,
        "PYTHONPATH": str(stand_in),
        "EVAL_SOURCE": str(corpus),
        "EVAL_DATA": str(tmp_path / "tasks"),
        "BUILD_ARGS": "--num_choice_items 5 --num_ppl_docs 2",
        "REFERENCE": "0",
        "NPROC": "1",
    }
    return model, env


def test_eval_full_prints_the_lm_eval_command_it_runs_and_how_long_each_run_took(
    tiny_corpus: Corpus, tmp_path: Path
) -> None:
    """Its first line said "lm_eval: -m lm_eval" (the command less its Python), and nothing said how long an
    evaluation took (the quickstart's model takes minutes on a CPU)."""
    model, env = stand_in_evaluation(tiny_corpus, tmp_path)
    done = subprocess.run(
        [str(SCRIPTS / "eval_full.sh"), str(model)],
        env={**env, "STAND_IN_ACC": "0.25"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = os.path.realpath(f"{model}-eval")
    lines = done.stdout.splitlines()
    assert lines[0] == f"results: {out}; lm_eval: {sys.executable} -m lm_eval"
    assert any(re.fullmatch(r"== lm_eval: spes_next_text,spes_heldout_ppl took \d+ s", line) for line in lines), lines
    assert re.fullmatch(
        rf"results: {re.escape(out)}/results\.md {re.escape(out)}/results\.json \(\d+ s in all\)", lines[-1]
    )


def test_eval_full_writes_beside_the_model_and_replaces_results_only_when_asked_and_finished(
    tiny_corpus: Corpus, tmp_path: Path
) -> None:
    """Results go to <MODEL_PATH>-eval, not inside the model folder (which `spes.hf export --overwrite` replaces
    whole); a second run into them is refused, OVERWRITE=1 replaces them, a run into a folder another run is
    writing is refused, and an interrupted run (killed in lm_eval) leaves the earlier results as they were.
    lm_eval is a stand-in here (the real one runs in the slow tests)."""
    model, env = stand_in_evaluation(tiny_corpus, tmp_path)

    def accuracy() -> float:
        return json.loads((tmp_path / "hf" / "tiny-step20-eval" / "results.json").read_text())["tasks"][
            "spes_next_text"
        ]["metrics"]["acc"]["value"]

    code, err = run_script("eval_full.sh", str(model), env={**env, "STAND_IN_ACC": "0.25"})
    assert code == 0, err
    assert accuracy() == 0.25 and not (model / "eval").exists()
    code, err = run_script("eval_full.sh", str(model), env={**env, "STAND_IN_ACC": "0.5"})
    assert code == 2 and "holds the results of an earlier evaluation; set OVERWRITE=1" in err and accuracy() == 0.25
    started = tmp_path / "started"
    interrupted = subprocess.Popen(
        [str(SCRIPTS / "eval_full.sh"), str(model)],
        env={**env, "STAND_IN_ACC": "0.5", "OVERWRITE": "1", "STAND_IN_HANG": str(started)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_until(started.exists, "the stand-in lm_eval to start", timeout_s=90)
        code, err = run_script("eval_full.sh", str(model), env={**env, "STAND_IN_ACC": "0.75", "OVERWRITE": "1"})
        assert code == 2 and f"another eval_full.sh is evaluating into {model}-eval (it holds" in err, err
    finally:
        os.killpg(interrupted.pid, signal.SIGKILL)
        interrupted.wait(timeout=30)
    assert accuracy() == 0.25  # the earlier results, whole
    assert run_script("eval_full.sh", str(model), env={**env, "STAND_IN_ACC": "0.5", "OVERWRITE": "1"})[0] == 0
    assert accuracy() == 0.5
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["tiny-step20", "tiny-step20-eval"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quickstart_model_converts_loads_generates_and_evaluates(
    quickstart_run: LaunchedRun, tiny_corpus: Corpus, tmp_path: Path
) -> None:
    """The newcomer chain on the quickstart's own output (conftest.quickstart_run: spes.launch configs/tiny.yaml,
    server + 4 peers, as run_scripts/quickstart.sh, shorter) -> convert_to_hf.sh -> from_pretrained + generate ->
    eval_full.sh at the model's 64-token window, given the model's Hub id and finding it in a local Hub cache (local
    suite, reference tasks detected as absent)."""
    import transformers

    run = quickstart_run.out
    done = subprocess.run(
        [str(SCRIPTS / "convert_to_hf.sh"), str(run / "node0"), "latest", "tiny"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    hf_dir = run / "node0" / "hf" / "tiny-step20"
    assert done.stdout.strip() == str(hf_dir)

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    prompt = tok("def main(", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert generated.shape[1] > prompt["input_ids"].shape[1] and tok.decode(generated[0]).startswith("def main(")
    assert model.config.max_position_embeddings == 64

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "valid").symlink_to(Path(tiny_corpus.valid).parent)
    (corpus / "tokenizer").symlink_to(tiny_corpus.tokenizer)
    from hf_fixtures import cache_repo

    cache_repo(tmp_path / "hf_home", "spes/tiny-quickstart", hf_dir)
    env = {
        **ENV,
        "EVAL_SOURCE": str(corpus),
        "EVAL_DATA": str(tmp_path / "tasks"),
        "LIMIT": "6",
        "BUILD_ARGS": "--num_choice_items 20 --num_ppl_docs 4",
        "HF_HOME": str(tmp_path / "hf_home"),
    }
    done = subprocess.run(
        [str(SCRIPTS / "eval_full.sh"), "spes/tiny-quickstart"],
        env={**env, "OUT_DIR": str(tmp_path / "eval")},
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    assert "tasks skipped: sciq (no data set allenai/sciq)" in done.stderr and "Retrying" not in done.stderr
    assert "data sets are not in the local Hugging Face cache (HF_HUB_OFFLINE=1 is set)" in done.stderr
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    tasks = results["tasks"]
    assert tasks["spes_next_text"]["samples"] == 6 and 0.0 <= tasks["spes_next_text"]["metrics"]["acc"]["value"] <= 1
    ppl = tasks["spes_heldout_ppl"]["metrics"]
    assert ppl["bits_per_byte"]["value"] > 0 and ppl["byte_perplexity"]["value"] > 1
    assert results["reference_status"]["hellaswag"] == {
        "shots": 10,
        "dataset": "Rowan/hellaswag",
        "available": False,
        "reason": "no data set Rowan/hellaswag",
    }
    assert results["reference_status"]["mmlu"]["dataset"] == "cais/mmlu (57 configs)"
    assert "| spes_next_text | 0 | acc |" in (tmp_path / "eval" / "results.md").read_text()
    manifest = json.loads((tmp_path / "tasks" / "manifest.json").read_text())
    assert manifest["settings"]["max_tokens"] == 64


# ---------------------------------------------------------------------------------------------------------------
# The first implementation's eval_full.sh habits: <MODEL_PATH> <MODEL_NAME>, eval_output/<MODEL_NAME>, mmlu /
# cmmlu / ceval-valid, accelerate launch, and no local corpus for the reference tasks.

LM_EVAL_TASKS = Path(importlib.util.find_spec("lm_eval").origin).parent / "tasks"  # type: ignore[arg-type,union-attr]


def cache_hub_dataset(datasets_cache: Path, repo: str, config: str, splits: dict[str, list[dict]]) -> None:
    """Lay out what `datasets.load_dataset(repo, config)` reads offline: a prepared copy in the datasets cache
    (`<cache>/<org>___<name>/<config>/0.0.0/<hash>/`), built by datasets' own parquet builder from `splits`."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    source = datasets_cache / "sources" / repo / config
    source.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), source / f"{split}.parquet")
        files[split] = [str(source / f"{split}.parquet")]
    org, name = repo.split("/")
    builder = Parquet(
        cache_dir=str(datasets_cache / "staging"),
        dataset_name=name,
        config_name=config,
        data_files=files,
        hash="0" * 16,
    )
    builder.download_and_prepare()
    built = Path(builder.cache_dir)
    target = datasets_cache / f"{org}___{name}" / config / built.parent.name / built.name
    target.parent.mkdir(parents=True, exist_ok=True)
    built.rename(target)


def ceval_subjects() -> list[str]:
    """The data set configs of lm-eval's ceval-valid group (one task file per subject)."""
    import yaml

    return sorted(yaml.safe_load(p.read_text())["dataset_name"] for p in LM_EVAL_TASKS.glob("ceval/ceval-valid_*.yaml"))


def tiny_hf_model(corpus: Corpus, out: Path) -> Path:
    """configs/tiny.yaml's model, freshly initialized, as a Hugging Face directory with the corpus's tokenizer."""
    import torch

    from spes.config import load_config
    from spes.hf_convert import export_state
    from spes.model import Transformer

    cfg, _ = load_config(REPO / "configs" / "tiny.yaml", ["--using_spes=false"])
    model = Transformer.for_run(cfg)
    model.init_weights(cfg.seed)
    with torch.no_grad():
        return export_state(model.state_dict(), cfg.model, out, tokenizer=Path(corpus.tokenizer))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_eval_full_keeps_the_first_implementations_arguments_and_needs_no_local_corpus(
    tiny_corpus: Corpus, tmp_path: Path
) -> None:
    """`eval_full.sh <MODEL_PATH> <MODEL_NAME>` as the first implementation ran it: results in
    eval_output/<MODEL_NAME> (relative to where it runs), lm_eval started through `accelerate launch`, a reference
    group (ceval-valid, every subject laid out in a local datasets cache: the test is offline) run with lm-eval's
    default shots, and no data/default corpus anywhere. Before the last subject is laid out, the group counts as
    unavailable, naming that subject's data set (a group needs every one), and OLMo's own basic_arithmetic is named
    as no lm-eval task."""
    model = tiny_hf_model(tiny_corpus, tmp_path / "hf")
    rows = [
        {"id": i, "question": f"{i}+1=?", "A": str(i), "B": str(i + 1), "C": "x", "D": "y", "answer": "B",
         "explanation": ""}
        for i in range(2)
    ]  # fmt: skip
    subjects = ceval_subjects()
    for subject in subjects[:-1]:
        cache_hub_dataset(tmp_path / "datasets", "ceval/ceval-exam", subject, {"val": rows, "dev": rows})
    datasets_env = {**ENV, "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "HF_HOME": str(tmp_path / "home")}
    status_file = tmp_path / "status.json"
    done = subprocess.run(
        [sys.executable, "eval_tools.py", "available", "--tasks", "ceval-valid,basic_arithmetic", "--status",
         str(status_file)],
        cwd=SCRIPTS, env=datasets_env, capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "", done.stderr[-2000:]
    status = json.loads(status_file.read_text())
    assert status["ceval-valid"]["reason"] == f"no data set ceval/ceval-exam/{subjects[-1]}"
    assert status["basic_arithmetic"]["reason"] == "lm-eval has no such task"
    assert script("eval_tools").REFERENCE_TASKS.keys() >= {"mmlu", "cmmlu", "ceval-valid"}
    cache_hub_dataset(tmp_path / "datasets", "ceval/ceval-exam", subjects[-1], {"val": rows, "dev": rows})
    workdir = tmp_path / "work"
    workdir.mkdir()
    repo_copy = tmp_path / "repo"  # the script's own repository, without data/default
    repo_copy.mkdir()
    (repo_copy / "eval_scripts").symlink_to(SCRIPTS)
    (repo_copy / "spes").symlink_to(REPO / "spes")
    env = {
        **datasets_env,
        "LIMIT": "1",
        "ACCELERATE": "1",
        "NPROC": "1",
        "PYTHON": sys.executable,
    }
    env.pop("EVAL_SOURCE", None)
    done = subprocess.run(
        ["bash", str(repo_copy / "eval_scripts" / "eval_full.sh"), str(model), "tiny-ceval"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "note: local suite skipped: no corpus at" in done.stderr
    out = workdir / "eval_output" / "tiny-ceval"
    assert f"results: {out};" in done.stdout and "accelerate.commands.launch --num_processes 1" in done.stdout
    results = json.loads((out / "results.json").read_text())
    ceval = [task for task in results["tasks"] if task.startswith("ceval-valid")]
    assert len(ceval) >= 52 and results["reference_status"]["ceval-valid"] == {
        "shots": None,
        "dataset": "ceval/ceval-exam (52 configs)",
        "available": True,
    }
    assert all(results["tasks"][t]["shots"] == 0 for t in ceval if t != "ceval-valid")
    assert not (workdir / "tiny-ceval").exists()  # the second argument is a name, not a directory here
