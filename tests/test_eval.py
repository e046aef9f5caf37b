"""Evaluation scripts: local task data from held-out text, reference-task detection, convert + lm_eval end to end."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from conftest import Corpus, LaunchedRun

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
    assert done.returncode == 2 and "latest not found" in done.stderr
    done = run(str(SCRIPTS / "convert_to_hf.sh"), str(tmp_path), "7", "1B")
    assert done.returncode == 2 and "no step<N> directories: is it a spes run?" in done.stderr
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
    from test_hub import cache_repo

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
        [str(SCRIPTS / "eval_full.sh"), "spes/tiny-quickstart", str(tmp_path / "eval")],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    assert "reference tasks skipped" in done.stderr and "Retrying" not in done.stderr
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    tasks = results["tasks"]
    assert tasks["spes_next_text"]["samples"] == 6 and 0.0 <= tasks["spes_next_text"]["metrics"]["acc"]["value"] <= 1
    ppl = tasks["spes_heldout_ppl"]["metrics"]
    assert ppl["bits_per_byte"]["value"] > 0 and ppl["byte_perplexity"]["value"] > 1
    assert results["reference_status"]["hellaswag"] == {"shots": 10, "dataset": "Rowan/hellaswag", "available": False}
    assert "| spes_next_text | 0 | acc |" in (tmp_path / "eval" / "results.md").read_text()
    manifest = json.loads((tmp_path / "tasks" / "manifest.json").read_text())
    assert manifest["settings"]["max_tokens"] == 64
