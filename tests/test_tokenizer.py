"""Tests of spes.tokenizer and data_process_scripts/train_tokenizer.py (spes.corpus): real training, real files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from conftest import usage_error
from data_fixtures import (
    SAMPLE_TEXTS,
    tokenizer_training_texts,
    write_documents,
)
from spes import corpus
from spes.tokenizer import EOS_TOKEN, PAD_TOKEN, LoadedTokenizer, check_vocab, load_tokenizer, train_byte_level_bpe


def test_trained_tokenizer_round_trips_text_and_defines_eos_and_pad(tokenizer: LoadedTokenizer) -> None:
    assert tokenizer.vocab_size == 512
    assert tokenizer.tokenizer.id_to_token(tokenizer.eos_token_id) == EOS_TOKEN
    assert tokenizer.tokenizer.id_to_token(tokenizer.pad_token_id) == PAD_TOKEN
    encoded = tokenizer.encode_batch(SAMPLE_TEXTS)
    assert [tokenizer.decode(ids) for ids in encoded] == SAMPLE_TEXTS
    assert all(0 <= i < tokenizer.vocab_size for ids in encoded for i in ids)


def test_literal_special_token_in_text_is_not_an_eos(tokenizer: LoadedTokenizer) -> None:
    (ids,) = tokenizer.encode_batch([f"before {EOS_TOKEN} after"])
    assert tokenizer.eos_token_id not in ids


def test_load_from_directory_or_json_file_gives_same_fingerprint(tokenizer: LoadedTokenizer) -> None:
    from_file = load_tokenizer(tokenizer.path)
    from_dir = load_tokenizer(str(tokenizer.path.parent))
    expected = hashlib.sha256(tokenizer.path.read_bytes()).hexdigest()
    assert from_file.fingerprint == from_dir.fingerprint == expected
    assert (from_file.eos_token_id, from_file.pad_token_id) == (from_dir.eos_token_id, from_dir.pad_token_id)


def test_transformers_autotokenizer_loads_the_directory_offline(
    tokenizer: LoadedTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer.path.parent))
    assert hf.eos_token == EOS_TOKEN and hf.eos_token_id == tokenizer.eos_token_id
    assert hf.pad_token == PAD_TOKEN and hf.pad_token_id == tokenizer.pad_token_id
    text = SAMPLE_TEXTS[2]
    assert hf(text, add_special_tokens=False)["input_ids"] == tokenizer.encode_batch([text])[0]


def test_uncached_hub_id_offline_gives_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty Hub cache (tests/test_hub.py fills one)
    with pytest.raises(
        FileNotFoundError, match="'Qwen/Qwen2.5-0.5B' is not a local path.*HF_HUB_OFFLINE=1.*train_tokenizer.py"
    ):
        load_tokenizer("Qwen/Qwen2.5-0.5B")


def test_directory_without_tokenizer_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_config_naming_a_missing_eos_token_is_refused(tokenizer: LoadedTokenizer, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes(tokenizer.path.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="<nope>"):
        load_tokenizer(tmp_path)


def test_bare_json_without_pad_token_pads_with_eos(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "</s>": 1}, unk_token="a"))
    tok.save(str(tmp_path / "tok.json"))
    loaded = load_tokenizer(tmp_path / "tok.json")
    assert loaded.eos_token_id == 1 and loaded.pad_token_id == 1


def test_vocab_too_small_for_bytes_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        train_byte_level_bpe(["text"], vocab_size=100, output_dir=tmp_path)


@pytest.mark.parametrize(
    ("tokenizer_size", "model_size", "embedding_size", "message"),
    [(512, 500, 512, "model.vocab_size=500"), (512, 512, 500, "embedding_size=500"), (512, 512, 256, "smaller")],
)
def test_check_vocab_refuses_mismatches(
    tokenizer_size: int, model_size: int, embedding_size: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_vocab(tokenizer_size, model_size, embedding_size)


def test_check_vocab_accepts_padded_embeddings() -> None:
    check_vocab(50280, 50280, 50304)
    check_vocab(512, 512, None)


def test_train_tokenizer_script_reads_jsonl_and_plain_text(tmp_path: Path) -> None:
    write_documents(tmp_path / "docs.jsonl.gz", SAMPLE_TEXTS + [17])  # the int record is skipped
    (tmp_path / "notes.txt").write_text("\n".join(tokenizer_training_texts()), encoding="utf-8")
    out = tmp_path / "tok"
    assert (
        corpus.train_tokenizer_main(
            [
                "--input",
                str(tmp_path / "*.jsonl.gz"),
                str(tmp_path / "*.txt"),
                "--output_dir",
                str(out),
                "--vocab_size",
                "300",
            ]
        )
        == 0
    )
    loaded = load_tokenizer(out)
    assert loaded.vocab_size == 300
    assert loaded.decode(loaded.encode_batch(["plain text file"])[0]) == "plain text file"


def test_train_tokenizer_script_reports_a_glob_matching_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert corpus.train_tokenizer_main(["--input", str(tmp_path / "*.none"), "--output_dir", str(tmp_path / "t")]) == 2
    assert "*.none" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "rule"),
    [
        ("--max_mb=nan", "argument --max_mb: nan must be a finite number > 0"),
        ("--max_mb=0", "argument --max_mb: 0 must be a finite number > 0"),
        ("--min_frequency=-1", "argument --min_frequency: -1 must be an integer >= 1"),
        ("--min_frequency=1.5", "argument --min_frequency: '1.5' is not an integer"),
    ],
)
def test_train_tokenizer_script_refuses_a_number_out_of_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, rule: str
) -> None:
    argv = ["--input", str(tmp_path / "x.txt"), "--output_dir", str(tmp_path / "t"), flag]
    assert usage_error(capsys, lambda: corpus.train_tokenizer_main(argv)).endswith(f": error: {rule}")
