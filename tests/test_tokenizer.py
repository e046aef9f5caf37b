"""Tests of spes.tokenizer and data_process_scripts/train_tokenizer.py (spes.corpus): real training, real files."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

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
    with pytest.raises(FileNotFoundError, match=r"^tokenizer.identifier 'Qwen/Qwen2.5-0.5B' is not a local path"):
        load_tokenizer("Qwen/Qwen2.5-0.5B", "tokenizer.identifier")  # a node names the key that holds it


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


def test_train_tokenizer_help_names_each_flag_with_its_meaning_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")
    shown = " ".join(corpus.train_tokenizer_parser().format_help().split())
    assert "[-h] --input INPUT [INPUT ...] --output_dir OUTPUT_DIR [--vocab_size VOCAB_SIZE]" in shown
    assert (
        "[--max_mb MAX_MB] Train a byte-level BPE tokenizer on local text; writes a Hugging Face tokenizer directory. "
        "options:" in shown
    )
    for flag, meaning in {
        "--input INPUT [INPUT ...]": "input files: globs (quote them; '**' recurses); jsonl/parquet give one text per "
        "record",
        "--output_dir OUTPUT_DIR": "directory to write tokenizer.json and its configs to",
        "--vocab_size VOCAB_SIZE": "vocabulary size, EOS and pad included (default: 4096)",
        "--min_frequency MIN_FREQUENCY": "minimum count of a pair to be merged (default: 2)",
        "--text_field TEXT_FIELD": "JSON field / parquet column of the text (default: text)",
        "--max_mb MAX_MB": "train on at most this many MB of text (default: all of it)",
    }.items():
        assert f"{flag} {meaning}" in shown, flag
    assert "(default: None)" not in shown  # nothing after the required --input and --output_dir


def test_train_tokenizer_reads_the_text_field_says_what_it_trained_and_notes_a_vocabulary_cut_short(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_documents(tmp_path / "docs.jsonl", tokenizer_training_texts(), text_field="body")
    out = tmp_path / "tok"
    argv = ["--input", str(tmp_path / "docs.jsonl"), "--output_dir", str(out), "--vocab_size", "300"]
    assert corpus.train_tokenizer_main([*argv, "--text_field", "body"]) == 0
    loaded = load_tokenizer(out)
    assert capsys.readouterr().out == (
        f"trained a byte-level BPE of 300 tokens on 1 file(s); saved to {out} (eos id 0, pad id 1, fingerprint "
        f"{loaded.fingerprint[:12]})\n"
    )
    tokenizer_json = (out / "tokenizer.json").read_bytes()
    assert corpus.train_tokenizer_main([*argv, "--text_field", "body"]) == 2  # a tokenizer there: kept
    assert capsys.readouterr().err == (
        f"error: --output_dir {out} already holds a tokenizer (tokenizer.json), which the shards tokenized with it "
        "need; choose another --output_dir, or delete it first\n"
    )
    assert (out / "tokenizer.json").read_bytes() == tokenizer_json
    argv[3] = str(tmp_path / "tok2")
    assert corpus.train_tokenizer_main([*argv, "--text_field", "body", "--min_frequency", str(10**9)]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "note: fewer tokens than --vocab_size 300: the text has too few distinct pairs; set model.vocab_size=258"
    )
    argv[3] = str(tmp_path / "tok3")
    assert corpus.train_tokenizer_main([*argv[:-1], "10", "--text_field", "body"]) == 2
    assert capsys.readouterr().err.startswith("error: vocab_size=10 is too small: ")


def test_train_tokenizer_stops_once_max_mb_of_text_was_read(tmp_path: Path) -> None:
    """Exactly 1 MB in the first file: --max_mb 1 trains on it alone (the second's pairs make no merge)."""
    (tmp_path / "a.txt").write_text("ab " * 333_333 + "a")
    (tmp_path / "b.txt").write_text("zqxj " * 50)
    argv = ["--input", str(tmp_path / "*.txt"), "--output_dir", str(tmp_path / "tok"), "--vocab_size", "300"]
    assert corpus.train_tokenizer_main([*argv, "--max_mb", "1"]) == 0
    assert load_tokenizer(tmp_path / "tok").vocab_size == 260  # byte-level 256, EOS, pad, and "ab", " ab"


def test_texts_are_read_by_field_and_counted_in_utf8_bytes_up_to_the_limit(tmp_path: Path) -> None:
    jsonl = write_documents(tmp_path / "a.jsonl", ["é", "ab", "cd"], text_field="body")
    notes = tmp_path / "b.txt"
    notes.write_bytes(b"caf\xe9")  # not UTF-8: read anyway, the byte replaced
    files = [jsonl, notes]
    assert list(corpus.iter_texts(files, "body", None)) == ["é", "ab", "cd", "caf\ufffd"]
    assert list(corpus.iter_texts(files, "body", 2)) == ["é"]  # 2 bytes, 1 character
    assert list(corpus.iter_texts(files, "body", 3)) == ["é", "ab"]
    assert list(corpus.iter_texts(files, "body", 4)) == ["é", "ab"]
    assert list(corpus.iter_texts([write_documents(tmp_path / "c.parquet", ["x", None, "y"])], "text", None)) == [
        "x",
        "y",
    ]


def word_level(tmp_path: Path, vocab: list[str], *, added: Sequence[str] = (), config: object = None) -> Path:
    """A tokenizer.json of a word-level vocabulary (ids in order), special tokens `added` on top of it, and a
    tokenizer_config.json holding `config` when one is given."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token=vocab[0]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(added))
    tok.save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_trained_tokenizer_directory_is_what_transformers_reads(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "a" / "tok"  # a folder not made yet
    loaded = train_byte_level_bpe(["ab ab", "cd"], vocab_size=300, output_dir=out)
    assert capfd.readouterr() == ("", "")  # no progress bars in a tokenizing run's log
    (ids,) = loaded.encode_batch([f"ab {EOS_TOKEN} cd"])
    assert loaded.eos_token_id not in ids  # a literal end-of-text marker in a document is text
    assert sorted(p.name for p in out.iterdir()) == [
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    special = {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    assert (out / "special_tokens_map.json").read_text() == json.dumps(special, indent=2)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 10**9}
    assert (out / "tokenizer_config.json").read_text() == json.dumps(
        {**config, "clean_up_tokenization_spaces": False, **special}, indent=2
    )
    assert (out / "tokenizer.json").read_text().startswith('{\n  "version"')  # pretty, as transformers saves it
    assert (loaded.eos_token_id, loaded.pad_token_id) == (0, 1)
    assert "ab" in loaded.tokenizer.get_vocab()  # a pair seen twice is merged (min_frequency 2)
    again = train_byte_level_bpe(["ab ab", "cd"], vocab_size=300, output_dir=out, min_frequency=3)
    assert "ab" not in again.tokenizer.get_vocab()  # the same folder again, and a pair seen twice is not enough


def test_the_smallest_byte_level_vocabulary_holds_every_byte_and_two_specials(tmp_path: Path) -> None:
    assert train_byte_level_bpe(["x"], vocab_size=258, output_dir=tmp_path).vocab_size == 258
    with pytest.raises(ValueError) as err:
        train_byte_level_bpe(["x"], vocab_size=257, output_dir=tmp_path)
    assert str(err.value) == "vocab_size=257 is too small: a byte-level BPE needs at least 258 (256 bytes + EOS + pad)"


def test_text_is_encoded_without_specials_and_decoded_with_them(tmp_path: Path) -> None:
    path = word_level(tmp_path, ["a", "</s>", "b"])
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok.add_special_tokens(["</s>"])
    tok.save(str(path / "tokenizer.json"))
    loaded = load_tokenizer(path)
    assert loaded.encode_batch(["b a"]) == [[2, 0]]  # the template's </s> is the pipeline's to append, not here
    assert loaded.decode([2, 1]) == "b </s>"  # a document's end stays visible


def test_the_vocabulary_size_counts_added_special_tokens(tmp_path: Path) -> None:
    loaded = load_tokenizer(word_level(tmp_path, ["a", "b"], added=["<|endoftext|>"]))
    assert loaded.vocab_size == 3 and loaded.eos_token_id == 2 and loaded.pad_token_id == 2


def test_the_config_names_eos_and_pad_as_strings_or_added_token_objects(tmp_path: Path) -> None:
    config = {"eos_token": {"content": "<eod>", "lstrip": False}, "pad_token": "<pad>"}
    loaded = load_tokenizer(word_level(tmp_path, ["a", "</s>", "<eod>", "<pad>"], config=config))
    assert (loaded.eos_token_id, loaded.pad_token_id) == (2, 3)


def test_a_pad_token_the_vocabulary_lacks_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        load_tokenizer(word_level(tmp_path, ["a", "</s>"], config={"pad_token": "<pad>"}))
    assert str(err.value) == (
        f"tokenizer_config.json beside {tmp_path / 'tokenizer.json'} names pad token '<pad>', which is not in the "
        "vocabulary"
    )


def test_a_tokenizer_without_an_end_of_document_token_is_refused_saying_how_to_name_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        load_tokenizer(word_level(tmp_path, ["a", "b"]))
    assert str(err.value) == (
        f"tokenizer {tmp_path / 'tokenizer.json'} defines no EOS token: add one of ['<|endoftext|>', "
        "'<|end_of_text|>', '</s>', '<eos>'] or name it as 'eos_token' in a tokenizer_config.json beside it"
    )


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("tokenizer.json", "{not json", "is not a valid Hugging Face tokenizer.json: "),
        ("tokenizer_config.json", "{not json", "is not valid JSON: "),
        ("tokenizer_config.json", "[1]", "must hold a JSON object"),
    ],
)
def test_a_damaged_tokenizer_file_is_refused_naming_it(tmp_path: Path, name: str, text: str, message: str) -> None:
    word_level(tmp_path, ["a", "</s>"])
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError) as err:
        load_tokenizer(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / name} {message}"), err.value


def test_a_path_that_is_neither_local_nor_an_id_says_how_to_get_a_tokenizer() -> None:
    with pytest.raises(FileNotFoundError) as err:
        load_tokenizer("./no/such/tokenizer")
    assert str(err.value).startswith("tokenizer './no/such/tokenizer' is not a local file or directory")
    assert "python data_process_scripts/train_tokenizer.py --input" in str(err.value)


def test_an_embedding_as_large_as_the_vocabulary_is_accepted() -> None:
    check_vocab(512, 512, 512)


def test_train_tokenizer_refuses_an_input_of_no_text_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty file trained a bytes-only tokenizer, exit 0, with a note blaming too few distinct pairs."""
    empty, blank = tmp_path / "empty.jsonl", tmp_path / "blank.jsonl"
    empty.write_bytes(b"\n")
    blank.write_bytes(b"\n\n")
    out = tmp_path / "tok"
    assert corpus.train_tokenizer_main(["--input", str(empty), str(blank), "--output_dir", str(out)]) == 2
    assert capsys.readouterr().err == f"error: --input {empty} {blank} holds no text (check --text_field 'text')\n"
    assert not out.exists()


def test_training_tells_its_progress_a_line_at_each_end_off_a_terminal_and_by_the_librarys_bars_on_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training printed nothing until it was done, however long it took."""
    texts = ["ab ab", "cd", "é"]
    path = write_documents(tmp_path / "docs.jsonl", texts)
    asked: list[bool] = []

    def train(texts: object, **kwargs: object) -> LoadedTokenizer:
        asked.append(bool(kwargs["progress"]))
        return train_byte_level_bpe(texts, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(corpus, "train_byte_level_bpe", train)
    argv = ["--input", str(path), "--vocab_size", "300", "--output_dir"]
    assert corpus.train_tokenizer_main([*argv, str(tmp_path / "tok"), "--max_mb", "0.5"]) == 0
    start, end = capsys.readouterr().err.splitlines()
    size = path.stat().st_size
    assert start == f"training on 1 file(s) of {size:,} bytes, reading at most --max_mb 0.5 MB of text ..."
    assert end.startswith("trained on 3 texts of 9 bytes in ") and end.endswith(" s")
    monkeypatch.setattr(corpus, "time", SimpleNamespace(perf_counter=itertools.count(1000, 2.5).__next__))
    assert corpus.train_tokenizer_main([*argv, str(tmp_path / "whole")]) == 0  # no --max_mb: all of it
    assert capsys.readouterr().err.splitlines() == [
        f"training on 1 file(s) of {size:,} bytes ...",
        "trained on 3 texts of 9 bytes in 2.5 s",
    ]
    monkeypatch.setattr(corpus.sys.stderr, "isatty", lambda: True)
    assert corpus.train_tokenizer_main([*argv, str(tmp_path / "tok2")]) == 0
    assert asked == [False, False, True] and capsys.readouterr().err == ""
