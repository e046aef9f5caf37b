#!/usr/bin/env python
"""Build the data of the local lm-eval task suite (eval_scripts/tasks/) from held-out documents.

Nothing is downloaded: the documents are the held-out split of a local corpus, either token shards
decoded with their tokenizer (what data_process_scripts/build_default_corpus.py writes to
data/default/{valid,tokenizer}) or plain text (.jsonl with a "text" field, or .txt files, one
document each). Written to --out:

    spes_next_text.jsonl    multiple choice: which of N continuations really follows the context?
                            One real continuation, N-1 from other held-out documents.
    spes_heldout_ppl.jsonl  held-out documents for loglikelihood_rolling (word/byte perplexity, bits per byte)
    manifest.json           inputs' fingerprint, settings, counts and the runnable tasks; written last

With `--max_tokens N` (eval_full.sh passes the model's context length) every continuation is cut at
whitespace to fit a quarter of the window in the model's tokenizer (`--window_tokenizer`), so
lm-eval never meets a continuation longer than the model can read; a window too short for the
multiple-choice task leaves it out, with the reason in the manifest.

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
from typing import cast

import numpy as np

from spes.atomic import write_atomic
from spes.cli import ArgumentParser
from spes.shards import read_shard_info, resolve_paths
from spes.tokenizer import LoadedTokenizer, load_tokenizer

NEXT_TEXT_FILE, PPL_FILE, MANIFEST_FILE = "spes_next_text.jsonl", "spes_heldout_ppl.jsonl", "manifest.json"
FORMAT_VERSION = 2
MIN_CHOICE_WINDOW = 16
"""Tokens below which a context plus a few words of continuation cannot be told apart meaningfully."""
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
    max_tokens: int = 0
    """The model's context length in tokens (0: no limit); continuations fit a quarter of it."""

    def __post_init__(self) -> None:
        least = {"num_choice_items": 1, "num_choices": 2, "context_chars": 1, "continuation_chars": 1}
        least |= {"num_ppl_docs": 1, "ppl_min_chars": 1, "ppl_max_chars": self.ppl_min_chars, "max_tokens": 0}
        for name, low in least.items():
            if getattr(self, name) < low:
                raise ValueError(f"--{name} must be >= {low}, got {getattr(self, name)}")


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


def fit_tokens(text: str, budget: int, tokenizer: LoadedTokenizer) -> str | None:
    """`text` cut at whitespace to at most `budget` tokens, or None when not even its first word fits."""
    while text.strip():
        count = len(tokenizer.encode_batch([text])[0])
        if count <= budget:
            return text
        target = max(1, len(text) * budget // count)
        cut = max((m.start() for m in _WHITESPACE.finditer(text, 1, target + 1)), default=-1)
        if cut <= 0 or not text[:cut].strip():
            return None
        text = text[:cut]
    return None


def next_text_items(
    docs: Sequence[str], s: TaskSettings, tokenizer: LoadedTokenizer | None = None
) -> list[dict[str, object]]:
    """Multiple-choice items: a context, its real continuation and continuations of other documents.

    With `s.max_tokens`, every continuation is first cut to `max_tokens // 4` tokens of `tokenizer`.
    """
    windows = _windows(docs, s)
    if s.max_tokens:
        if tokenizer is None:
            raise ValueError("max_tokens needs the model's tokenizer (--window_tokenizer)")
        fitted = ((d, c, fit_tokens(t, s.max_tokens // 4, tokenizer)) for d, c, t in windows)
        windows = [(d, c, t) for d, c, t in fitted if t is not None]
    rng = random.Random(s.seed)
    order = list(range(len(windows)))
    rng.shuffle(order)
    items: list[dict[str, object]] = []
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
        items.append(
            {"id": len(items), "doc": doc, "context": context, "choices": choices, "label": choices.index(real)}
        )
    return items


def perplexity_docs(docs: Sequence[str], s: TaskSettings) -> list[dict[str, object]]:
    """Held-out documents (cut at whitespace to at most ppl_max_chars) for rolling log-likelihood."""
    rng = random.Random(s.seed + 1)
    order = [d for d, text in enumerate(docs) if len(text.strip()) >= s.ppl_min_chars]
    rng.shuffle(order)
    return [
        {"id": i, "doc": d, "text": docs[d][: _snap(docs[d], s.ppl_max_chars)]}
        for i, d in enumerate(sorted(order[: s.num_ppl_docs]))
    ]


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
            raise ValueError(
                f"{path} was tokenized with another tokenizer than {tok.path}; pass the corpus's own "
                f"tokenizer with --tokenizer"
            )
        tokens.append(np.load(path, mmap_mode="r"))
    flat = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64)
    ends = np.flatnonzero(flat == tok.eos_token_id)
    starts = np.concatenate([[0], ends[:-1] + 1]) if len(ends) else np.zeros(0, dtype=np.int64)
    return [tok.decode(flat[a:b].tolist()) for a, b in zip(starts, ends, strict=True) if b > a]


def _jsonl_texts(path: Path) -> list[str]:
    """The "text" field of each line of a .jsonl file; ValueError naming the file and line that is not one."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); --text reads UTF-8") from None
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"{path}:{number}: expected a JSON object with a string 'text' field")
        texts.append(record["text"])
    return texts


def documents_from_text(files: Sequence[str]) -> list[str]:
    """Documents of .jsonl files (a "text" field per line) and .txt files (one document per file)."""
    docs = []
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"text file {path} not found")
        if path.suffix == ".jsonl":
            docs += _jsonl_texts(path)
        else:
            docs.append(path.read_text(encoding="utf-8", errors="replace"))
    return docs


def _write_jsonl(path: Path, rows: Sequence[dict[str, object]]) -> None:
    write_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def _own_manifest(path: Path) -> dict[str, object] | None:
    """The manifest of an earlier build at `path` (None: no file); ValueError for a manifest.json this script did
    not write, which a rebuild would delete."""
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        manifest = None
    if not isinstance(manifest, dict) or "documents_sha256" not in manifest:
        raise ValueError(
            f"{path} was not written by build_local_tasks.py; choose an --out of its own for the task data"
        )
    return manifest


def build(
    docs: Sequence[str], out: Path, s: TaskSettings, *, source: str, tokenizer: LoadedTokenizer | None = None
) -> dict[str, object]:
    """Write the task files and manifest to `out` (skipped when the manifest already matches).

    `tokenizer` (the model's) is needed with `s.max_tokens`. The manifest's `tasks` lists what can run;
    `skipped_tasks` maps each left-out task to a one-line reason.
    """
    digest = hashlib.sha256()
    for text in docs:
        digest.update(hashlib.sha256(text.encode("utf-8")).digest())
    wanted = {
        "format_version": FORMAT_VERSION,
        "documents_sha256": digest.hexdigest(),
        "settings": asdict(s),
        "window_tokenizer": tokenizer.fingerprint if tokenizer is not None and s.max_tokens else None,
    }
    manifest_path = out / MANIFEST_FILE
    manifest = _own_manifest(manifest_path)
    if manifest and (out / NEXT_TEXT_FILE).is_file() and (out / PPL_FILE).is_file():
        if all(manifest.get(k) == v for k, v in wanted.items()):
            return {**manifest, "skipped": True}
    skipped = {}
    if s.max_tokens and s.max_tokens < MIN_CHOICE_WINDOW:
        items = []
        skipped["spes_next_text"] = (
            f"the model's context of {s.max_tokens} tokens is shorter than the "
            f"{MIN_CHOICE_WINDOW} a context and a continuation need"
        )
    else:
        items = next_text_items(docs, s, tokenizer)
    ppl = perplexity_docs(docs, s)
    if (not items and not skipped) or not ppl:
        raise ValueError(
            f"{source}: {len(docs)} documents give {len(items)} multiple-choice items and {len(ppl)} "
            f"perplexity documents; the held-out text is too small for these settings (lower "
            f"--context_chars/--continuation_chars/--ppl_min_chars)"
        )
    out.mkdir(parents=True, exist_ok=True)
    manifest_path.unlink(missing_ok=True)  # NOTE: the manifest marks a complete build, so it goes first and last
    _write_jsonl(out / NEXT_TEXT_FILE, items)
    _write_jsonl(out / PPL_FILE, ppl)
    tasks = [name for name in ("spes_next_text", "spes_heldout_ppl") if name not in skipped]
    manifest = {
        **wanted,
        "source": source,
        "documents": len(docs),
        "next_text_items": len(items),
        "ppl_documents": len(ppl),
        "tasks": tasks,
        "skipped_tasks": skipped,
    }
    write_atomic(manifest_path, json.dumps(manifest, indent=2) + "\n")
    return {**manifest, "skipped": False}


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--source", help="a corpus directory with valid/ token shards and tokenizer/ (data/default)")
    src.add_argument("--shards", nargs="+", help="held-out token shards (files, globs, dirs or .txt lists)")
    src.add_argument("--text", nargs="+", help="held-out .jsonl ('text' field) or .txt files")
    parser.add_argument("--tokenizer", help="with --shards: the tokenizer the shards were made with")
    parser.add_argument("--out", required=True, help="output directory of the task data (e.g. data/eval_tasks)")
    parser.add_argument(
        "--window_tokenizer",
        help="with --max_tokens: the model's tokenizer (an HF model directory or tokenizer directory)",
    )
    defaults = asdict(TaskSettings())
    for name, value in defaults.items():
        parser.add_argument(f"--{name}", type=int, default=value, help=f"(default {value})")
    args = parser.parse_args(argv)
    try:
        settings = TaskSettings(**{name: getattr(args, name) for name in defaults})
    except ValueError as e:
        parser.error(str(e))
    if settings.max_tokens and not args.window_tokenizer:
        parser.error("--max_tokens needs --window_tokenizer (the model's tokenizer, e.g. its HF model directory)")
    try:
        if args.source:
            corpus = Path(args.source)
            if not (corpus / "valid").is_dir():
                raise FileNotFoundError(
                    f"{corpus} has no valid/ split: build the default corpus first with "
                    f"data_process_scripts/build_default_corpus.py, or pass --shards/--text"
                )
            if not (corpus / "tokenizer").is_dir():
                raise FileNotFoundError(
                    f"{corpus} has no tokenizer/ (the tokenizer of its valid/ shards): pass "
                    f"--shards {corpus / 'valid'} --tokenizer <that tokenizer's directory> instead"
                )
            docs, source = documents_from_shards([str(corpus / "valid")], str(corpus / "tokenizer")), str(corpus)
        elif args.shards:
            if not args.tokenizer:
                raise ValueError("--shards needs --tokenizer (the tokenizer the shards were made with)")
            docs, source = documents_from_shards(args.shards, args.tokenizer), " ".join(args.shards)
        else:
            docs, source = documents_from_text(args.text), " ".join(args.text)
        window_tok = load_tokenizer(args.window_tokenizer) if args.window_tokenizer else None
        summary = build(docs, Path(args.out), settings, source=source, tokenizer=window_tok)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    state = "up to date" if summary["skipped"] else "built"
    print(
        f"{args.out}: {state}: {summary['next_text_items']} multiple-choice items, {summary['ppl_documents']} "
        f"perplexity documents from {summary['documents']} held-out documents"
    )
    for task, reason in cast(dict[str, str], summary.get("skipped_tasks") or {}).items():
        print(f"skipped {task}: {reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
