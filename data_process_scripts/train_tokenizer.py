#!/usr/bin/env python
"""Train a byte-level BPE tokenizer on local text and save it as a Hugging Face tokenizer directory.

    python data_process_scripts/train_tokenizer.py --input 'corpus/*.jsonl.gz' 'notes/**/*.md' \\
        --output_dir my_tokenizer --vocab_size 4096

Inputs in tokenize_data.py's formats (.jsonl, .jsonl.gz, .jsonl.zst, .parquet) give one text per
record (`--text_field`); any other file is read whole as one UTF-8 text. The directory works with
`spes.tokenizer.load_tokenizer`, tokenize_data.py and `transformers.AutoTokenizer.from_pretrained`,
offline; EOS is `<|endoftext|>` (id 0) and pad is `<|padding|>` (id 1).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenize_data import SUPPORTED_SUFFIXES, iter_file_chunks, record_text

from spes.tokenizer import train_byte_level_bpe


def file_texts(path: Path, text_field: str) -> Iterator[str]:
    """The texts of one file: its good records, or the whole file when it is not a record format."""
    if not path.name.endswith(SUPPORTED_SUFFIXES):
        yield path.read_text(encoding="utf-8", errors="replace")
        return
    for chunk in iter_file_chunks(path, text_field, batch_size=1000):
        for _, record in chunk.records:
            text, reason = record_text(record, chunk.json_lines, text_field)
            if reason is None:
                yield text


def iter_texts(files: Sequence[Path], text_field: str, max_bytes: int | None) -> Iterator[str]:
    """Texts of `files` in order, stopping once `max_bytes` of UTF-8 text were given; bad records skipped."""
    seen = 0
    for path in files:
        for text in file_texts(path, text_field):
            if max_bytes is not None and seen >= max_bytes:
                return
            seen += len(text.encode("utf-8"))
            yield text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train a byte-level BPE tokenizer on local text; writes a Hugging Face tokenizer directory.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--input", nargs="+", required=True,
                        help="input files: globs (quote them; '**' recurses); jsonl/parquet give one text per record")
    parser.add_argument("--output_dir", required=True, help="directory to write tokenizer.json and its configs to")
    parser.add_argument("--vocab_size", type=int, default=4096, help="vocabulary size, EOS and pad included")
    parser.add_argument("--min_frequency", type=int, default=2, help="minimum count of a pair to be merged")
    parser.add_argument("--text_field", default="text", help="JSON field / parquet column of the text")
    parser.add_argument("--max_mb", type=float, default=None, help="train on at most this many MB of text")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    files: list[Path] = []
    for pattern in args.input:
        matches = sorted(Path(m) for m in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(m))
        if not matches:
            print(f"error: --input {pattern!r} matches no file", file=sys.stderr)
            return 2
        files.extend(matches)
    max_bytes = int(args.max_mb * 1e6) if args.max_mb is not None else None
    try:
        tokenizer = train_byte_level_bpe(iter_texts(files, args.text_field, max_bytes), vocab_size=args.vocab_size,
                                         output_dir=args.output_dir, min_frequency=args.min_frequency)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"trained a byte-level BPE of {tokenizer.vocab_size} tokens on {len(files)} file(s); saved to "
          f"{args.output_dir} (eos id {tokenizer.eos_token_id}, pad id {tokenizer.pad_token_id}, "
          f"fingerprint {tokenizer.fingerprint[:12]})")
    if tokenizer.vocab_size < args.vocab_size:
        print(f"note: fewer tokens than --vocab_size {args.vocab_size}: the text has too few distinct pairs; "
              f"set model.vocab_size={tokenizer.vocab_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
