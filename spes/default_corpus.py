"""Build spes's default training corpus from text found on every machine (data_process_scripts/ runs `main`).

    python data_process_scripts/build_default_corpus.py --output_dir data/default [--max_mb 24] [--overwrite]

Documents are the Python standard library's `.py` sources and the English man pages under
/usr/share/man (roff markup stripped), one file per document, about half of the text budget
from each. Files are chosen in a fixed hash order of their names (a spread-out sample, the same
on every run) and each document goes to the validation split when a second stable hash of its
name falls in the lowest 2%. The tokenizer (byte-level BPE) is trained on the training split only,
then both splits are tokenized with `spes.corpus`:

    <output_dir>/tokenizer/                  Hugging Face tokenizer directory
    <output_dir>/train/part_NNNNN.npy(.json) training shards
    <output_dir>/valid/part_NNNNN.npy(.json) validation shards
    <output_dir>/corpus.json                 sizes per split and source; written last (marks the build complete)

A complete build is left alone unless `--overwrite` is given; a `--max_mb` or `--vocab_size` it was not built with
is refused (it would be kept, unlike what the flag asks).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spes.atomic import write_atomic
from spes.cli import ArgumentParser, DefaultsHelpFormatter
from spes.corpus import Record, TextChunk, TokenizeSummary, tokenize_chunks
from spes.schema import number_flag
from spes.tokenizer import LoadedTokenizer, train_byte_level_bpe

MAN_ROOT = Path("/usr/share/man")
VALID_PERCENT = 2
MIN_DOCUMENT_CHARS = 100
CHUNK_DOCUMENTS = 256
SPLITS = ("train", "valid")


@dataclass(frozen=True)
class Document:
    """One source file's text."""

    source: str
    """Root directory the file was found under (a sidecar's source_files entry)."""
    name: str
    """Path relative to the source root; hashed for selection and split."""
    text: str


def stable_hash(text: str) -> int:
    """A hash of `text` that is the same on every machine and run (unlike hash())."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def split_of(name: str) -> str:
    """'valid' for about VALID_PERCENT% of names, else 'train'; fixed per name."""
    return "valid" if stable_hash(f"split:{name}") % 100 < VALID_PERCENT else "train"


# --- roff -------------------------------------------------------------------------------------

# Named characters (\(xx, \[xx]) and strings (\*(xx) that carry text; all others are dropped.
_NAMED_CHARS = {
    "em": "\u2014",
    "en": "\u2013",
    "hy": "-",
    "mi": "-",
    "bu": "\u2022",
    "aq": "'",
    "dq": '"',
    "lq": '"',
    "rq": '"',
    "oq": "'",
    "cq": "'",
    "co": "\u00a9",
    "rg": "\u00ae",
    "tm": "\u2122",
    "mu": "\u00d7",
    "<=": "\u2264",
    ">=": "\u2265",
    "->": "\u2192",
    "<-": "\u2190",
    "ti": "~",
    "ha": "^",
    "rs": "\\",
    "ga": "`",
    "at": "@",
    "sh": "#",
    "Do": "$",
    "lB": "[",
    "rB": "]",
    "lC": "{",
    "rC": "}",
    "ba": "|",
    "dg": "\u2020",
    "de": "\u00b0",
    'L"': '"',
    'R"': '"',
    "C`": "'",
    "C'": "'",
    "Aq": "'",
    "--": "\u2014",
    "PI": "pi",
    "Tm": "(TM)",
    "R": "\u00ae",
}
_ESCAPE = re.compile(
    r"""\\(?:
        [fF](?:\(..|\[[^\]]*\]|.)                    # font change
      | s[-+]?(?:\d\d?|\(\d\d|\[\d+\])              # point size
      | \*(?:\((?P<str2>..)|\[(?P<strb>[^\]]*)\]|(?P<str1>.))   # string interpolation
      | \((?P<chr2>..)                              # named character \(xx
      | \[(?P<chrb>[^\]]*)\]                        # named character \[name]
      | [nhvwoklLDXxbZYgmMV](?:'[^']*'|\(..|\[[^\]]*\]|.)  # registers, motions, drawing
      | (?P<one>.)                                  # one-character escape
    )""",
    re.VERBOSE,
)
_ONE_CHAR = {"-": "-", "e": "\\", "\\": "\\", " ": " ", "~": " ", "0": " ", "'": "'", "`": "`", ".": ".", "t": "\t"}
# Requests and macros whose arguments are not running text.
_NON_TEXT_MACROS = frozenset(
    "TH IX PD RS RE UR UE MT ME EX EE TS TE Vb Ve Sp in ti ft ps vs ll na ad nh hy ne sp br bp ds de nr rr "
    "if ie el so tr cc c2 ec eo ig mk rt ta tc lc fc ss cs cu ul uf ev ns rs pl wh ch it em am as rn di da "
    "Dd Dt Os Bl El Bd Ed Bk Ek Rs Re UC AT DT PU TA ds1 Id Pp Lp Sm Ft Fd In".split()
)
_ALTERNATING_MACROS = frozenset("BI BR IB IR RB RI".split())
_PARAGRAPH_MACROS = frozenset("PP P LP TP HP sp Pp Lp".split())


def _replace_escape(match: re.Match[str]) -> str:
    named = (
        match.group("str2") or match.group("strb") or match.group("str1") or match.group("chr2") or match.group("chrb")
    )
    if named is not None:
        return _NAMED_CHARS.get(named, "")
    one = match.group("one")
    if one is not None:
        return _ONE_CHAR.get(one, "" if one in "&|^%c:),/!{}\n" else one)
    return ""


def _macro_arguments(rest: str) -> list[str]:
    """Arguments of a roff macro line: blank-separated, "..." quoted, "" inside quotes is a quote."""
    return [
        m.group(1).replace('""', '"') if m.group(1) is not None else m.group(2)
        for m in re.finditer(r'"((?:[^"]|"")*)"?|(\S+)', rest)
    ]


def strip_roff(source: str) -> str:
    """Readable text of a man page: markup removed crudely, words and layout of the prose kept.

    The preamble before `.TH`/`.Dd` and macro definitions are dropped; text-carrying macros
    (.SH, .B, .BR, .IP, mdoc's .Nm/.Fl/...) keep their arguments; inline escapes become the
    character they stand for or nothing.
    """
    lines = source.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith((".TH", ".Dd"))), 0)
    out: list[str] = []
    skip_until_dots = False
    for line in lines[start:]:
        if skip_until_dots:
            skip_until_dots = not line.startswith("..")
            continue
        line = re.sub(r'\\".*', "", line)
        if line.startswith("'"):
            continue  # control line with the no-break control character
        if line.startswith("."):
            name, _, rest = line[1:].strip().partition(" ")
            if name in ("de", "ig", "am", "de1"):
                skip_until_dots = True
                continue
            if name in _NON_TEXT_MACROS or not name or not name[0].isalpha():
                continue
            if name in _PARAGRAPH_MACROS:
                out.append("")
                continue
            args = _macro_arguments(rest)
            if name in ("SH", "SS", "Sh", "Ss"):
                out.extend(["", " ".join(args)])
                continue
            line = ("" if name in _ALTERNATING_MACROS else " ").join(args)
            if not line:
                continue
        out.append(_ESCAPE.sub(_replace_escape, line).rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


# --- sources ----------------------------------------------------------------------------------


def stdlib_files(root: Path) -> list[Path]:
    """The standard library's .py files (installed third-party packages excluded), sorted."""
    files: list[Path] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        files.extend(Path(directory, n) for n in names if n.endswith(".py"))
    return sorted(p for p in files if p.is_file())


def man_files(root: Path) -> list[Path]:
    """English man pages (man*/ sections, regular files, not the links to them), sorted."""
    if not root.is_dir():
        return []
    files: list[Path] = []
    for section in sorted(root.glob("man*")):
        if section.is_dir():
            with os.scandir(section) as entries:
                files.extend(Path(e.path) for e in entries if e.is_file(follow_symlinks=False))
    return sorted(files)


def read_python(path: Path) -> str | None:
    """A .py file's text, or None when it is not UTF-8 (some test files are so on purpose)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def read_man(path: Path) -> str | None:
    """A man page's text with roff markup stripped; None when unreadable."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError):
        return None
    return strip_roff(raw.decode("utf-8", errors="replace"))


def documents_in_hash_order(
    root: Path, files: Sequence[Path], reader: Callable[[Path], str | None]
) -> Iterator[Document]:
    """Documents of `files` in the fixed hash order of their names; unreadable and near-empty ones skipped."""
    named = sorted(((str(p.relative_to(root)), p) for p in files), key=lambda item: stable_hash(f"select:{item[0]}"))
    for name, path in named:
        text = reader(path)
        if text is not None and len(text.strip()) >= MIN_DOCUMENT_CHARS:
            yield Document(str(root), name, text)


def take_bytes(documents: Iterator[Document], budget: int) -> list[Document]:
    """Documents from `documents` until `budget` bytes of UTF-8 text are reached (the last may pass it)."""
    taken: list[Document] = []
    used = 0
    while used < budget:
        doc = next(documents, None)
        if doc is None:
            break
        taken.append(doc)
        used += len(doc.text.encode("utf-8"))
    return taken


def collect_documents(max_bytes: int, stdlib_root: Path, man_root: Path = MAN_ROOT) -> list[Document]:
    """About half of `max_bytes` from each source; a source that runs short leaves its share to the other."""
    python_docs = documents_in_hash_order(stdlib_root, stdlib_files(stdlib_root), read_python)
    man_docs = documents_in_hash_order(man_root, man_files(man_root), read_man)
    chosen = take_bytes(python_docs, max_bytes // 2)
    chosen += take_bytes(man_docs, max_bytes - _size(chosen))
    chosen += take_bytes(python_docs, max_bytes - _size(chosen))
    return sorted(chosen, key=lambda d: (d.source, d.name))


def _size(documents: Iterable[Document]) -> int:
    return sum(len(d.text.encode("utf-8")) for d in documents)


# --- build ------------------------------------------------------------------------------------


def document_chunks(documents: Sequence[Document]) -> Iterator[TextChunk]:
    """TextChunks of CHUNK_DOCUMENTS documents of one source; 'line' numbers count documents."""
    for start in range(0, len(documents), CHUNK_DOCUMENTS):
        batch = documents[start : start + CHUNK_DOCUMENTS]
        for source in dict.fromkeys(d.source for d in batch):
            records: list[tuple[int, Record]] = [
                (start + i + 1, d.text) for i, d in enumerate(batch) if d.source == source
            ]
            yield TextChunk(source, records, json_lines=False)


def build_corpus(
    output_dir: Path,
    *,
    max_mb: float,
    vocab_size: int,
    stdlib_root: Path,
    man_root: Path = MAN_ROOT,
    progress: bool = True,
) -> dict[str, object]:
    """Build the corpus into `output_dir` (its tokenizer/, train/, valid/ are replaced); corpus.json's content."""
    started = time.perf_counter()
    for sub in ("tokenizer", *SPLITS):
        shutil.rmtree(output_dir / sub, ignore_errors=True)
    documents = collect_documents(int(max_mb * 1e6), stdlib_root, man_root)
    if not documents:
        raise ValueError(f"no documents found under {stdlib_root} or {man_root}")
    splits = {split: [d for d in documents if split_of(d.name) == split] for split in SPLITS}
    tokenizer = train_byte_level_bpe(
        (d.text for d in splits["train"]), vocab_size=vocab_size, output_dir=output_dir / "tokenizer"
    )
    summaries = {
        split: _tokenize_split(docs, tokenizer, output_dir / split / "part", progress) for split, docs in splits.items()
    }
    sources = {
        root: {
            "documents": sum(d.source == root for d in documents),
            "bytes": _size(d for d in documents if d.source == root),
        }
        for root in (str(stdlib_root), str(man_root))
    }
    corpus = {
        "max_mb": max_mb,
        "vocab_size": tokenizer.vocab_size,
        "vocab_size_asked": vocab_size,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "sources": sources,
        "splits": {
            split: {
                "documents": s.num_documents,
                "tokens": s.num_tokens,
                "shards": len(s.shards),
                "bytes": _size(splits[split]),
            }
            for split, s in summaries.items()
        },
        "build_seconds": round(time.perf_counter() - started, 1),
    }
    write_atomic(output_dir / "corpus.json", json.dumps(corpus, indent=2) + "\n")
    return corpus


def _tokenize_split(
    docs: Sequence[Document], tokenizer: LoadedTokenizer, prefix: Path, progress: bool
) -> TokenizeSummary:
    summary = tokenize_chunks(document_chunks(docs), tokenizer=tokenizer, output_prefix=prefix, progress=progress)
    if summary.num_malformed:
        raise ValueError(
            f"{summary.num_malformed} documents of {prefix.parent} could not be tokenized, e.g. "
            f"{summary.malformed_examples[0]}"
        )
    return summary


def format_corpus(corpus: dict[str, object], output_dir: Path) -> str:
    """The short summary printed after a build."""
    splits = corpus["splits"]
    assert isinstance(splits, dict)
    lines = [f"default corpus in {output_dir} (max_mb={corpus['max_mb']}, vocab {corpus['vocab_size']}):"]
    for split, s in splits.items():
        lines.append(
            f"  {split:5s}: {s['documents']:6,d} documents  {s['tokens']:11,d} tokens  "
            f"{s['bytes'] / 1e6:6.1f} MB text  {s['shards']} shard(s)"
        )
    sources = corpus["sources"]
    assert isinstance(sources, dict)
    for root, s in sources.items():
        lines.append(f"  source {root}: {s['documents']:,} documents, {s['bytes'] / 1e6:.1f} MB")
    lines.append(f"  built in {corpus['build_seconds']} s")
    return "\n".join(lines)


MAX_MB, VOCAB_SIZE = 24.0, 4096
"""What a build takes when its flags are not given."""


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description="Build the default corpus (Python stdlib sources + man pages): tokenizer, train and valid shards.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--output_dir", type=Path, default=Path("data/default"), help="where to build the corpus")
    parser.add_argument(
        "--max_mb", type=number_flag(gt=0), default=None, help=f"megabytes of text to take in all (default: {MAX_MB:g})"
    )
    parser.add_argument(
        "--vocab_size", type=int, default=None, help=f"vocabulary size of the trained tokenizer (default: {VOCAB_SIZE})"
    )
    parser.add_argument("--overwrite", action="store_true", help="rebuild even when a complete build exists")
    parser.add_argument("--force", dest="overwrite", action="store_true", help=argparse.SUPPRESS)  # its former name
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def built_otherwise(corpus: dict[str, Any], max_mb: float | None, vocab_size: int | None) -> list[str]:
    """The flags given that the complete build `corpus` (its corpus.json) was not built with; those not given
    (None) take what it was built with."""
    built = {"max_mb": corpus["max_mb"], "vocab_size": corpus.get("vocab_size_asked", corpus["vocab_size"])}
    asked = {"max_mb": max_mb, "vocab_size": vocab_size}
    return [f"--{k} {asked[k]:g} (it was built with {v:g})" for k, v in built.items() if asked[k] not in (None, v)]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    marker = args.output_dir / "corpus.json"
    if marker.is_file() and not args.overwrite:
        try:  # NOTE: the summary is formatted here so that a damaged field is refused as the rest is
            corpus = json.loads(marker.read_text(encoding="utf-8"))
            otherwise, summary = (
                built_otherwise(corpus, args.max_mb, args.vocab_size),
                format_corpus(corpus, args.output_dir),
            )
        except (ValueError, KeyError, TypeError, AttributeError, AssertionError, RecursionError) as err:
            print(f"error: {marker} is damaged ({err!r}); pass --overwrite to rebuild the corpus", file=sys.stderr)
            return 2
        if otherwise:
            print(
                f"error: {args.output_dir} holds a complete corpus, not the one asked for: {'; '.join(otherwise)}; "
                "pass --overwrite to rebuild it, or choose another --output_dir",
                file=sys.stderr,
            )
            return 2
        print(f"{args.output_dir} is already built; pass --overwrite to rebuild")  # NOTE: first: the lines below
        print(summary)  # describe that earlier build, its time included
        return 0
    args.output_dir.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    try:
        corpus = build_corpus(
            args.output_dir,
            max_mb=args.max_mb or MAX_MB,
            vocab_size=args.vocab_size or VOCAB_SIZE,
            stdlib_root=Path(sysconfig.get_paths()["stdlib"]),
            progress=not args.quiet,
        )
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_corpus(corpus, args.output_dir))
    return 0
