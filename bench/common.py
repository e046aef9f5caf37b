"""Shared plumbing of the benchmarks: result files, machine facts, tables and timing.

Every benchmark in `bench/` prints a table and writes its figures as JSON to `bench/results/<name>.json`;
summaries go to `docs/`, and the JSON records behind published figures are committed (run directories
stay ignored). Each record holds the command, the git commit and the machine, including its load
average, because the CPU is shared and a ratio measured in one run is the only figure worth comparing.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from spes.atomic import write_atomic
from spes.cli import ArgumentParser
from spes.config import ServerSection, TrainConfig
from spes.model import Transformer
from spes.sync.codecs.registry import build_codec
from spes.sync.spec import RunSpec

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "bench" / "results"
PAPER_1B = REPO_ROOT / "configs" / "spes_1b" / "node_0.yaml"
"""The paper's 1B node config, which the full runs measure (some with fewer layers or a scaled-down width)."""
GIB = 2**30
MIB = 2**20


DEFAULT_OUT = object()
"""`--out`'s default until parsed: bench/results/<name>.json for a full run on the CPU, <name>_gpu.json for one with
`--device cuda`, and either with `_quick` for --quick."""


class BenchParser(ArgumentParser):
    """A benchmark's parser: `--out` left at its default names a quick run's record `<name>_quick.json`, which git
    ignores, so a smoke run never overwrites the committed record of a full one, and a run on a GPU `<name>_gpu.json`,
    so it never overwrites the CPU's."""

    def __init__(self, name: str, **kwargs: Any) -> None:
        super().__init__(prog=f"bench/{name}.py", allow_abbrev=False, **kwargs)  # a written flag is the flag itself
        self.bench_name = name

    def parse_known_args(  # type: ignore[override]  # one signature for typeshed's overloads
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, rest = super().parse_known_args(args, namespace)
        if getattr(ns, "out", None) is DEFAULT_OUT:
            gpu = getattr(ns, "device", None) == "cuda" and not self.bench_name.endswith("_gpu")
            ns.out = RESULTS_DIR / f"{self.bench_name}{'_gpu' if gpu else ''}{'_quick' if ns.quick else ''}.json"
        return ns, rest


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark has: --quick and --out."""
    p = BenchParser(
        name, description=(doc or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="a short smoke run of the same code (what CI runs; seconds to minutes)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="where the JSON record goes (default: bench/results/, named after the benchmark, with _gpu for "
        "--device cuda and with _quick, which git ignores, for --quick)",
    )
    return p


def config_file(text: str) -> Path:
    """argparse's type of `--config`: the YAML as an absolute path (a benchmark's child processes run in the
    repository root), refused in one line when it is not a file."""
    path = Path(text).resolve()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file; pass a config YAML, e.g. configs/small.yaml")
    return path


def repo_path(path: Path) -> str:
    """How a record names a file: relative to the repository root when inside it (the commit names its content),
    else absolute."""
    path = path.resolve()
    return str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path)


def corpus_args(p: argparse.ArgumentParser, *, valid: bool = True) -> None:
    """--tokenizer, --train and (if `valid`) --valid: the local corpus a training benchmark reads (default: the one
    data_process_scripts/build_default_corpus.py writes; tests pass their own, made in a temporary folder)."""
    p.add_argument("--tokenizer", default="data/default/tokenizer", help="tokenizer directory (4096 tokens)")
    p.add_argument("--train", default="data/default/train/*.npy", help="training shards (glob)")
    if valid:
        p.add_argument("--valid", default="data/default/valid/*.npy", help="validation shards (glob)")


def check_corpus(args: argparse.Namespace) -> None:
    """Stop with what to run when the tokenizer of `corpus_args` is missing (the default corpus is not built yet)."""
    if not (REPO_ROOT / args.tokenizer).exists() and not Path(args.tokenizer).exists():
        flags = "--tokenizer, --train and --valid" if hasattr(args, "valid") else "--tokenizer and --train"
        raise SystemExit(
            f"error: tokenizer {args.tokenizer!r} not found; build the default corpus with "
            "`.venv/bin/python data_process_scripts/build_default_corpus.py --output_dir data/default`, or pass "
            f"{flags}"
        )


def machine_info() -> dict[str, Any]:
    """What the figures were measured on, including the load average (other users share the CPU)."""
    load1, load5, load15 = os.getloadavg()
    return {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_avg_1_5_15": [round(load1, 2), round(load5, 2), round(load15, 2)],
    }


def model_record(quick: bool, config: Path, overrides: Sequence[str]) -> dict[str, Any]:
    """How a record of a benchmark measuring a config's model begins: the mode, the machine, and the model (the
    config file in the repository and the overrides on it)."""
    return {
        "mode": "quick" if quick else "full",
        "machine": machine_info(),
        "config": str(config.relative_to(REPO_ROOT)),
        "overrides": list(overrides),
    }


def git_commit() -> str:
    """The checked-out commit; when tracked files other than the records in bench/results/ (which a benchmark itself
    rewrites) differ from it, `<commit>-dirty-<hash>` with the SHA-256 (16 hex digits) of that diff (`git diff HEAD`),
    so a figure names the exact tree it came from; "unknown" outside git. SPES_COMMIT, where set, is taken as it is:
    bench/prepare_gpu.sh writes it (this function's answer there) for a machine that gets the tree without .git."""
    if os.environ.get("SPES_COMMIT"):
        return os.environ["SPES_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        scope = ("--", ".", ":!bench/results")
        head = git("rev-parse", "HEAD")
        if not git("status", "--porcelain", "--untracked-files=no", *scope):
            return head
        return f"{head}-dirty-{hashlib.sha256(git('diff', 'HEAD', *scope).encode()).hexdigest()[:16]}"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def vocabulary(size: int) -> list[str]:
    """Overrides that shrink a config's vocabulary and embedding to `size` ids, with EOS and pad at ids 0 and 1: the
    tokenizer's ids lie past a shrunk vocabulary (the benchmarks train on random tokens, so no tokenizer is read)."""
    return [
        f"--model.vocab_size={size}",
        f"--model.embedding_size={size}",
        "--model.eos_token_id=0",
        "--model.pad_token_id=1",
    ]


def command_line(argv: Sequence[str] | None = None) -> str:
    """How a record names the command that produced it: the interpreter's name and `argv` (default: this one's)."""
    return " ".join([Path(sys.executable).name, *(sys.argv if argv is None else argv)])


def write_results(path: Path, results: dict[str, Any]) -> None:
    """Write the results JSON atomically, with the command and commit that produced it."""
    record = {"command": command_line(), "commit": git_commit(), **results}
    write_atomic(path, json.dumps(record, indent=1) + "\n")
    print(f"saved {path}")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A right-aligned plain-text table; floats are shown with 3 significant decimals unless pre-formatted."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 1000 else f"{v:,.0f}"
        if isinstance(v, int):
            return f"{v:,d}"
        return str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def best_seconds(fn: Callable[[], object], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """The fastest of `repeats` timed calls (after one untimed warm-up call): the least-disturbed figure; `clock`
    time.process_time for the CPU time of this process instead of wall time."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = clock()
        fn()
        best = min(best, clock() - started)
    return best


def run_child(script: Path, args: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 600) -> dict:
    """Run `python script args` and parse the JSON object it prints on its last stdout line."""
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=REPO_ROOT,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{script.name} {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def manifest_of(cfg: TrainConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a node of this run synchronizes, read off the real model on the meta device.

    Synthetic workloads built from this are named and shaped exactly like a real model's (shared tensors and
    `blocks.{l}.ffn.experts.{w1,v1,w2}.{b}` ownership blocks), so the server treats them as it would a model.
    """
    with torch.device("meta"):
        model = Transformer.for_run(cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def manifest_bytes(manifest: dict[str, tuple[int, ...]], names: Sequence[str] | None = None, itemsize: int = 4) -> int:
    """Bytes of the named tensors (default: all) at `itemsize` bytes per element."""
    total = 0
    for name in manifest if names is None else names:
        numel = 1
        for d in manifest[name]:
            numel *= d
        total += numel * itemsize
    return total


def spec_overrides(spec: RunSpec) -> list[str]:
    """The `--section.key=value` overrides that give a server started without the run's YAML the run `spec`, as a
    user would type them: the nodes' settings and whatever of the `server:` section differs from its defaults (the
    model's manifest and block owners come from the first node to join)."""
    words = [f"--spes_config.num_peers={spec.num_peers}"]
    if spec.mode == "diloco":
        words.append("--using_dilico=true")
    else:
        words.append(f"--spes_config.num_train_experts_per_node={spec.experts_per_block}")
    if spec.sync_steps is not None:
        words.append(f"--spes_config.sync_steps={spec.sync_steps}")
    if spec.overlap_fragments != 1:
        words.append(f"--spes_config.overlap_fragments={spec.overlap_fragments}")
    if spec.codec != "fp32":
        words.append(f"--spes_config.codec={spec.codec}")
        words += [f"--spes_config.codec_settings.{key}={value}" for key, value in spec.codec_settings]
    return [*words, *server_overrides(spec.server)]


def server_overrides(section: ServerSection) -> list[str]:
    """`--server.key=value` for each key of the run's `server:` section whose value differs from the default."""
    default = ServerSection()
    return [
        f"--server.{f.name}={getattr(section, f.name)}"
        for f in dataclasses.fields(ServerSection)
        if getattr(section, f.name) != getattr(default, f.name)
    ]


def start_server(args: Sequence[str], log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """`python -m spes.server --host 127.0.0.1 --port 0 ARGS`, logging to `log`; it and its port once it listens."""
    command = [sys.executable, "-m", "spes.server", "--host", "127.0.0.1", "--port", "0", *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=out)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        text = log.read_text(errors="replace")
        if "listening on 127.0.0.1:" in text:
            return proc, int(text.split("listening on 127.0.0.1:")[1].split()[0])
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the server did not start:\n{log.read_text(errors='replace')}")


@dataclasses.dataclass(frozen=True)
class CodecChoice:
    """A codec to measure, as `--codecs` names it: `NAME` or `NAME:key=value,...` (its `codec_settings`)."""

    label: str
    name: str
    settings: dict[str, int]

    @classmethod
    def parse(cls, text: str) -> CodecChoice:
        """ValueError naming the codec or setting that is not valid (`spes.sync.codecs.registry.build_codec`)."""
        name, _, given = text.partition(":")
        settings = {}
        for item in filter(None, given.split(",")):
            key, eq, value = item.partition("=")
            if not eq or not value.lstrip("-").isdigit():
                raise ValueError(f"codec {text!r}: settings are key=value with integer values, e.g. sparse:topk=32")
            settings[key] = int(value)
        build_codec(name, settings)
        return cls(text.replace("_", "-"), name, settings)

    @property
    def text(self) -> str:
        """How `--codecs` names it (`parse`'s inverse)."""
        given = ",".join(f"{k}={v}" for k, v in self.settings.items())
        return f"{self.name}:{given}" if given else self.name

    def overrides(self) -> list[str]:
        """The run-config overrides that select this codec."""
        return [
            f"--spes_config.codec={self.name}",
            *(f"--spes_config.codec_settings.{k}={v}" for k, v in self.settings.items()),
        ]


def codec_choice(text: str) -> CodecChoice:
    """argparse's type of `--codecs`: one line naming what is wrong."""
    try:
        return CodecChoice.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def idle_share(round_s: float, step_s: float, sync_steps: int, fragments: int = 0, rtt_s: float = 0.0) -> float:
    """The share of a node's wall time not training, with rounds of `round_s` every `sync_steps` steps of `step_s`.

    Blocking (`fragments` 0): round / (round + sync_steps * step). Overlapped with F fragments (F >= 1): every
    sync_steps / F steps a round of 1/F of the model, applied that many steps later, one on the link at a time, so
    a period of sync_steps steps (compute C = sync_steps * step) puts R = round + (F - 1) * rtt on the link (each
    extra round pays its two round trips, `rtt_s` = 2 RTT over the link's efficiency) and the node waits for what
    the link does not hide: max(0, R - C) / max(R, C).
    """
    compute = sync_steps * step_s
    if not fragments:
        return round_s / (round_s + compute)
    link = round_s + (fragments - 1) * rtt_s
    return max(0.0, link - compute) / max(link, compute)
