#!/usr/bin/env python
"""Mini-reproduction, part 2: the comparison SPES is about, at equal model-state memory per node.

    .venv/bin/python bench/mini_repro_memory.py                # all arms, seeds 6198 and 7: runs, plot, report
    .venv/bin/python bench/mini_repro_memory.py --report-only  # re-collect and re-write from the last runs
    .venv/bin/python bench/mini_repro_memory.py --quick        # smoke run of the same pipeline (what CI runs)

SPES exists because a node that trains only its own experts holds gradients and AdamW moments for far fewer
parameters, so the same GPU trains a larger MoE. Here a node's budget is the model-state bytes (fp32
weights + gradients + AdamW state) of a node training the whole `--small_experts`-expert model, as a DiLoCo
node must; a SPES node holds every expert's weights but trains only its block, so it gets the largest
expert count (a multiple of the 4 peers) whose node fits the same budget. Both are measured, not assumed:
the real model and AdamW are built and take a training step (bench/bench_memory.py's code). Everything
else is equal in every arm: width, layers, top-k and expert width (the same active parameters and FLOPs
per token), steps, batch, learning-rate schedule, data and seeds (mini_repro.py's setup, validated on
256 windows).

Arms (all at equal tokens, checked on the trainers' own counters, except the single node):
  spes_large           SPES at the large model (fits the budget)
  diloco_small         DiLoCo, plain mean of the uploads (the paper's baseline) at the model that fits
  diloco_nesterov      DiLoCo with Nesterov outer steps at the model that fits (an extra, not the paper's)
  centralized_large    one trainer, 4x batch, at the large model (the upper reference: it needs a cluster)
  diloco_large         DiLoCo at the large model: over the budget (what DiLoCo would reach if memory allowed)
  spes_large_nomerge   SPES at the large model without the merge warm-up
  single_small         one node alone at the model that fits, with a peer's batch and data (the floor; it
                       trains on a quarter of the tokens, checked equal to one peer's)

The report gives final losses per seed and their mean, gaps at 25%, 50% and 100% of the run, curves against
tokens and against bytes communicated, and the SPES-specific cost (SPES minus DiLoCo at the same model)
separately. Outputs: `<runs>/seed<S>/<arm>/`, `bench/results/mini_repro_memory.json`, and
`mini_repro_memory.md`/`.png` in `--docs` (default docs/; quick: the run directory).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from bench_memory import build, tensor_bytes, train_steps
from common import MIB, REPO_ROOT, check_corpus, git_commit, machine_info, parser, write_results
from mini_repro import (
    CONFIG,
    DEFAULT_SEED,
    FULL,
    PEERS,
    QUICK,
    Commands,
    Setup,
    central_curve,
    check_arms_alike,
    config_facts,
    outputs,
    pct,
    peers_curve,
    pipeline_args,
    read_json,
    recorded_machine,
    rendered_from,
    run_arms,
)
from spes.atomic import write_atomic
from spes.config import load_config
from spes.optim import optimizer_state_bytes

SEEDS = (DEFAULT_SEED, 7)
FRACTIONS = (0.25, 0.5, 1.0)
VALIDATION_WINDOWS = 256
EVAL_INTERVAL = 50  # steps; 400-step runs are evaluated at 50, 100, ..., 400


@dataclass(frozen=True)
class Arm:
    """One training run of the comparison."""

    name: str
    label: str
    mode: str  # "spes" | "diloco" | "central" | "single"
    size: str  # "small" | "large"
    overrides: tuple[str, ...] = ()
    """The arm's own run-config overrides, after the shared ones (a later override of a key wins)."""
    over_budget: bool = False


ARMS = (
    Arm("spes_large", "SPES, large model", "spes", "large"),
    Arm("diloco_small", "DiLoCo (mean), model that fits", "diloco", "small"),
    Arm(
        "diloco_nesterov",
        "DiLoCo + Nesterov outer steps, model that fits (extra)",
        "diloco",
        "small",
        ("--server.outer_optimizer=nesterov",),
    ),
    Arm("centralized_large", "centralized, large model (needs a cluster)", "central", "large"),
    Arm("diloco_large", "DiLoCo (mean), large model: OVER the budget", "diloco", "large", over_budget=True),
    Arm("spes_large_nomerge", "SPES, large model, no merge warm-up", "spes", "large", ("--server.merge_interval=0",)),
    Arm("single_small", "one node alone, model that fits (1/4 of the tokens)", "single", "small"),
)
BASELINE, SPES_ARM = "diloco_small", "spes_large"


def expert_overrides(experts: int) -> list[str]:
    """A model with `experts` experts per layer, each of the peers owning a quarter."""
    return [f"--model.moe_num_experts={experts}", f"--spes_config.num_train_experts_per_node={experts // PEERS}"]


def model_state_bytes(overrides: list[str]) -> dict[str, int]:
    """Measured bytes of one node's model state: weights, gradients after a backward, AdamW state after a step."""
    cfg, _ = load_config(REPO_ROOT / CONFIG, overrides)
    torch.manual_seed(0)
    model, optimizer = build(cfg)
    grad_bytes, _ = train_steps(cfg, model, optimizer, steps=1)
    weights = tensor_bytes(list(model.parameters()))
    optim = optimizer_state_bytes(optimizer)
    return {"weights": weights, "grads": grad_bytes, "optimizer": optim, "total": weights + grad_bytes + optim}


def pick_sizes(common: list[str], small: int) -> dict[str, Any]:
    """The budget (a full-model node at `small` experts) and the largest SPES model that fits it.

    Candidates are multiples of the peer count from `small` to 4x `small`; each is measured.
    """
    full = ["--using_spes=false"]
    budget = model_state_bytes([*common, *full, *expert_overrides(small)])
    spes_nodes = {e: model_state_bytes([*common, *expert_overrides(e)]) for e in range(small, 4 * small + 1, PEERS)}
    fitting = [e for e, b in spes_nodes.items() if b["total"] <= budget["total"]]
    if not fitting:
        raise SystemExit(f"error: not even a {small}-expert SPES node fits the budget of a full {small}-expert node")
    large = max(fitting)
    return {
        "small": small,
        "large": large,
        "budget": budget,
        "spes_nodes": spes_nodes,
        "full_large": model_state_bytes([*common, *full, *expert_overrides(large)]),
    }


def arm_commands(setup: Setup, common: list[str], sizes: dict[str, Any], out: Path) -> Commands:
    """The command of every arm (one torch thread per process, as in mini_repro.py)."""
    py = sys.executable
    one_thread = {"OMP_NUM_THREADS": "1"}
    commands: Commands = {}
    for arm in ARMS:
        model = [*common, *expert_overrides(sizes[arm.size])]
        if arm.mode in ("central", "single"):
            batch = PEERS * setup.peer_batch if arm.mode == "central" else setup.peer_batch
            commands[arm.name] = (
                [
                    py,
                    "-m",
                    "spes.train",
                    CONFIG,
                    *model,
                    "--using_spes=false",
                    f"--global_train_batch_size={batch}",
                    f"--save_folder={out / arm.name}",
                ],
                one_thread,
            )
        else:
            launch = [
                py,
                "-m",
                "spes.launch",
                CONFIG,
                "--threads",
                "1",
                "--timeout",
                "7200",
                "--eval_peers",
                "1",
                *(["--dilico"] if arm.mode == "diloco" else []),
                "--out",
                str(out / arm.name),
            ]
            # NOTE: a later override of a key wins, so an arm's own --server.merge_interval replaces the shared one
            commands[arm.name] = ([*launch, "--", *model, *setup.merge_overrides(), *arm.overrides], {})
    return commands


def run_schedule(setup: Setup, sizes: dict[str, Any], args: Any, seeds: Sequence[int], runs: Path) -> list[str]:
    """Every arm of every seed (keyed `seed<S>/<arm>`) but those already complete (mini_repro.run_arms); the arms run.

    A SPES or DiLoCo arm (a server and 4 peers) fills both cores and runs alone; the one-process arms
    (centralized, single node) use one core each, so they run two at a time, across seeds.
    """
    jobs: Commands = {}
    for seed in seeds:
        common = setup.overrides(args.tokenizer, args.train, args.valid, seed)
        commands = arm_commands(setup, common, sizes, runs / f"seed{seed}")
        jobs.update({f"seed{seed}/{name}": command for name, command in commands.items()})
    one_process = {arm.name for arm in ARMS if arm.mode in ("central", "single")}
    several = {k: v for k, v in jobs.items() if k.split("/")[1] not in one_process}
    single = {k: v for k, v in jobs.items() if k.split("/")[1] in one_process}
    return [*run_arms(several, runs), *run_arms(single, runs, lanes=2)]


def collect(out: Path) -> dict[str, Any]:
    """Every arm's curve (tokens from the trainers' own counters)."""
    return {
        arm.name: central_curve(out / arm.name) if arm.mode in ("central", "single") else peers_curve(out / arm.name)
        for arm in ARMS
    }


def check_tokens(curves: dict[str, Any], where: Path) -> None:
    """Refuse to report unless every equal-token arm trained on the centralized run's tokens and the single node
    on one peer's."""
    want = curves["centralized_large"]["tokens_final"]
    for arm in ARMS:
        got = curves[arm.name]["tokens_final"]
        expected = want // PEERS if arm.mode == "single" else want
        if got != expected:
            raise SystemExit(
                f"error: arm {arm.name} in {where} trained on {got:,} tokens, expected {expected:,} "
                f"(centralized_large: {want:,}). No report written."
            )


def loss_at(curve: dict[str, Any], fraction: float, steps: int) -> float:
    """Validation loss at the evaluated step nearest to `fraction` of the run."""
    target = fraction * steps
    i = min(range(len(curve["step"])), key=lambda j: abs(curve["step"][j] - target))
    return curve["val_loss"][i]


def mean_curve(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Step-wise mean over seeds of one arm's curve (every seed evaluates at the same steps): every field, not only
    the validation loss, so no field of the mean is one seed's value. A number is averaged, a list elementwise;
    values equal in every seed (steps, tokens) are kept as they are."""

    def mean(values: list[Any]) -> Any:
        if all(v == values[0] for v in values):
            return values[0]
        if isinstance(values[0], list):
            return [mean(list(v)) for v in zip(*values, strict=True)]
        if all(isinstance(v, int | float) for v in values):
            return sum(values) / len(values)
        raise ValueError(f"no mean of {values!r}")

    return {key: mean([c[key] for c in per_seed]) for key in per_seed[0]}


def crossing(a: dict[str, Any], b: dict[str, Any]) -> int | None:
    """The first evaluated step after which the sign of (a - b) differs from the sign at the start; None if never."""
    diffs = [x - y for x, y in zip(a["val_loss"], b["val_loss"])]
    for step, before, after in zip(a["step"][1:], diffs, diffs[1:]):
        if (before < 0) != (after < 0):
            return step
    return None


def plot(means: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """Two panels: mean validation loss against tokens, and against bytes communicated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    for i, arm in enumerate(ARMS):
        c = means[arm.name]
        look = {"color": f"C{i}", "marker": "o", "ms": 3, "label": arm.label}  # one colour per arm in both panels
        style = "--" if arm.over_budget or arm.mode in ("central", "single") else "-"
        ax_t.plot([t / 1e6 for t in c["tokens"]], c["val_loss"], style, **look)
        if arm.mode in ("spes", "diloco"):
            ax_b.plot([b / 2**20 for b in c["bytes"]], c["val_loss"], style, **look)
    ax_t.set_xlabel("training tokens seen by the whole run (millions, as logged)")
    ax_b.set_xlabel("bytes communicated, all peers, up + down (MiB, fp32 wire)")
    for ax in (ax_t, ax_b):
        ax.set_ylabel("validation loss (mean over seeds)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".")))
    plt.close(fig)


def node_row(label: str, experts: int, b: dict[str, int], budget: int) -> str:
    """One node's measured model-state bytes as a row of the budget table, and whether it fits `budget`."""
    return (
        f"| {label} | {experts} | {b['weights'] / MIB:.2f} | {b['grads'] / MIB:.2f} | "
        f"{b['optimizer'] / MIB:.2f} | {b['total'] / MIB:.2f} | {'yes' if b['total'] <= budget else 'NO'} |"
    )


def sizes_section(sizes: dict[str, Any]) -> list[str]:
    """The report's "Budget and sizes" section: the measured budget and the SPES model it allows."""
    budget = sizes["budget"]["total"]
    spes_node = sizes["spes_nodes"][sizes["large"]]["total"]
    return [
        "## Budget and sizes (measured)",
        "",
        "| node | experts per layer | weights MiB | gradients MiB | AdamW MiB | total MiB | within budget |",
        "|---|---|---|---|---|---|---|",
        node_row("full model (DiLoCo / centralized) = the budget", sizes["small"], sizes["budget"], budget),
        node_row("SPES peer", sizes["large"], sizes["spes_nodes"][sizes["large"]], budget),
        node_row("full model at the large size", sizes["large"], sizes["full_large"], budget),
        "",
        f"SPES nodes measured for {', '.join(str(e) for e in sizes['spes_nodes'])} experts; the largest "
        f"within the {budget / MIB:.2f} MiB budget is {sizes['large']} ({spes_node / MIB:.2f} MiB).",
        "",
    ]


def setup_lines(setup: Setup, seeds: list[int], machine: dict[str, Any], total_wall_s: float | None) -> list[str]:
    """The report's setup and schedule paragraphs: what every arm shares, and how long the whole comparison took."""
    top_k = config_facts(setup)["top_k"]
    return [
        f"Setup: mini_repro.py's model otherwise (d_model {setup.d_model}, {setup.n_layers} layers, top-{top_k}, "
        f"expert width {setup.mlp_hidden_size // 2}, sequence {setup.seq_len}), {setup.steps} steps, peer "
        f"batch {setup.peer_batch}, sync every {setup.sync_steps} steps, validation on "
        f"{setup.eval_batches * setup.eval_batch_size} windows; seeds {', '.join(map(str, seeds))}; "
        f"{machine['cpus']} CPU cores, load average {machine['load_avg_1_5_15'][0]} at the start.",
        "",
        "Schedule: a SPES or DiLoCo arm (a server and 4 peers, one torch thread each) runs alone; the one-process "
        "arms (centralized, single node) run two at a time; only peer 0 runs the validation evaluations "
        "(`spes.launch --eval_peers 1`: after a sync every peer holds the same model). "
        + (
            f"**The whole comparison ({len(ARMS)} arms x {len(seeds)} seeds) took {total_wall_s / 60:.0f} min.**"
            if total_wall_s is not None
            else "The whole comparison's wall time was not measured in one go (it was resumed): see each arm's."
        ),
        "",
    ]


def finals_table(
    sizes: dict[str, Any],
    per_seed: dict[int, dict[str, Any]],
    means: dict[str, Any],
    walls: dict[int, dict[str, float]],
) -> list[str]:
    """The report's "Final validation loss" section: every arm's end point per seed and on average, against DiLoCo's
    at the budget."""
    seeds = sorted(per_seed)
    any_seed = per_seed[seeds[0]]
    lines = [
        "## Final validation loss",
        "",
        "| arm | experts | tokens (logged) | "
        + " | ".join(f"seed {s}" for s in seeds)
        + " | mean | vs DiLoCo at the budget | MiB communicated | wall s (each seed) |",
        "|---|---|---|" + "---|" * len(seeds) + "---|---|---|---|",
    ]
    base = means[BASELINE]["val_loss"][-1]
    for arm in ARMS:
        mean = means[arm.name]["val_loss"][-1]
        finals = " | ".join(f"{per_seed[s][arm.name]['val_loss'][-1]:.4f}" for s in seeds)
        comm = any_seed[arm.name]["bytes"][-1] / MIB
        wall = ", ".join(f"{walls[s].get(arm.name, float('nan')):.0f}" for s in seeds)
        lines.append(
            f"| {arm.label} | {sizes[arm.size]} | {any_seed[arm.name]['tokens_final']:,} | {finals} | "
            f"{mean:.4f} | {pct(mean, base)} | {comm:,.0f} | {wall} |"
        )
    return [*lines, ""]


def gaps_table(means: dict[str, Any], steps: int) -> list[str]:
    """The report's "Gaps" section: each comparison of two arms' mean curves at 25%, 50% and 100% of the run."""

    def gap_row(label: str, a: str, b: str) -> str:
        cells = [pct(loss_at(means[a], f, steps), loss_at(means[b], f, steps)) for f in FRACTIONS]
        return f"| {label} | " + " | ".join(cells) + " |"

    return [
        "## Gaps during the run (mean over seeds)",
        "",
        "| comparison | " + " | ".join(f"{int(100 * f)}% of the run" for f in FRACTIONS) + " |",
        "|---|" + "---|" * len(FRACTIONS),
        gap_row("SPES (large) vs DiLoCo (model that fits): the equal-memory comparison", SPES_ARM, BASELINE),
        gap_row("SPES (large) vs centralized (large)", SPES_ARM, "centralized_large"),
        gap_row("DiLoCo (model that fits) vs centralized (large)", BASELINE, "centralized_large"),
        gap_row("DiLoCo + Nesterov vs DiLoCo (model that fits)", "diloco_nesterov", BASELINE),
        gap_row("SPES-specific cost: SPES vs DiLoCo at the same (large) model", SPES_ARM, "diloco_large"),
        gap_row("merge warm-up: SPES vs SPES without it", SPES_ARM, "spes_large_nomerge"),
        gap_row("SPES (large) vs one node alone", SPES_ARM, "single_small"),
        "",
    ]


def verdict(per_seed: dict[int, dict[str, Any]], means: dict[str, Any]) -> list[str]:
    """The report's conclusion: whether SPES beats DiLoCo at equal memory in every seed, and where the curves cross."""
    seeds = sorted(per_seed)
    base = means[BASELINE]["val_loss"][-1]
    gaps = [per_seed[s][SPES_ARM]["val_loss"][-1] - per_seed[s][BASELINE]["val_loss"][-1] for s in seeds]
    if all(g < 0 for g in gaps):
        claim = "SPES at equal memory ends below DiLoCo in every seed"
    elif all(g > 0 for g in gaps):
        claim = "SPES at equal memory does NOT beat DiLoCo: it ends above it in every seed"
    else:
        claim = "No consistent winner at equal memory: the sign of SPES minus DiLoCo differs between seeds"
    cross = crossing(means[SPES_ARM], means[BASELINE])
    return [
        f"**{claim}** (mean {pct(means[SPES_ARM]['val_loss'][-1], base)} at the end; per seed "
        + ", ".join(f"{s}: {g:+.4f} nats" for s, g in zip(seeds, gaps))
        + "); "
        + (
            f"the mean curves cross at step {cross}."
            if cross is not None
            else "the mean curves do not cross within the run."
        ),
        "",
    ]


def report(
    setup: Setup,
    sizes: dict[str, Any],
    per_seed: dict[int, dict[str, Any]],
    means: dict[str, Any],
    walls: dict[int, dict[str, float]],
    machine: dict[str, Any],
    total_wall_s: float | None,
    png: str,
) -> str:
    """The markdown report: budget, arms, gaps at 25/50/100%, the SPES-specific cost, where curves cross."""
    lines = [
        "# Mini-reproduction at equal memory per node",
        "",
        "Generated by `bench/mini_repro_memory.py`. Every node gets the same model-state budget (fp32 weights + "
        "gradients + AdamW state, measured); a DiLoCo node must train the whole model, a SPES node only its "
        "expert block, so SPES gets a larger MoE at the same active parameters per token.",
        "",
        *sizes_section(sizes),
        *setup_lines(setup, sorted(per_seed), machine, total_wall_s),
        *finals_table(sizes, per_seed, means, walls),
        f"![validation loss against tokens and bytes]({png})",
        "",
        *gaps_table(means, setup.steps),
        *verdict(per_seed, means),
    ]
    return "\n".join(lines)


def arg_parser() -> argparse.ArgumentParser:
    """The command line: mini_repro.py's run and corpus flags, the seeds, and the expert count that sets the budget."""
    p = parser("mini_repro_memory", __doc__)
    pipeline_args(p, "mini_repro_memory", "report and plot folder (default: docs/; quick: --runs)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help=f"seeds (default: {SEEDS}; quick: the first)")
    p.add_argument("--small_experts", type=int, default=8, help="experts of the full model that sets the budget")
    return p


def memory_setup(quick: bool) -> Setup:
    """The runs' sizes: mini_repro.py's, but validated on 256 windows every 50 steps (quick: mini_repro.py's own)."""
    # NOTE: 256 validation windows (4x mini_repro.py's) but every 50 steps instead of 20, so that the 14 runs stay
    # under an hour on 2 cores (the record's run.total_wall_s, docs/benchmarks.md 6b) with 25/50/100% on evaluated
    # steps.
    if quick:
        return QUICK
    return replace(FULL, eval_batches=VALIDATION_WINDOWS // FULL.eval_batch_size, eval_interval=EVAL_INTERVAL)


def run_and_record(
    setup: Setup, sizes: dict[str, Any], args: argparse.Namespace, seeds: Sequence[int], runs: Path
) -> None:
    """Run every arm of every seed, then keep the wall times and what ran them in `runs` for --report-only."""
    started, machine_before = time.time(), machine_info()
    ran = run_schedule(setup, sizes, args, seeds, runs)
    run_info = {
        "command": " ".join([sys.executable, *sys.argv]),
        "commit": git_commit(),
        "machine": machine_before,
        "machine_after": machine_info(),
        # NOTE: a resumed comparison's wall time is not the whole comparison's
        "total_wall_s": time.time() - started if len(ran) == len(ARMS) * len(seeds) else None,
    }
    write_atomic(runs / "run.json", json.dumps(run_info, indent=1) + "\n")


def seed_walls(walls_s: dict[str, float], seeds: Sequence[int]) -> dict[int, dict[str, float]]:
    """walls.json's wall seconds (keyed `seed<S>/<arm>`) per seed and arm, for the arms that have one."""
    return {
        seed: {arm.name: walls_s[f"seed{seed}/{arm.name}"] for arm in ARMS if f"seed{seed}/{arm.name}" in walls_s}
        for seed in seeds
    }


def collect_seeds(runs: Path, seeds: Sequence[int], sizes: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], str]:
    """Every seed's curves and the arms' one commit, refused unless every arm trained on the tokens it should and
    all ran to the end at one commit with the same premises but for their expert count (`sizes`) and seed."""
    per_seed: dict[int, dict[str, Any]] = {}
    expect = {f"seed{s}/{a.name}": {"seed": s, "model.moe_num_experts": sizes[a.size]} for s in seeds for a in ARMS}
    commit = check_arms_alike(runs, expect, vary=("seed", "data.seed", "model.moe_num_experts"))
    for seed in seeds:
        out = runs / f"seed{seed}"
        per_seed[seed] = collect(out)
        check_tokens(per_seed[seed], out)
    return per_seed, commit


def results_record(
    args: argparse.Namespace,
    setup: Setup,
    seeds: Sequence[int],
    sizes: dict[str, Any],
    machine: dict[str, Any],
    run_info: dict[str, Any] | None,
    walls: dict[int, dict[str, float]],
    per_seed: dict[int, dict[str, Any]],
    means: dict[str, Any],
) -> dict[str, Any]:
    """The comparison's record in bench/results/: every seed's curves and their means, from which tables.py re-renders
    the report. It names the runs' command and commit, not the tree's as the record is written (the run has written
    its report into docs/ by then) nor a --report-only re-render's (as mini_repro's)."""
    return {
        "mode": "quick" if args.quick else "full",
        "seeds": seeds,
        "machine": machine,
        "run": run_info,
        "setup": asdict(setup),
        "sizes": sizes,
        "arms": [asdict(a) for a in ARMS],
        "walls_s": walls,
        "tokens": {a.name: per_seed[seeds[0]][a.name]["tokens_final"] for a in ARMS},
        "curves": per_seed,
        "mean_curves": means,
        **rendered_from((run_info or {}).get("commit")),
    }


def main(argv: list[str] | None = None) -> int:
    """Size the models, run every arm of every seed (or read the last runs), then plot, report and record them."""
    args = arg_parser().parse_args(argv)
    if args.small_experts < PEERS or args.small_experts % PEERS:
        raise SystemExit(f"error: --small_experts={args.small_experts} must be a positive multiple of {PEERS}")
    setup = memory_setup(args.quick)
    seeds = args.seeds or (SEEDS[:1] if args.quick else SEEDS)
    name = "mini_repro_memory_quick" if args.quick else "mini_repro_memory"
    runs, docs, out_json = outputs(args, name, to_docs=not args.quick)

    check_corpus(args)
    sizes = pick_sizes(setup.overrides(args.tokenizer, args.train, args.valid, seeds[0]), args.small_experts)
    print(
        f"budget {sizes['budget']['total']:,} bytes (full {sizes['small']}-expert node); SPES fits "
        f"{sizes['large']} experts ({sizes['spes_nodes'][sizes['large']]['total']:,} bytes)",
        flush=True,
    )
    if not args.report_only:
        run_and_record(setup, sizes, args, seeds, runs)
    walls = seed_walls(read_json(runs / "walls.json", {}), seeds)
    per_seed, commit = collect_seeds(runs, seeds, sizes)
    run_info = {**read_json(runs / "run.json", {}), "commit": commit}
    machine = recorded_machine(run_info)
    means = {arm.name: mean_curve([per_seed[s][arm.name] for s in seeds]) for arm in ARMS}
    png = docs / "mini_repro_memory.png"
    plot(
        means,
        png,
        f"equal model-state memory per node: DiLoCo {sizes['small']} experts vs SPES {sizes['large']}, "
        f"{PEERS} peers, {len(seeds)} seed(s)",
    )
    md = report(setup, sizes, per_seed, means, walls, machine, (run_info or {}).get("total_wall_s"), png.name)
    write_atomic(docs / "mini_repro_memory.md", md)
    print(md)
    write_results(out_json, results_record(args, setup, seeds, sizes, machine, run_info, walls, per_seed, means))
    return 0


if __name__ == "__main__":
    sys.exit(main())
