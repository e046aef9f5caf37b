#!/usr/bin/env python
"""Benchmark the data pipeline: tokenization throughput and training-batch read throughput.

    .venv/bin/python bench/bench_data.py            # ~16 MB of text, ~1-2 minutes on 2 cores
    .venv/bin/python bench/bench_data.py --quick    # ~2 MB, seconds

Text is the default corpus's (stdlib sources + man pages, see spes/default_corpus.py), written
as JSON lines to a temp dir and tokenized with spes.corpus with 1 and 2 processes;
then BatchLoader reads batches from the shards with 0 and 2 DataLoader workers. The tokenizer
is data/default/tokenizer when built, else one trained on the benchmark text. Prints a table
and writes bench/results/bench_data.json.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from spes.atomic import write_atomic
from spes.cli import ArgumentParser
from spes.corpus import tokenize_files
from spes.data import BatchLoader, TokenSequenceDataset
from spes.default_corpus import collect_documents
from spes.tokenizer import LoadedTokenizer, load_tokenizer, train_byte_level_bpe

REPO_ROOT = Path(__file__).resolve().parents[1]

RESULTS = REPO_ROOT / "bench" / "results" / "bench_data.json"


def bench_tokenize(jsonl: Path, tokenizer: LoadedTokenizer, workdir: Path, processes: int) -> dict[str, float]:
    """One tokenize_files run: tokens/s and MB/s of input."""
    started = time.perf_counter()
    summary = tokenize_files(
        [jsonl],
        tokenizer=tokenizer,
        output_prefix=workdir / f"p{processes}" / "part",
        processes=processes,
        progress=False,
    )
    seconds = time.perf_counter() - started
    return {
        "processes": processes,
        "seconds": seconds,
        "tokens": summary.num_tokens,
        "documents": summary.num_documents,
        "tokens_per_s": summary.num_tokens / seconds,
        "input_mb_per_s": jsonl.stat().st_size / 1e6 / seconds,
    }


def bench_read(shards: list[Path], *, seq_len: int, batch_size: int, num_workers: int, steps: int) -> dict[str, float]:
    """Batches/s of a shuffled BatchLoader (after a few warm-up batches that also start workers)."""
    loader = BatchLoader(TokenSequenceDataset(shards, seq_len), batch_size=batch_size, seed=0, num_workers=num_workers)
    try:
        for _ in range(min(10, steps)):
            next(loader)
        started = time.perf_counter()
        for _ in range(steps):
            next(loader)
        seconds = time.perf_counter() - started
    finally:
        loader.close()
    return {
        "num_workers": num_workers,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "steps": steps,
        "batches_per_s": steps / seconds,
        "tokens_per_s": steps * batch_size * seq_len / seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 MB of text and fewer read steps")
    args = parser.parse_args(argv)
    text_mb, read_steps = (2, 200) if args.quick else (16, 2000)

    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        workdir = Path(tmp)
        documents = collect_documents(int(text_mb * 1e6), Path(sysconfig.get_paths()["stdlib"]))
        jsonl = workdir / "corpus.jsonl"
        with open(jsonl, "w", encoding="utf-8") as f:
            for doc in documents:
                f.write(json.dumps({"text": doc.text}) + "\n")
        input_mb = jsonl.stat().st_size / 1e6
        default = REPO_ROOT / "data" / "default" / "tokenizer"
        tokenizer = (
            load_tokenizer(default)
            if default.is_dir()
            else train_byte_level_bpe((d.text for d in documents), vocab_size=4096, output_dir=workdir / "tok")
        )

        tokenize = [bench_tokenize(jsonl, tokenizer, workdir, p) for p in (1, 2)]
        shards = sorted((workdir / "p1").glob("*.npy"))
        read = [
            bench_read(shards, seq_len=seq_len, batch_size=32, num_workers=w, steps=read_steps)
            for seq_len in (512, 2048)
            for w in (0, 2)
        ]

    print(
        f"tokenize_data on {input_mb:.1f} MB of JSON lines ({len(documents)} documents, vocab {tokenizer.vocab_size}):"
    )
    print(f"  {'processes':>9}  {'seconds':>8}  {'tokens':>11}  {'tokens/s':>11}  {'MB/s':>6}")
    for r in tokenize:
        print(
            f"  {r['processes']:>9}  {r['seconds']:8.2f}  {r['tokens']:11,d}  {r['tokens_per_s']:11,.0f}  "
            f"{r['input_mb_per_s']:6.2f}"
        )
    print("BatchLoader reads (global batch 32, shuffled):")
    print(f"  {'seq_len':>7}  {'workers':>7}  {'batches/s':>9}  {'tokens/s':>13}")
    for r in read:
        print(f"  {r['seq_len']:>7}  {r['num_workers']:>7}  {r['batches_per_s']:9.1f}  {r['tokens_per_s']:13,.0f}")

    results = {
        "mode": "quick" if args.quick else "full",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "text_mb": text_mb,
        "input_mb": input_mb,
        "documents": len(documents),
        "vocab_size": tokenizer.vocab_size,
        "tokenize": tokenize,
        "read": read,
    }
    write_atomic(RESULTS, json.dumps(results, indent=2) + "\n")
    print(f"saved {RESULTS.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
