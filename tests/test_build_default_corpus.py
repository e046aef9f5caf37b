"""Tests of spes.default_corpus (build_default_corpus.py): roff stripping, stable splits, a 1 MB build."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from conftest import usage_error
from spes import default_corpus
from spes.data import BatchLoader, TokenSequenceDataset, iterate_eval_batches
from spes.shards import read_shard_info, resolve_paths
from spes.tokenizer import check_vocab, load_tokenizer

ROFF = r""".\" Automatically generated preamble
.de Sp
.if t .sp .5v
..
.TH DEMO 1 "2024" "demo 1.0"
.SH "NAME"
demo \- show \fBbold\fR and \fIitalic\fP text
.SH SYNOPSIS
.B demo
[\fB\-v\fR] \fIfile\fR\&...
.PP
.BI "int demo(const char *" path ");"
It costs 5\(Eu \(em or \[em] nothing; see
.BR ls (1).
'br
.IX Header "IGNORED"
Quote: \*(L"hi\*(R" \e done\s-1SMALL\s0.
"""


def test_strip_roff_keeps_prose_and_drops_markup() -> None:
    text = default_corpus.strip_roff(ROFF)
    assert text == (
        "NAME\ndemo - show bold and italic text\n\nSYNOPSIS\ndemo\n[-v] file...\n\n"
        "int demo(const char *path);\nIt costs 5 \u2014 or \u2014 nothing; see\nls(1).\n"
        'Quote: "hi" \\ doneSMALL.\n'
    )


def test_split_is_stable_and_about_two_percent() -> None:
    names = [f"man1/page{i}.1.gz" for i in range(5000)]
    splits = [default_corpus.split_of(n) for n in names]
    assert splits == [default_corpus.split_of(n) for n in names]
    assert 50 <= splits.count("valid") <= 150


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_small_build_loads_in_the_dataset_and_is_idempotent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "default"
    assert default_corpus.main(["--output_dir", str(out), "--max_mb", "1", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "train:" in printed and "valid:" in printed
    corpus = json.loads((out / "corpus.json").read_text())
    tokenizer = load_tokenizer(out / "tokenizer")
    check_vocab(tokenizer.vocab_size, corpus["vocab_size"], corpus["vocab_size"])
    assert corpus["tokenizer_fingerprint"] == tokenizer.fingerprint
    stdlib = sysconfig.get_paths()["stdlib"]
    assert (
        corpus["sources"][stdlib]["documents"] > 0 and 0.9e6 < sum(s["bytes"] for s in corpus["sources"].values()) < 2e6
    )

    for split in ("train", "valid"):
        shards = resolve_paths(str(out / split / "part_*.npy"))
        assert sum(read_shard_info(p).num_tokens for p in shards) == corpus["splits"][split]["tokens"] > 0
        assert sum(read_shard_info(p).num_documents for p in shards) == corpus["splits"][split]["documents"] > 0
    train = TokenSequenceDataset(resolve_paths(str(out / "train")), 128)
    batch = next(BatchLoader(train, batch_size=8, seed=6198))
    assert batch.shape == (8, 128) and int(batch.max()) < tokenizer.vocab_size
    valid = TokenSequenceDataset(resolve_paths(str(out / "valid")), 128)
    assert next(iterate_eval_batches(valid, 4, 1)).shape[1] == 128
    assert tokenizer.decode(train[0].tolist())  # real text comes back

    assert default_corpus.main(["--output_dir", str(out), "--max_mb", "1", "--quiet"]) == 0
    assert "already built" in capsys.readouterr().out
    assert default_corpus.main(["--output_dir", str(out)]) == 0  # flags not given: what it was built with
    # it printed the corpus's figures ("built in 23.0 s") first, as if it had just built it again
    assert capsys.readouterr().out.startswith(f"{out} is already built; pass --overwrite to rebuild\ndefault corpus in")
    # another size or vocabulary used to say "already built" too, exit 0, and keep the corpus it was not asked for
    assert default_corpus.main(["--output_dir", str(out), "--max_mb", "2", "--vocab_size", "512"]) == 2
    assert capsys.readouterr().err == (
        f"error: {out} holds a complete corpus, not the one asked for: --max_mb 2 (it was built with 1); "
        f"--vocab_size 512 (it was built with {corpus['vocab_size_asked']}); pass --overwrite to rebuild it, or "
        "choose another --output_dir\n"
    )
    assert json.loads((out / "corpus.json").read_text()) == corpus


@pytest.mark.parametrize(
    "damage", [b"\xfa\x00garbage", b"", b"[]", b'{"max_mb": 24.0}', b'{"max_mb": "x", "vocab_size": 1}']
)
def test_a_damaged_corpus_json_is_refused_in_one_line_naming_it_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: bytes
) -> None:
    """corpus.json marks a complete build; rerunning the build over a damaged one was a traceback."""
    marker = tmp_path / "corpus.json"
    marker.write_bytes(damage)
    assert default_corpus.main(["--output_dir", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {marker} is damaged (") and err.endswith(
        "); pass --overwrite to rebuild the corpus\n"
    )
    assert err.count("\n") == 1


@pytest.mark.parametrize("size", ["0", "nan", "inf"])
def test_a_size_that_is_not_a_finite_positive_number_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], size: str
) -> None:
    argv = ["--output_dir", str(tmp_path / "out"), "--max_mb", size, "--quiet"]
    rule = f"argument --max_mb: {size} must be a finite number > 0"
    assert usage_error(capsys, lambda: default_corpus.main(argv)).endswith(f": error: {rule}")
    assert not (tmp_path / "out").exists()
