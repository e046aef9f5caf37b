#!/usr/bin/env python
"""Mini-reproduction of the paper's comparison: centralized vs SPES vs DiLoCo at the same token budget.

    .venv/bin/python bench/mini_repro.py                 # three 400-step runs, plot, docs/mini_repro.md
    .venv/bin/python bench/mini_repro.py --report-only   # re-plot and re-write the report from the last runs
    .venv/bin/python bench/mini_repro.py --quick         # smoke run (seconds of training, report next to the runs)
    .venv/bin/python bench/mini_repro.py --seed 7        # the same with another model-init and data-order seed
    .venv/bin/python bench/mini_repro.py --codecs int8 sparse   # the SPES run on the fp32 wire and each codec
    .venv/bin/python bench/mini_repro.py --overlap       # SPES blocking vs overlapped rounds (overlap_sync)

Three real runs on the default local corpus (data/default, built by
`data_process_scripts/build_default_corpus.py --output_dir data/default`), each through the project's own
entry points, with the same model, initialization, learning-rate schedule and number of steps:

  (a) centralized: one `python -m spes.train` with `using_spes=false` and a batch of 4 x the peer batch;
  (b) SPES: `python -m spes.launch` (a parameter server and 4 peers, each owning 2 of the 8 experts);
  (c) DiLoCo/FedAvg: the same launcher with `--dilico` (every peer trains and the server averages everything).

Each peer's `global_train_batch_size` is a quarter of the centralized one, so every run sees the same number of
tokens per step and in total; the counts are read back from the trainers' own `tokens` metric and the report
is refused unless they are equal, and unless the runs ran to the end at one commit with the same seeds, model,
steps, schedule, optimizer and data (each run's `run.json` keeps what its own command resolves to). The SPES and
DiLoCo curves are the validation loss of the merged global model right after a sync (what every peer holds then); their
pre-sync local losses are kept too. Bytes communicated are the payload bytes every peer sent and received
(the client's counters), summed over peers. Outputs: `<runs>/<run>/` (logs, metrics.jsonl, and run.json: the
command, commit, machine and premises), `<runs>/walls.json`, the record (`--out`, default
`bench/results/<name>.json`, committed for the full runs), and in `--docs`: `mini_repro.png` and `mini_repro.md`.
A run already complete in `--runs` at this (clean) commit with the same command is read instead of run again, so
an interrupted comparison resumes; an interrupted or outdated run starts over in a fresh folder.

`--seed S` sets the model initialization seed and the data-order seeds (S for the centralized run and peer 0,
S + 1000 * i for peer i) and runs into `bench/results/mini_repro_seed<S>/` with its report there; the default
seed's report in docs/ lists the final losses of every other seed found in bench/results/.

`--codecs CODEC...` runs the SPES arm (DiLoCo's with `--dilico`) on the fp32 wire and on each codec
(`spes_config.codec` and its `codec_settings`, e.g. `int8`, `sparse:topk=128`) into
`bench/results/mini_repro_codecs[_diloco][_seed<S>]/<arm>/`, refuses unequal tokens as above, and records every
arm's final validation loss against the fp32 arm's (`vs_fp32`, target within 1%) and its bits per parameter per
peer and round in `bench/results/mini_repro_codecs*.json`. With `--overlap` as well, each codec also runs on each
overlapped schedule.

`--overlap` runs the SPES arm blocking, and with `spes_config.overlap_sync` once per `--overlap_steps D` (each
round applied D steps after its sync step, with the local progress made meanwhile; default D = sync_steps), into
`bench/results/mini_repro_overlap[_seed<S>]/<arm>/`, refuses unequal tokens as above, and records every arm's
final validation loss in `bench/results/mini_repro_overlap*.json` (the figures in docs/benchmarks.md). `--only
ARM...` records the base arm and just those arms. Each arm is run, resumed and checked as the three runs above.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import (
    REPO_ROOT,
    RESULTS_DIR,
    CodecChoice,
    check_corpus,
    codec_choice,
    command_line,
    corpus_args,
    git_commit,
    machine_info,
    parser,
    write_results,
)
from spes.atomic import write_atomic
from spes.config import load_config
from spes.interrupt import Interruptible
from spes.launch import load_run
from spes.launch import parse_args as parse_launch_args
from spes.model import analytic_param_counts

CONFIG = "configs/tiny.yaml"
DEFAULT_SEED = 6198  # configs/tiny.yaml's `seed` and `data.seed`
PEERS = 4
RUNS = ("centralized", "spes", "diloco")
LABELS = {"centralized": "centralized (1 trainer, 4x batch)", "spes": "SPES (4 peers)", "diloco": "DiLoCo (4 peers)"}
COLORS = {"centralized": "black", "spes": "tab:red", "diloco": "tab:blue"}


@dataclass(frozen=True)
class Setup:
    """One mini-reproduction's sizes; `quick` is a smoke test of the same pipeline."""

    d_model: int
    n_layers: int
    n_heads: int
    mlp_hidden_size: int
    seq_len: int
    peer_batch: int
    steps: int
    sync_steps: int
    eval_interval: int
    eval_batches: int
    eval_batch_size: int
    learning_rate: float
    warmup: int
    merge_interval: int
    merge_alpha_start: float
    merge_decay_steps: int

    def merge_overrides(self) -> list[str]:
        """The server's merge warm-up of this setup, as overrides of the run's `server:` section (`spes.launch`
        gives the server and every node the same overrides; the nodes ignore the section)."""
        return [
            f"--server.merge_interval={self.merge_interval}",
            f"--server.merge_alpha_start={self.merge_alpha_start}",
            f"--server.merge_decay_steps={self.merge_decay_steps}",
        ]

    def overrides(self, tokenizer: str, train: str, valid: str, seed: int) -> list[str]:
        """The config overrides shared by all three runs (configs/tiny.yaml underneath)."""
        return [
            f"--seed={seed}",
            f"--data.seed={seed}",
            f"--model.d_model={self.d_model}",
            f"--model.n_layers={self.n_layers}",
            f"--model.n_heads={self.n_heads}",
            f"--model.mlp_hidden_size={self.mlp_hidden_size}",
            f"--model.max_sequence_length={self.seq_len}",
            f"--max_duration={self.steps}st",
            f"--scheduler.t_warmup={self.warmup}",
            f"--optimizer.learning_rate={self.learning_rate}",
            f"--spes_config.sync_steps={self.sync_steps}",
            f"--eval_interval={self.eval_interval}",
            f"--eval_subset_num_batches={self.eval_batches}",
            f"--device_eval_batch_size={self.eval_batch_size}",
            f"--device_train_microbatch_size={self.peer_batch}",
            f"--global_train_batch_size={self.peer_batch}",  # a peer's batch; the centralized run overrides it
            f"--tokenizer.identifier={tokenizer}",
            f"--data.paths=[{train}]",
            f"--data.validation_paths=[{valid}]",
            "--save_interval=null",
            f"--log_interval={self.sync_steps}",
        ]


FULL = Setup(
    d_model=128,
    n_layers=4,
    n_heads=4,
    mlp_hidden_size=256,
    seq_len=128,
    peer_batch=8,
    steps=400,
    sync_steps=10,
    eval_interval=20,
    eval_batches=4,
    eval_batch_size=16,
    learning_rate=2e-3,
    warmup=20,
    merge_interval=20,
    merge_alpha_start=0.05,
    merge_decay_steps=160,
)
QUICK = Setup(
    d_model=64,
    n_layers=2,
    n_heads=4,
    mlp_hidden_size=128,
    seq_len=64,
    peer_batch=4,
    steps=6,
    sync_steps=3,
    eval_interval=3,
    eval_batches=1,
    eval_batch_size=4,
    learning_rate=2e-3,
    warmup=2,
    merge_interval=3,
    merge_alpha_start=0.05,
    merge_decay_steps=6,
)


def run_commands(setup: Setup, common: list[str], out: Path) -> Commands:
    """The command and environment of each run: one torch thread per training process.

    NOTE: on a shared 2-core machine one process with 2 threads ran ~3x slower per token than with 1
    (its threads wait on each other whenever one is descheduled), so every process gets one thread.
    """
    py = sys.executable
    launch = [py, "-m", "spes.launch", CONFIG, "--threads", "1", "--timeout", "7200"]
    run = [*common, *setup.merge_overrides()]
    return {
        "centralized": (
            [
                py,
                "-m",
                "spes.train",
                CONFIG,
                *common,
                "--using_spes=false",
                f"--global_train_batch_size={PEERS * setup.peer_batch}",
                f"--save_folder={out / 'centralized'}",
            ],
            {"OMP_NUM_THREADS": "1"},
        ),
        "spes": ([*launch, "--out", str(out / "spes"), "--", *run], {}),
        "diloco": ([*launch, "--dilico", "--out", str(out / "diloco"), "--", *run], {}),
    }


Commands = dict[str, tuple[list[str], dict[str, str]]]


def run_all(
    commands: Commands, out: Path, lanes: int = 1, done: Callable[[str, float], None] | None = None
) -> dict[str, float]:
    """Run the trainings, at most `lanes` at a time; wall seconds each, also given to `done` as each ends well (so
    an interrupted schedule keeps the runs it finished). One at a time shares the CPU fairly between a run's
    processes; two one-process runs at once fill the two cores. A failed run stops the rest."""
    walls: dict[str, float] = {}
    pending = list(commands.items())
    running: dict[str, tuple[subprocess.Popen[bytes], float]] = {}
    with Interruptible():  # SIGTERM too: `finally` stops the runs
        try:
            while pending or running:
                while pending and len(running) < lanes:
                    name, (cmd, env) = pending.pop(0)
                    (out / name).mkdir(parents=True, exist_ok=True)
                    (out / name / "metrics.jsonl").unlink(missing_ok=True)
                    print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(cmd)}", flush=True)
                    with open(out / f"{name}.log", "w") as log:  # NOTE: the child keeps its own copy of the descriptor
                        proc = subprocess.Popen(
                            cmd,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                        )
                    running[name] = (proc, time.time())
                time.sleep(0.5)
                for name, (proc, started) in list(running.items()):
                    if proc.poll() is None:
                        continue
                    del running[name]
                    walls[name] = time.time() - started
                    if proc.returncode != 0:
                        raise SystemExit(
                            f"error: the {name} run failed with exit code {proc.returncode}; see {out / f'{name}.log'}"
                        )
                    print(f"[{time.strftime('%H:%M:%S')}] {name}: done in {walls[name]:.0f} s", flush=True)
                    if done:
                        done(name, walls[name])
        finally:
            for proc, _ in running.values():
                proc.terminate()
                proc.wait()
    return walls


def read_json(path: Path, missing: Any) -> Any:
    """What a run wrote to `path`, or `missing` where it wrote nothing (e.g. runs older than the file)."""
    return json.loads(path.read_text()) if path.is_file() else missing


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise SystemExit(f"error: {path} is missing: run without --report-only first")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _tokens_at(records: list[dict[str, Any]], step: int, where: Path) -> int:
    """The trainer's own `tokens` counter at `step` (it logs every sync and evaluation step)."""
    for r in records:
        if r["step"] == step and "tokens" in r:
            return int(r["tokens"])
    raise SystemExit(f"error: {where} logged no `tokens` at step {step}: the run is incomplete or too old; re-run it")


def central_curve(run: Path) -> dict[str, Any]:
    """A single trainer's validation curve, with the tokens it logged."""
    path = run / "metrics.jsonl"
    records = _records(path)
    evals = [r for r in records if "val_loss" in r]
    return {
        "step": [r["step"] for r in evals],
        "tokens": [_tokens_at(records, r["step"], path) for r in evals],
        "tokens_final": int(records[-1]["tokens"]),
        "val_loss": [r["val_loss"] for r in evals],
        "bytes": [0] * len(evals),
    }


def peers_curve(run: Path) -> dict[str, Any]:
    """A SPES/DiLoCo run's curve: the merged model's validation loss after each evaluated sync, tokens summed
    over the peers' own counters, and cumulative bytes sent and received by all peers."""
    paths = [run / f"node{p}" / "metrics.jsonl" for p in range(PEERS)]
    peers = [_records(path) for path in paths]
    cumulative: dict[int, float] = {}
    total = 0.0
    for step in sorted({r["step"] for recs in peers for r in recs if "sync_s" in r}):
        total += (
            sum(
                r["sync_mb_up"] + r["sync_mb_down"]
                for recs in peers
                for r in recs
                if r["step"] == step and "sync_s" in r
            )
            * 2**20
        )
        cumulative[step] = total
    syncs = [r for r in peers[0] if "sync_s" in r]
    evals = [r for r in peers[0] if "merged_val_loss" in r]
    steps = [r["step"] for r in evals]
    evaluated = [recs for recs in peers if any("merged_val_loss" in r for r in recs)]  # see spes.launch --eval_peers
    merged_by_peer = [[r["merged_val_loss"] for r in recs if "merged_val_loss" in r] for recs in evaluated]
    local_by_peer = [[r["val_loss"] for r in recs if "merged_val_loss" in r] for recs in evaluated]
    return {
        "step": steps,
        "tokens": [sum(_tokens_at(recs, s, path) for recs, path in zip(peers, paths)) for s in steps],
        "tokens_final": sum(int(recs[-1]["tokens"]) for recs in peers),
        "tokens_final_per_peer": [int(recs[-1]["tokens"]) for recs in peers],
        "val_loss": [r["merged_val_loss"] for r in evals],
        "merged_spread_across_peers": max(max(v) - min(v) for v in zip(*merged_by_peer)),
        "local_val_loss_mean": [sum(v) / len(v) for v in zip(*local_by_peer)],
        "bytes": [cumulative[s] for s in steps],
        # NOTE: an overlapped node logs the rounds it applied at a step; at its last step that may be two
        "bytes_per_peer_round_up": syncs[-1]["sync_mb_up"] / syncs[-1].get("sync_rounds", 1) * 2**20,
        "bytes_per_peer_round_down": [r["sync_mb_down"] / r.get("sync_rounds", 1) * 2**20 for r in syncs],
        "rounds": sum(r.get("sync_rounds", 1) for r in syncs),
        "merge_rounds": sum(bool(r.get("merged")) for r in syncs),
        "sync_seconds_peer0": sum(r["sync_s"] for r in syncs),
        "sync_wait_seconds_peer0": sum(r.get("sync_wait_s", r["sync_s"]) for r in syncs),
    }


def collect(out: Path) -> dict[str, Any]:
    """Curves of the three runs. Token counts are what the trainers logged (the `tokens` metric), summed over
    a run's peers; never computed from the setup, so a wrong batch shows up here instead of in a mislabelled axis.
    """
    return {
        "centralized": central_curve(out / "centralized"),
        "spes": peers_curve(out / "spes"),
        "diloco": peers_curve(out / "diloco"),
    }


def check_equal_tokens(curves: dict[str, Any], where: Path, base_run: str = "centralized") -> None:
    """Refuse to report unless every run trained on the same measured tokens, in total and at every evaluation.

    The report's claim is a comparison at equal tokens; it holds only if the base run's (the centralized one's)
    logged count equals the sum over each decentralized run's peers.
    """
    base = curves[base_run]
    for name in [n for n in curves if n != base_run]:
        c = curves[name]
        if c["tokens_final"] != base["tokens_final"]:
            raise SystemExit(
                f"error: unequal token budgets in {where}: {base_run} trained on {base['tokens_final']:,} tokens, "
                f"{name} on {c['tokens_final']:,} (peers {c['tokens_final_per_peer']}); every peer's "
                f"global_train_batch_size must be the centralized one / {PEERS}. No report written."
            )
        at_central = dict(zip(base["step"], base["tokens"]))
        for step, tokens in zip(c["step"], c["tokens"]):
            if step in at_central and at_central[step] != tokens:
                raise SystemExit(
                    f"error: unequal tokens at step {step} in {where}: {base_run} {at_central[step]:,}, "
                    f"{name} {tokens:,}. No report written."
                )


def plot(curves: dict[str, Any], path: Path, title: str) -> None:
    """Two panels: validation loss against tokens, and against bytes communicated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.6), constrained_layout=True)
    for name in RUNS:
        c = curves[name]
        ax_t.plot([t / 1e6 for t in c["tokens"]], c["val_loss"], "o-", color=COLORS[name], label=LABELS[name])
        if "local_val_loss_mean" in c:
            ax_t.plot(
                [t / 1e6 for t in c["tokens"]],
                c["local_val_loss_mean"],
                ":",
                color=COLORS[name],
                alpha=0.7,
                label=f"{name}: local model before sync (mean of peers)",
            )
    ax_t.set_xlabel("training tokens seen by the whole run (millions)")
    ax_t.set_ylabel("validation loss (nats/token)")
    ax_t.set_title("validation loss vs tokens")
    ax_t.grid(alpha=0.3)
    ax_t.legend(fontsize=8)
    for name in ("spes", "diloco"):
        c = curves[name]
        ax_b.plot([b / 2**20 for b in c["bytes"]], c["val_loss"], "o-", color=COLORS[name], label=LABELS[name])
    ax_b.axhline(
        curves["centralized"]["val_loss"][-1],
        color=COLORS["centralized"],
        ls="--",
        label="centralized, final (no inter-node traffic)",
    )
    ax_b.set_xlabel("bytes communicated, all peers, up + down (MiB, fp32 wire)")
    ax_b.set_ylabel("validation loss of the merged model")
    ax_b.set_title("validation loss vs communication")
    ax_b.grid(alpha=0.3)
    ax_b.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".")))
    plt.close(fig)


def pct(a: float, b: float) -> str:
    """`a` relative to `b` in percent, signed: how every report states a gap between two losses."""
    return f"{100 * (a - b) / b:+.2f}%"


def seed_table(finals: dict[int, dict[str, float]]) -> list[str]:
    """Final validation losses per seed, and how SPES compares, with the mean over seeds."""
    lines = [
        "## Seeds",
        "",
        "Final validation loss per seed (model initialization and data order; `--seed`):",
        "",
        "| seed | centralized | SPES | DiLoCo | SPES vs centralized | SPES vs DiLoCo | DiLoCo vs centralized |",
        "|---|---|---|---|---|---|---|",
    ]

    def row(label: str, f: dict[str, float]) -> str:
        c, sp, dl = f["centralized"], f["spes"], f["diloco"]
        return f"| {label} | {c:.4f} | {sp:.4f} | {dl:.4f} | {pct(sp, c)} | {pct(sp, dl)} | {pct(dl, c)} |"

    lines += [row(str(seed), finals[seed]) for seed in sorted(finals)]
    if len(finals) > 1:
        lines.append(row(f"mean of {len(finals)}", {r: sum(f[r] for f in finals.values()) / len(finals) for r in RUNS}))
    return [*lines, ""]


def final_losses(curves: dict[str, Any]) -> dict[str, float]:
    """Each run's validation loss at the end."""
    return {name: curves[name]["val_loss"][-1] for name in RUNS}


def other_seeds(seed: int, commit: str) -> dict[int, dict[str, float]]:
    """Final losses of the full runs of every other seed found in bench/results/ that pass the checks of this seed's
    runs (`checked_runs`) at its `commit`; each seed left out is named with the reason."""
    found = {DEFAULT_SEED: RESULTS_DIR / "mini_repro"}
    found.update(
        {int(d.name.removeprefix("mini_repro_seed")): d for d in RESULTS_DIR.glob("mini_repro_seed*") if d.is_dir()}
    )
    finals = {}
    for other, runs in sorted(found.items()):
        if other == seed or not (runs / "walls.json").is_file():
            continue
        try:
            curves, info = checked_runs(runs, other)
        except SystemExit as refused:
            print(f"seed {other} left out of the seeds table: {refused}", flush=True)
            continue
        if info["commit"] != commit:
            print(f"seed {other} left out of the seeds table: it ran at {info['commit']}, not {commit}", flush=True)
            continue
        finals[other] = final_losses(curves)
    return finals


# What docs/mini_repro.md said before issue 13, and why its numbers changed (kept in the generated report).
CORRECTION = [
    "## Correction (issue 13)",
    "",
    "An earlier version of this report overstated both decentralized runs. The script set each peer's "
    "micro-batch but not its `global_train_batch_size`, so every peer kept `configs/tiny.yaml`'s 16 sequences "
    "per step: SPES and DiLoCo each trained on 3,276,800 tokens while the centralized run trained on "
    "1,638,400, and the report's \"every run trains on 1,638,400 tokens\" and the plot's token axis were "
    "computed from the setup instead of read from the trainers. With twice the data, it reported SPES "
    "+4.63% / +5.06% and DiLoCo +1.32% / +1.01% above centralized (seeds 6198 / 7).",
    "",
    "Now every peer trains on a quarter of the centralized batch; token counts are the trainers' own `tokens` "
    "metric, summed over peers, and the script refuses to write a report unless the centralized count equals "
    "each decentralized run's sum. The runs also use the reference's loss scalings adopted at the same time "
    "(router z-loss summed over layers, warm-up from 10% of the peak; see [differences.md](differences.md)), "
    "which apply to all three runs alike.",
    "",
]


def measured_tokens_line(curves: dict[str, Any]) -> str:
    """The token counts the trainers logged, as one sentence."""
    parts = [f"centralized {curves['centralized']['tokens_final']:,}"]
    for name in RUNS[1:]:
        per_peer = curves[name]["tokens_final_per_peer"]
        parts.append(f"{name} {curves[name]['tokens_final']:,} (= " + " + ".join(f"{t:,}" for t in per_peer) + ")")
    return "Tokens trained on, as logged by the trainers (`tokens` metric): " + "; ".join(parts) + "."


def config_facts(setup: Setup, params: dict[str, int] | None = None) -> dict[str, Any]:
    """What a report states of the runs' config beyond `setup`, read from configs/tiny.yaml under the setup's
    overrides, not typed; `drift` says so where `params` (the runs' recorded counts) differ from what that config
    gives now (it changed since the runs, so its facts may not be theirs)."""
    common = setup.overrides("tokenizer", "train", "valid", DEFAULT_SEED)
    drift = None
    if params is not None and (now := param_counts(common)) != {key: params.get(key) for key in now}:
        drift = (
            f"{CONFIG} now gives {now['total']:,} parameters under this setup, the runs recorded {params['total']:,}: "
            "it changed since they ran, so the facts above read from it may not be theirs; re-run to refresh"
        )
    cfg, _ = load_config(REPO_ROOT / CONFIG, common)
    start = cfg.scheduler.warmup_min_lr
    return {
        "experts": cfg.model.moe_num_experts,
        "top_k": cfg.model.moe_top_k,
        "vocab": cfg.model.vocab_size,
        "optimizer": cfg.optimizer.name,
        "warmup_from": "10%" if start is None else f"lr {start:g}",  # None: 10% of the peak (SchedulerConfig)
        "schedule": cfg.scheduler.name.removesuffix("_with_warmup"),
        "alpha_f": cfg.scheduler.alpha_f,
        "codec": cfg.spes_config.codec,
        "merge_topk": cfg.server.merge_topk,
        "drift": drift,
    }


def setup_table(setup: Setup, params: dict[str, int], machine: dict[str, Any]) -> list[str]:
    """The report's "Setup" section: what was trained, how, and on what machine (each fact from the setup, the
    config or the record, see `config_facts`)."""
    f = config_facts(setup, params)
    return [
        "## Setup",
        "",
        "| | |",
        "|---|---|",
        f"| model | d_model {setup.d_model}, {setup.n_layers} layers, {setup.n_heads} heads, {f['experts']} experts "
        f"top-{f['top_k']} (expert width {setup.mlp_hidden_size // 2}), vocab {f['vocab']}, sequence {setup.seq_len} |",
        f"| parameters | {params['total'] / 1e6:.2f}M total, {params['active'] / 1e6:.2f}M active per token, "
        f"{params['spes_trainable'] / 1e6:.2f}M trained per SPES peer |",
        f"| batch | peer {setup.peer_batch} x {setup.seq_len} tokens; centralized {PEERS * setup.peer_batch} x "
        f"{setup.seq_len} |",
        f"| optimizer | {f['optimizer']}, peak lr {setup.learning_rate}, linear warm-up from {f['warmup_from']} over "
        f"{setup.warmup} steps, {f['schedule']} to {f['alpha_f']:.0%} |",
        f"| sync | every {setup.sync_steps} steps ({setup.steps // setup.sync_steps} rounds), {f['codec']} on the "
        "wire |",
        f"| SPES merge warm-up | every {setup.merge_interval} steps, alpha {setup.merge_alpha_start} decaying to 0 "
        f"at step {setup.merge_decay_steps}, top-{f['merge_topk']} |",
        f"| validation | first {setup.eval_batches * setup.eval_batch_size} windows of the validation shards every "
        f"{setup.eval_interval} steps (SPES/DiLoCo: the merged model right after the sync) |",
        f"| machine | {machine['cpus']} CPU cores, load average {machine['load_avg_1_5_15'][0]} at the end; "
        f"torch {machine['torch']} |",
        *([f"| config | {f['drift']} |"] if f["drift"] else []),
        "",
    ]


def results_table(curves: dict[str, Any], walls: dict[str, float], note: str | None) -> list[str]:
    """The report's "Results" section: each run's final loss against the centralized one's, its traffic and speed."""
    tokens_total = curves["centralized"]["tokens_final"]
    base = curves["centralized"]["val_loss"][-1]
    lines = [
        "## Results",
        "",
        "| run | final val loss | val ppl | vs centralized | MiB up per peer-round | MiB down per peer-round "
        "| MiB communicated (all peers) | wall s | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in RUNS:
        c = curves[name]
        loss = c["val_loss"][-1]
        if name == "centralized":
            up = down = total = "0"
        else:
            downs = c["bytes_per_peer_round_down"]
            up = f"{c['bytes_per_peer_round_up'] / 2**20:.2f}"
            down = f"{min(downs) / 2**20:.2f}" + (
                f" ({max(downs) / 2**20:.2f} on merge rounds)" if max(downs) != min(downs) else ""
            )
            total = f"{c['bytes'][-1] / 2**20:,.0f}"
        lines.append(
            f"| {LABELS[name]} | {loss:.4f} | {2.718281828**loss:.1f} | {pct(loss, base)} "
            f"| {up} | {down} | {total} | {walls.get(name, float('nan')):.0f} "
            f"| {tokens_total / walls[name] if name in walls else float('nan'):,.0f} |"
        )
    return [*lines, *(["", f"Note on these runs: {note}."] if note else []), ""]


def loss_cell(curve: dict[str, Any], key: str, step: int) -> str:
    """A curve's `key` at `step` as a table cell: "-" where the run did not evaluate that step."""
    return f"{curve[key][curve['step'].index(step)]:.4f}" if step in curve["step"] else "-"


def curves_table(curves: dict[str, Any]) -> list[str]:
    """The report's "Curves" section: every evaluation of the three runs at the centralized run's steps."""
    central, spes, dil = curves["centralized"], curves["spes"], curves["diloco"]
    lines = [
        "## Curves (validation loss)",
        "",
        "| step | tokens | centralized | SPES (merged) | SPES local (mean) | DiLoCo (merged) | DiLoCo local (mean) |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, step in enumerate(central["step"]):
        lines.append(
            f"| {step} | {central['tokens'][i]:,} | {central['val_loss'][i]:.4f} "
            f"| {loss_cell(spes, 'val_loss', step)} | {loss_cell(spes, 'local_val_loss_mean', step)} "
            f"| {loss_cell(dil, 'val_loss', step)} | {loss_cell(dil, 'local_val_loss_mean', step)} |"
        )
    return [
        *lines,
        "",
        f"All peers hold the same merged model after a sync (largest spread of the merged validation loss "
        f"across peers: SPES {spes['merged_spread_across_peers']:.2e}, DiLoCo "
        f"{dil['merged_spread_across_peers']:.2e}).",
        "",
    ]


def report(
    setup: Setup,
    curves: dict[str, Any],
    walls: dict[str, float],
    params: dict[str, int],
    machine: dict[str, Any],
    png: str,
    finals: dict[int, dict[str, float]],
    correction: bool,
    note: str | None = None,
) -> str:
    """The markdown report: setup, final figures, the curves as a table (tokens as measured, checked equal)."""
    tokens_total = curves["centralized"]["tokens_final"]
    lines = [
        "# Mini-reproduction: centralized vs SPES vs DiLoCo",
        "",
        "Generated by `bench/mini_repro.py` (re-run it to refresh this file and the plot). "
        "All three runs use the same model, initialization, data order seeds, learning-rate schedule and "
        f"number of steps ({setup.steps}); the centralized batch is {PEERS} x the peer batch, so every run "
        f"trains on {tokens_total:,} tokens of the same corpus (by default the local one that "
        "`data_process_scripts/build_default_corpus.py` builds).",
        "",
        measured_tokens_line(curves),
        "",
        *(CORRECTION if correction else []),
        *setup_table(setup, params, machine),
        *results_table(curves, walls, note),
        f"![validation loss against tokens and bytes]({png})",
        "",
        *curves_table(curves),
        *seed_table(finals),
    ]
    return "\n".join(lines)


ARM_TARGET = 0.01
"""Issues 16.2 and 27: an overlapped run's, or a codec's, final validation loss within 1% of the blocking fp32 run's
at equal tokens."""


def overlap_arm(delay: int, correction: float = 1.0, fragments: int = 1) -> str:
    """The name of the overlapped SPES arm whose rounds are applied `delay` steps after their sync step, with
    `spes_config.overlap_correction` = `correction` and `overlap_fragments` = `fragments` (each named only when
    not the default 1)."""
    return (
        f"spes_overlap_d{delay}"
        + ("" if fragments == 1 else f"_f{fragments}")
        + ("" if correction == 1.0 else f"_c{correction:g}")
    )


def overlap_flags(delay: int, correction: float = 1.0, fragments: int = 1) -> list[str]:
    flags = ["--spes_config.overlap_sync=true", f"--spes_config.overlap_steps={delay}"]
    if fragments != 1:
        flags.append(f"--spes_config.overlap_fragments={fragments}")
    return flags if correction == 1.0 else [*flags, f"--spes_config.overlap_correction={correction:g}"]


def overlap_variants(
    delays: list[int] | None, corrections: Sequence[float], fragments: Sequence[int], sync_steps: int
) -> dict[str, list[str]]:
    """Every overlapped arm (one per fragment count, delay and correction): its name and its flags. Without
    `delays`, each fragment count F gets the longest delay it allows, sync_steps / F."""
    return {
        overlap_arm(d, c, f): overlap_flags(d, c, f)
        for f in fragments
        for d in (delays or [sync_steps // f])
        for c in corrections
    }


def codec_arm(codec: CodecChoice) -> str:
    """The name of the arm whose peers and server use `codec` (`sparse:topk=128` -> `codec_sparse_topk128`)."""
    return "codec_" + codec.label.replace(":", "_").replace(",", "_").replace("=", "")


def codec_variants(codecs: Sequence[CodecChoice], overlaps: dict[str, list[str]]) -> dict[str, list[str]]:
    """One arm per codec on the base arm's schedule, and one per codec and overlapped schedule in `overlaps`."""
    arms = {codec_arm(c): c.overrides() for c in codecs}
    arms.update({f"{codec_arm(c)}_{o}": [*c.overrides(), *flags] for c in codecs for o, flags in overlaps.items()})
    return arms


def arm_commands(base: str, setup: Setup, common: list[str], out: Path, variants: dict[str, list[str]]) -> Commands:
    """The `base` arm (`spes` or `diloco`) and every variant: the same command but for the variant's keys."""
    cmd, env = run_commands(setup, common, out)[base]
    at = cmd.index("--out")
    arms = {base: (cmd, env)}
    for arm, flags in variants.items():
        arms[arm] = ([*cmd[:at], "--out", str(out / arm), *cmd[at + 2 :], *flags], env)
    return arms


RUN_KEYS = ("command", "commit", "machine")
"""What a comparison's record keeps of each arm's run.json (its argv and premises stay in the run folder)."""


def arm_commit(run: Path) -> str | None:
    """The commit the arm in `run` ran at, if it ran to the end (its `run.json` says so once the arm has ended)."""
    info = read_json(run / "run.json", {})
    return info["commit"] if info.get("complete") else None


def rendered_from(commit: str | None) -> dict[str, str]:
    """The command and commit a `--report-only` record names: those of the runs it reads (their commit, and this
    command without the flag, which runs them again), not the re-render's own."""
    return {"command": command_line([a for a in sys.argv if a != "--report-only"]), "commit": commit or "unknown"}


def premises(cmd: list[str]) -> dict[str, Any]:
    """What the arms of one report must share, as the arm's own command resolves it (configs/tiny.yaml and the
    overrides, read as spes.launch or spes.train reads them): seeds, model shape, steps, learning-rate schedule,
    optimizer, corpus and validation. The batch is not here: the logged tokens are checked instead."""
    if "spes.launch" in cmd:  # as the launcher resolves it, its own flags (--dilico) folded in
        args, overrides = parse_launch_args(cmd[cmd.index("spes.launch") + 1 :])
        cfg, _ = load_run(argparse.Namespace(**{**vars(args), "config": str(REPO_ROOT / args.config)}), overrides)
    else:
        cfg, _ = load_config(REPO_ROOT / CONFIG, cmd[cmd.index(CONFIG) + 1 :])
    sections: dict[str, Any] = {"model": cfg.model, "scheduler": cfg.scheduler, "optimizer": cfg.optimizer}
    return {
        "seed": cfg.seed,
        "data.seed": cfg.data.seed,
        "max_duration": cfg.max_duration,
        "tokenizer": cfg.tokenizer.identifier,
        "data.paths": cfg.data.paths,
        "data.validation_paths": cfg.data.validation_paths,
        "eval": [cfg.eval_interval, cfg.eval_subset_num_batches, cfg.device_eval_batch_size],
        **{f"{name}.{key}": value for name, section in sections.items() for key, value in asdict(section).items()},
    }


def arm_record(cmd: list[str]) -> dict[str, Any]:
    """An arm's `run.json`: the script's command and commit, the arm's own command and the premises it resolves to;
    `complete` is added once the arm has ended (an arm without it was interrupted)."""
    record = {"command": " ".join([sys.executable, *sys.argv]), "commit": git_commit(), "argv": cmd}
    return {**record, "premises": json.loads(json.dumps(premises(cmd)))}


def arms_to_run(commands: Commands, runs: Path, records: dict[str, dict[str, Any]]) -> Commands:
    """The arms to (re-)run: all but those complete at this clean commit with the very same command. Refused, before
    anything runs, where an arm's folder holds something this script did not write (it is replaced otherwise)."""
    todo: Commands = {}
    for arm, command in commands.items():
        info = read_json(runs / arm / "run.json", None)
        if info and info.get("complete") and "-dirty" not in info["commit"]:
            if (info["commit"], info.get("argv")) == (records[arm]["commit"], records[arm]["argv"]):
                print(f"{arm}: complete at {info['commit'][:7]} in {runs / arm}, read instead of run again", flush=True)
                continue
        if info is None and (runs / arm).is_dir() and any((runs / arm).iterdir()):
            raise SystemExit(
                f"error: {runs / arm} holds a run this script did not record (no run.json): delete it "
                f"(rm -r {runs / arm}) or pass another --runs. Nothing was run."
            )
        todo[arm] = command
    return todo


def run_arms(commands: Commands, runs: Path, lanes: int = 1) -> list[str]:
    """Run the arms, at most `lanes` at a time, each with its own record of what ran it, except those already run
    to the end at this clean commit with the same command (an interrupted comparison resumes; an interrupted arm
    starts over in a fresh folder); the arms run now."""
    records = {arm: arm_record(cmd) for arm, (cmd, _) in commands.items()}
    todo = arms_to_run(commands, runs, records)
    for arm in todo:
        shutil.rmtree(runs / arm, ignore_errors=True)
        (runs / arm).mkdir(parents=True)
        write_atomic(runs / arm / "run.json", json.dumps(records[arm], indent=1) + "\n")
    walls = read_json(runs / "walls.json", {})

    def done(arm: str, wall: float) -> None:
        walls[arm] = wall
        info = {**records[arm], "machine": machine_info(), "complete": True}
        write_atomic(runs / arm / "run.json", json.dumps(info, indent=1) + "\n")
        write_atomic(runs / "walls.json", json.dumps(walls) + "\n")

    run_all(todo, runs, lanes, done)
    return list(todo)


def check_arms_alike(runs: Path, expect: dict[str, dict[str, Any]], vary: Sequence[str] = ()) -> str:
    """Refuse to report unless every arm of `expect` ran to the end at one commit, with the premises of the first
    arm (but for the keys in `vary`) and its own expected ones; their commit."""
    infos = {arm: read_json(runs / arm / "run.json", {}) for arm in expect}
    if unfinished := [arm for arm, info in infos.items() if not info.get("complete") or "premises" not in info]:
        raise SystemExit(
            f"error: {', '.join(unfinished)} in {runs} did not run to the end, or ran before arms recorded what ran "
            "them: run the script without --report-only (complete arms at this commit are kept). No report written."
        )
    if len({info["commit"] for info in infos.values()}) > 1:
        commits = {arm: info["commit"] for arm, info in infos.items()}
        raise SystemExit(f"error: the arms in {runs} ran at different commits ({commits}); run them at one commit")
    first, shared = next(iter(infos)), next(iter(infos.values()))["premises"]
    for arm, info in infos.items():
        wanted = {k: (v, f"as {first}") for k, v in shared.items() if k not in vary}
        wanted.update({k: (v, "as this report states") for k, v in expect[arm].items()})
        for key, (want, why) in wanted.items():
            if (got := info["premises"].get(key)) != want:
                raise SystemExit(
                    f"error: arm {arm} in {runs} ran with {key}={got!r}, not {want!r} ({why}); re-run it "
                    f"(rm -r {runs / arm}, then the same command). No report written."
                )
    return next(iter(infos.values()))["commit"]


def compare_arms(
    commands: Commands, runs: Path, base: str, variants: dict[str, list[str]], vs: str, total_params: int, seed: int
) -> dict[str, Any]:
    """Every arm's final validation loss (of the merged model, once the last round is applied) against the `base`
    arm's as `vs` = (arm - base) / base, at equal tokens and premises, all at `seed` (refused otherwise), and its
    bytes per peer per round.

    bits_per_param = 8 * (bytes up + bytes down) / `total_params`, per peer and round: over the whole run
    (`mean`, its first full-value round included) and in the last round (`last`, a codec's steady state).
    """
    walls = read_json(runs / "walls.json", {})
    curves = {arm: peers_curve(runs / arm) for arm in commands}
    check_equal_tokens(curves, runs, base_run=base)
    check_arms_alike(runs, dict.fromkeys(commands, {"seed": seed}))
    base_loss = curves[base]["val_loss"][-1]
    arms = {}
    for arm, c in curves.items():
        mean_bytes = c["bytes"][-1] / PEERS / c["rounds"]
        last_bytes = c["bytes_per_peer_round_up"] + c["bytes_per_peer_round_down"][-1]
        arms[arm] = {
            "flags": variants.get(arm, []),
            "final_val_loss": c["val_loss"][-1],
            vs: (c["val_loss"][-1] - base_loss) / base_loss,
            "within_target": abs(c["val_loss"][-1] - base_loss) / base_loss <= ARM_TARGET,
            "bits_per_param": {"mean": 8 * mean_bytes / total_params, "last": 8 * last_bytes / total_params},
            "wall_s": walls.get(arm),
            "run": {k: v for k, v in read_json(runs / arm / "run.json", {}).items() if k in RUN_KEYS},
        }
    return {
        "machine": machine_info(),
        "tokens": {arm: c["tokens_final"] for arm, c in curves.items()},
        "arms": arms,
        "target": ARM_TARGET,
        "curves": curves,
    }


def compare(
    p: argparse.ArgumentParser,
    args: argparse.Namespace,
    setup: Setup,
    common: list[str],
    runs: Path,
    out_json: Path,
    total_params: int,
) -> int:
    """--overlap / --codecs: run the base arm and its variants (unless --report-only), record and print them."""
    base = "diloco" if args.dilico else "spes"
    overlaps = (
        overlap_variants(args.overlap_steps, args.overlap_correction, args.overlap_fragments, setup.sync_steps)
        if args.overlap
        else {}
    )
    variants = {**overlaps, **codec_variants(args.codecs, overlaps)}
    if unknown := sorted(set(args.only or []) - {base, *variants}):
        p.error(f"--only {unknown}: the arms of this run are {base} and {list(variants)}")
    if args.only:
        variants = {arm: flags for arm, flags in variants.items() if arm in args.only}
    commands = arm_commands(base, setup, common, runs, variants)
    if not args.report_only:
        run_arms(commands, runs)
    vs = "vs_fp32" if args.codecs else "vs_blocking"
    result = compare_arms(commands, runs, base, variants, vs, total_params, args.seed)
    print(f"tokens trained on, as logged by the trainers: {result['tokens']}")
    for arm, r in result["arms"].items():
        print(
            f"{arm:>28}  final val {r['final_val_loss']:.4f}  {100 * r[vs]:+.3f}% {vs}  "
            f"{r['bits_per_param']['last']:.3f} bit/param/round (last)  "
            f"waited {result['curves'][arm]['sync_wait_seconds_peer0']:.1f} s (peer 0)"
        )
    print(f"target: within {100 * ARM_TARGET:g}% of the {base} arm")
    origin = rendered_from(arm_commit(runs / base)) if args.report_only else {}
    write_results(
        out_json,
        {"mode": "quick" if args.quick else "full", "seed": args.seed, "setup": asdict(setup), **result, **origin},
    )
    return 0


def pipeline_args(p: argparse.ArgumentParser, name: str, docs_help: str) -> None:
    """The flags of both mini-reproductions: where the runs and the report go, --report-only and the corpus; --out
    is left unset, as the record's default name depends on the other flags (see `outputs`)."""
    p.add_argument("--runs", type=Path, default=None, help=f"run directory (default: bench/results/{name}[_quick])")
    p.add_argument("--docs", type=Path, default=None, help=docs_help)
    p.add_argument("--report-only", action="store_true", help="only re-collect, re-plot and re-write the report")
    corpus_args(p)
    p.set_defaults(out=None)


def outputs(args: argparse.Namespace, name: str, to_docs: bool) -> tuple[Path, Path, Path]:
    """Where the runs, the report and the record of `name` go unless a flag says: bench/results/<name>/, docs/ if
    `to_docs` (else the runs' folder), and bench/results/<name>.json."""
    runs = args.runs or RESULTS_DIR / name
    return runs, args.docs or (REPO_ROOT / "docs" if to_docs else runs), args.out or RESULTS_DIR / f"{name}.json"


def recorded_machine(run_info: dict[str, Any] | None) -> dict[str, Any]:
    """The machine the runs ran on, as their run.json names it; this one, for runs that did not record it."""
    return (run_info or {}).get("machine") or machine_info()


def arg_parser() -> argparse.ArgumentParser:
    """The command line: the three runs, or with --codecs / --overlap the comparison of a base arm's variants."""
    p = parser("mini_repro", __doc__)
    pipeline_args(p, "mini_repro", "where mini_repro.md/.png go (default: docs/; quick: --runs)")
    p.add_argument(
        "--seed", type=int, default=DEFAULT_SEED, help="model-init and data-order seed (default %(default)s)"
    )
    p.add_argument(
        "--codecs",
        type=codec_choice,
        nargs="+",
        default=[],
        metavar="CODEC",
        help="instead: the base arm on the fp32 wire and on each codec (NAME or NAME:key=value,..., e.g. int8, "
        "sparse:topk=128), compared at equal tokens; with --overlap also each codec on each overlapped schedule",
    )
    p.add_argument("--dilico", action="store_true", help="with --codecs: DiLoCo arms instead of SPES ones")
    p.add_argument(
        "--overlap", action="store_true", help="instead: the SPES arm blocking and with overlap_sync, at equal tokens"
    )
    for flag, kind, initial, metavar, what in (
        ("--overlap_steps", int, None, "D", "delay D (default: sync_steps / F)"),
        ("--overlap_fragments", int, [1], "F", "spes_config.overlap_fragments F (default 1)"),
        ("--overlap_correction", float, [1.0], "C", "spes_config.overlap_correction C (default 1)"),
    ):
        help_ = f"with --overlap: one overlapped arm per {what}, for each value of the other two"
        p.add_argument(flag, type=kind, nargs="+", default=initial, metavar=metavar, help=help_)
    p.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="ARM",
        help="with --overlap or --codecs: record the base arm and only these arms",
    )
    return p


def run_name(args: argparse.Namespace, default: bool) -> str:
    """The name of the runs' folder and record: it says the mode, the seed (unless `default`) and the comparison."""
    name = "mini_repro_quick" if args.quick else "mini_repro" if default else f"mini_repro_seed{args.seed}"
    if args.codecs:
        return name.replace("mini_repro", "mini_repro_codecs" + ("_diloco" if args.dilico else ""), 1)
    if args.overlap:
        return name.replace("mini_repro", "mini_repro_overlap", 1)
    return name


def param_counts(common: list[str]) -> dict[str, int]:
    """The model's parameters, from the runs' config: in total, active per token, and trained by one SPES peer."""
    cfg, _ = load_config(REPO_ROOT / CONFIG, common)
    counts = analytic_param_counts(cfg.model)
    return {
        "total": counts.total,
        "active": counts.active_per_token,
        "spes_trainable": analytic_param_counts(cfg.model, cfg.spes_config.num_train_experts_per_node).trainable,
    }


def checked_runs(runs: Path, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The three runs' curves and what ran them (the last run's command, commit and machine at its end), refused
    unless they trained on equal logged tokens and ran to the end at one commit with the same premises and `seed`."""
    curves = collect(runs)
    check_equal_tokens(curves, runs)
    check_arms_alike(runs, dict.fromkeys(RUNS, {"seed": seed}))
    info = read_json(runs / RUNS[-1] / "run.json", {})
    return curves, {k: v for k, v in info.items() if k in RUN_KEYS}


def print_summary(curves: dict[str, Any], walls: dict[str, float]) -> None:
    """The measured tokens and each run's final loss, traffic and wall time, for the console."""
    print(measured_tokens_line(curves))
    header = f"{'run':>12}  {'final val':>9}  {'vs central':>10}  {'MiB comm':>9}  {'wall s':>7}"
    print(header + "\n" + "-" * len(header))
    base = curves["centralized"]["val_loss"][-1]
    for name in RUNS:
        c = curves[name]
        print(
            f"{name:>12}  {c['val_loss'][-1]:9.4f}  {100 * (c['val_loss'][-1] - base) / base:+9.2f}%  "
            f"{c['bytes'][-1] / 2**20:9.1f}  {walls.get(name, float('nan')):7.0f}"
        )


def results_record(
    args: argparse.Namespace,
    setup: Setup,
    params: dict[str, int],
    machine: dict[str, Any],
    run_info: dict[str, Any] | None,
    walls: dict[str, float],
    curves: dict[str, Any],
) -> dict[str, Any]:
    """The three runs' record in bench/results/, naming the runs' command and commit: not the tree's as the record is
    written (the run has written its report into docs/ by then), nor a --report-only re-render's."""
    return {
        "mode": "quick" if args.quick else "full",
        "seed": args.seed,
        "machine": machine,
        "run": run_info,
        "setup": asdict(setup),
        "params": params,
        "walls_s": walls,
        "tokens": {name: curves[name]["tokens_final"] for name in RUNS},
        "curves": curves,
        **rendered_from((run_info or {}).get("commit")),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the three trainings (or read the last ones), then plot, report and record them; or run a comparison."""
    p = arg_parser()
    args = p.parse_args(argv)
    setup = QUICK if args.quick else FULL
    default = args.seed == DEFAULT_SEED and not args.quick
    runs, docs, out_json = outputs(args, run_name(args, default), to_docs=default)
    check_corpus(args)
    common = setup.overrides(args.tokenizer, args.train, args.valid, args.seed)
    params = param_counts(common)

    runs.mkdir(parents=True, exist_ok=True)
    if args.codecs or args.overlap:
        return compare(p, args, setup, common, runs, out_json, params["total"])
    if not args.report_only:
        run_arms(run_commands(setup, common, runs), runs)
    curves, run_info = checked_runs(runs, args.seed)
    walls = read_json(runs / "walls.json", {})
    machine = recorded_machine(run_info)
    png = docs / "mini_repro.png"
    plot(
        curves,
        png,
        f"{params['total'] / 1e6:.1f}M-parameter MoE, {PEERS} peers, "
        f"{curves['centralized']['tokens_final'] / 1e6:.2f}M tokens per run (measured), "
        f"sync every {setup.sync_steps} steps",
    )
    finals = {args.seed: final_losses(curves), **({} if args.quick else other_seeds(args.seed, run_info["commit"]))}
    md = report(setup, curves, walls, params, machine, png.name, finals, correction=not args.quick)
    write_atomic(docs / "mini_repro.md", md)
    print_summary(curves, walls)
    print(f"wrote {docs / 'mini_repro.md'} and {png}")
    write_results(out_json, results_record(args, setup, params, machine, run_info, walls, curves))
    return 0


if __name__ == "__main__":
    sys.exit(main())
