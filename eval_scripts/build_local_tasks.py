#!/usr/bin/env python
"""Build the data of the local lm-eval task suite (eval_scripts/tasks/) from held-out documents.

Nothing is downloaded: the documents are the held-out split of a local corpus, either token shards
decoded with their tokenizer (what data_process_scripts/build_default_corpus.py writes to
data/default/{valid,tokenizer}) or plain text (.jsonl with a "text" field, or .txt files, one
document each). Written to --out:

    spes_next_text.jsonl    multiple choice: which of N continuations really follows the context?
                            One real continuation, N-1 from other held-out documents.
    spes_heldout_ppl.jsonl  held-out documents for loglikelihood_rolling (word/byte perplexity, bits per byte)
    manifest.json           inputs' fingerprint, settings and counts; written last

The output is a pure function of the documents and the settings (seeded `random.Random`), and a
rebuild with the same inputs and settings is skipped.

    python eval_scripts/build_local_tasks.py --source data/default --out data/eval_tasks
    python eval_scripts/build_local_tasks.py --text held_out.jsonl --out /tmp/tasks --num_choice_items 50
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from spes.atomic import write_atomic
from spes.shards import read_shard_info, resolve_paths
from spes.tokenizer import load_tokenizer

NEXT_TEXT_FILE, PPL_FILE, MANIFEST_FILE = "spes_next_text.jsonl", "spes_heldout_ppl.jsonl", "manifest.json"
FORMAT_VERSION = 1
_WHITESPACE = re.compile(r"\s")


@dataclass(frozen=True)
class TaskSettings:
    """Everything besides the documents that decides the items."""

    seed: int = 1234
    num_choice_items: int = 500
    num_choices: int = 4
    context_chars: int = 600
    continuation_chars: int = 150
    num_ppl_docs: int = 100
    ppl_min_chars: int = 200
    ppl_max_chars: int = 4000


# ---------------------------------------------------------------------------------------------------------------
# Items (pure)


def _snap(text: str, pos: int) -> int:
    """The first whitespace position at or after `pos` (or len(text)): cuts fall between words."""
    match = _WHITESPACE.search(text, pos)
    return match.start() if match else len(text)


def _windows(docs: Sequence[str], s: TaskSettings) -> list[tuple[int, str, str]]:
    """Non-overlapping (doc, context, continuation) windows; both parts cut at whitespace."""
    out = []
    for d, text in enumerate(docs):
        start = 0
        while True:
            cut = _snap(text, start + s.context_chars)
            end = _snap(text, cut + s.continuation_chars)
            if end >= len(text):
                break
            context, continuation = text[start:cut], text[cut:end]
            if context.strip() and continuation.strip():
                out.append((d, context, continuation))
            start = end + 1
    return out


def next_text_items(docs: Sequence[str], s: TaskSettings) -> list[dict[str, object]]:
    """Multiple-choice items: a context, its real continuation and continuations of other documents."""
    windows = _windows(docs, s)
    rng = random.Random(s.seed)
    order = list(range(len(windows)))
    rng.shuffle(order)
    items = []
    for i in order:
        if len(items) == s.num_choice_items:
            break
        doc, context, real = windows[i]
        others: list[str] = []
        for _ in range(50 * s.num_choices):  # rejection sampling: distractors come from other documents
            other_doc, _, text = windows[rng.randrange(len(windows))]
            if other_doc != doc and text != real and text not in others:
                others.append(text)
                if len(others) == s.num_choices - 1:
                    break
        if len(others) < s.num_choices - 1:
            continue
        choices = [real, *others]
        rng.shuffle(choices)
        items.append({"id": len(items), "doc": doc, "context": context, "choices": choices,
                      "label": choices.index(real)})
    return items


def perplexity_docs(docs: Sequence[str], s: TaskSettings) -> list[dict[str, object]]:
    """Held-out documents (cut at whitespace to at most ppl_max_chars) for rolling log-likelihood."""
    rng = random.Random(s.seed + 1)
    order = [d for d, text in enumerate(docs) if len(text.strip()) >= s.ppl_min_chars]
    rng.shuffle(order)
    return [{"id": i, "doc": d, "text": docs[d][:_snap(docs[d], s.ppl_max_chars)]}
            for i, d in enumerate(sorted(order[: s.num_ppl_docs]))]


# ---------------------------------------------------------------------------------------------------------------
# Documents (I/O)


def documents_from_shards(shards: Sequence[str], tokenizer: str) -> list[str]:
    """Decode token shards into documents, split at the EOS token their sidecars record."""
    paths = resolve_paths(list(shards))
    if not paths:
        raise FileNotFoundError(f"no token shards match {list(shards)}")
    tok = load_tokenizer(tokenizer)
    tokens = []
    for path in paths:
        info = read_shard_info(path)
        if info.tokenizer_fingerprint != tok.fingerprint:
            raise ValueError(f"{path} was tokenized with another tokenizer than {tok.path}; pass the corpus's own "
                             f"tokenizer with --tokenizer")
        tokens.append(np.load(path, mmap_mode="r"))
    flat = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64)
    ends = np.flatnonzero(flat == tok.eos_token_id)
    starts = np.concatenate([[0], ends[:-1] + 1]) if len(ends) else np.zeros(0, dtype=np.int64)
    return [tok.decode(flat[a:b].tolist()) for a, b in zip(starts, ends, strict=True) if b > a]


def documents_from_text(files: Sequence[str]) -> list[str]:
    """Documents of .jsonl files (a "text" field per line) and .txt files (one document per file)."""
    docs = []
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"text file {path} not found")
        if path.suffix == ".jsonl":
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if line.strip():
                    record = json.loads(line)
                    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                        raise ValueError(f"{path}:{number}: expected a JSON object with a string 'text' field")
                    docs.append(record["text"])
        else:
            docs.append(path.read_text(encoding="utf-8", errors="replace"))
    return docs


def _write_jsonl(path: Path, rows: Sequence[dict[str, object]]) -> None:
    write_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def build(docs: Sequence[str], out: Path, s: TaskSettings, *, source: str) -> dict[str, object]:
    """Write the task files and manifest to `out` (skipped when the manifest already matches)."""
    digest = hashlib.sha256()
    for text in docs:
        digest.update(hashlib.sha256(text.encode("utf-8")).digest())
    wanted = {"format_version": FORMAT_VERSION, "documents_sha256": digest.hexdigest(), "settings": asdict(s)}
    manifest_path = out / MANIFEST_FILE
    if manifest_path.is_file() and (out / NEXT_TEXT_FILE).is_file() and (out / PPL_FILE).is_file():
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        if all(manifest.get(k) == v for k, v in wanted.items()):
            return {**manifest, "skipped": True}
    items, ppl = next_text_items(docs, s), perplexity_docs(docs, s)
    if not items or not ppl:
        raise ValueError(f"{source}: {len(docs)} documents give {len(items)} multiple-choice items and {len(ppl)} "
                         f"perplexity documents; the held-out text is too small for these settings (lower "
                         f"--context_chars/--continuation_chars/--ppl_min_chars)")
    out.mkdir(parents=True, exist_ok=True)
    manifest_path.unlink(missing_ok=True)  # NOTE: the manifest marks a complete build, so it goes first and last
    _write_jsonl(out / NEXT_TEXT_FILE, items)
    _write_jsonl(out / PPL_FILE, ppl)
    manifest = {**wanted, "source": source, "documents": len(docs), "next_text_items": len(items),
                "ppl_documents": len(ppl)}
    write_atomic(manifest_path, json.dumps(manifest, indent=2) + "\n")
    return {**manifest, "skipped": False}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--source", help="a corpus directory with valid/ token shards and tokenizer/ (data/default)")
    src.add_argument("--shards", nargs="+", help="held-out token shards (files, globs, dirs or .txt lists)")
    src.add_argument("--text", nargs="+", help="held-out .jsonl ('text' field) or .txt files")
    parser.add_argument("--tokenizer", help="with --shards: the tokenizer the shards were made with")
    parser.add_argument("--out", required=True, help="output directory of the task data (e.g. data/eval_tasks)")
    defaults = asdict(TaskSettings())
    for name, value in defaults.items():
        parser.add_argument(f"--{name}", type=int, default=value, help=f"(default {value})")
    args = parser.parse_args(argv)
    settings = TaskSettings(**{name: getattr(args, name) for name in defaults})
    try:
        if args.source:
            corpus = Path(args.source)
            if not (corpus / "valid").is_dir():
                raise FileNotFoundError(f"{corpus} has no valid/ split: build the default corpus first with "
                                        f"data_process_scripts/build_default_corpus.py, or pass --shards/--text")
            docs, source = documents_from_shards([str(corpus / "valid")], str(corpus / "tokenizer")), str(corpus)
        elif args.shards:
            if not args.tokenizer:
                raise ValueError("--shards needs --tokenizer (the tokenizer the shards were made with)")
            docs, source = documents_from_shards(args.shards, args.tokenizer), " ".join(args.shards)
        else:
            docs, source = documents_from_text(args.text), " ".join(args.text)
        summary = build(docs, Path(args.out), settings, source=source)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    state = "up to date" if summary["skipped"] else "built"
    print(f"{args.out}: {state}: {summary['next_text_items']} multiple-choice items, {summary['ppl_documents']} "
          f"perplexity documents from {summary['documents']} held-out documents")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
