"""Shared fixtures: a small real corpus (stdlib sources -> local BPE -> token shards), built once per session."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

from spes.tokenizer import LoadedTokenizer, train_byte_level_bpe

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Corpus:
    root: Path
    tokenizer: Path
    train: str  # glob of training shards
    valid: str  # glob of validation shards

    def overrides(self, save_folder: Path | str) -> list[str]:
        """Overrides that point configs/tiny.yaml at this corpus and `save_folder`."""
        return [
            f"--tokenizer.identifier={self.tokenizer}",
            f"--data.paths=[{self.train}]",
            f"--data.validation_paths=[{self.valid}]",
            f"--save_folder={save_folder}",
        ]


def _write_docs(path: Path, files: list[Path]) -> None:
    with open(path, "w") as f:
        for p in files:
            f.write(json.dumps({"text": p.read_text(errors="replace")}) + "\n")


def _run(*args: str) -> None:
    subprocess.run([sys.executable, *args], check=True, capture_output=True, cwd=REPO, timeout=300)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may reach a model hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> LoadedTokenizer:
    """A 512-token byte-level BPE, trained once per session (for tests that need a real tokenizer, not a corpus)."""
    from data_fixtures import tokenizer_training_texts

    return train_byte_level_bpe(
        tokenizer_training_texts(), vocab_size=512, output_dir=tmp_path_factory.getbasetemp() / "tokenizer"
    )


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    """~120 stdlib modules for training, 10 held out; a 4096-token byte-level BPE like configs/tiny.yaml expects."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    _write_docs(root / "train.jsonl", stdlib[:120])
    _write_docs(root / "valid.jsonl", stdlib[120:130])
    scripts = REPO / "data_process_scripts"
    _run(
        str(scripts / "train_tokenizer.py"),
        "--input",
        str(root / "train.jsonl"),
        "--output_dir",
        str(root / "tok"),
        "--vocab_size",
        "4096",
    )
    for split in ("train", "valid"):
        _run(
            str(scripts / "tokenize_data.py"),
            "--file_glob",
            str(root / f"{split}.jsonl"),
            "--tokenizer_name_or_path",
            str(root / "tok"),
            "--output_prefix",
            str(root / split / "part"),
            "--processes",
            "1",
        )
    return Corpus(
        root=root, tokenizer=root / "tok", train=str(root / "train" / "*.npy"), valid=str(root / "valid" / "*.npy")
    )
