"""Train one SPES node (or a centralized / DiLoCo run) from a YAML config.

    # one process, no parameter server (centralized)
    python -m spes.train configs/tiny.yaml --using_spes=false
    # one process, one SPES node (a parameter server must be running)
    python -m spes.train configs/tiny.yaml --spes_config.peer_id=0
    # one node, 4 GPUs (DDP or FSDP2 per `distributed_strategy`)
    torchrun --standalone --nproc_per_node=4 -m spes.train configs/spes_1b/node_0.yaml
    # several nodes: run_scripts/run_single_node.sh <node_id> on each, or run_scripts/run_cluster.sh under SLURM

Any key can be overridden as `--section.key=value`; `--resume` continues from `<save_folder>/latest`, and
`--resume=auto` (`try_load_latest_save: true`) does when a checkpoint exists there and starts fresh otherwise.
OLMo's start from another run's weights: `--load_path=DIR --reset_optimizer_state=true --reset_trainer_state=true`
(`--restore_dataloader=false` keeps the trainer state but restarts the data at step 0). A fresh start into a
save_folder already holding a run's checkpoints or metrics is refused unless `save_overwrite: true`.
A failure the user can cause or meet ends in one line `error: ...` on stderr and a non-zero exit; so does Ctrl-C,
SIGTERM or SIGHUP before the training loop (exit 130), naming the checkpoint a restart continues from, if any. A node
whose output nobody reads any more (`| head`, a closed terminal) trains on, its progress in its metrics.jsonl.

The command line and the config are read and checked here without torch: `--help`, a mistyped key (with its "did you
mean"), a bad override or a missing file are answered in a fraction of a second. The node itself (`spes.node`: its
data, model, checkpoint and the order they are built in) imports torch, and is imported only once the config holds.
"""

from __future__ import annotations

import sys

from spes.cli import print_text
from spes.config import TrainConfig, load_config, passed_over
from spes.failures import exit_code, report
from spes.interrupt import Interruptible, outliving_readers
from spes.schema import ConfigError, config_help

USAGE = """usage: python -m spes.train CONFIG.yaml [--section.key=value ...] [--resume[=auto]]

Train one node of a SPES run (or a centralized / DiLoCo run) described by an OLMo-style YAML file.
  CONFIG.yaml          e.g. configs/tiny.yaml, configs/spes_1b/node_0.yaml
  --section.key=value  override any key, e.g. --spes_config.peer_id=1 --data.seed=6198
  --resume             continue from <save_folder>/latest (same as --load_path=<save_folder>)
  --resume=auto        continue from it if it exists, else start fresh (same as --try_load_latest_save=true)
  --help               this text and every config key with its default
"""


def parse_args(argv: list[str]) -> tuple[str | None, list[str], str | None]:
    """(config file, overrides, resume: None, "always" or "auto")."""
    if any(a in ("-h", "--help") for a in argv):
        print_text(USAGE + "\nconfig keys:\n" + "\n".join(config_help(TrainConfig)))
        raise SystemExit(0)
    positional = [a for a in argv if not a.startswith("--")]
    if len(positional) > 1:
        raise ConfigError(f"expected one config file, got {positional}; overrides must look like --section.key=value")
    flags = [a for a in argv if a == "--resume" or a.startswith("--resume=")]
    if any(a not in ("--resume", "--resume=auto") for a in flags):
        raise ConfigError(f"command line: {flags[0]!r} is not an option; use --resume or --resume=auto")
    overrides = [a for a in argv if a.startswith("--") and a not in flags]
    resume = None if not flags else ("auto" if flags[-1] == "--resume=auto" else "always")
    return (positional[0] if positional else None), overrides, resume


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with Interruptible():
        try:
            path, overrides, resume = parse_args(argv)
            if path is None:
                raise ConfigError("no config file given; try: python -m spes.train configs/tiny.yaml (or --help)")
            cfg, inert = load_config(path, overrides)
            ignored = f"note: these config keys change nothing in spes and are ignored: {', '.join(inert)}"
            with outliving_readers(unread(cfg)):
                return run(cfg, ([ignored] if inert else []) + apply_resume(cfg, resume))
        except (Exception, KeyboardInterrupt) as e:  # NOTE: not --help's SystemExit
            if exit_code(e) is None:
                raise
            return report(e)


def unread(cfg: TrainConfig) -> str:
    """What a node says when its output's reader goes away (`| head`, `less` quit, a closed terminal): it trains on."""
    return (
        f"note: nobody reads this node's output any more: it trains on, its progress in {cfg.save_folder}/"
        "metrics.jsonl; Ctrl-C or SIGTERM saves a checkpoint and stops it"
    )


def apply_resume(cfg: TrainConfig, resume: str | None) -> list[str]:
    """`--resume` as config keys (load_path <- save_folder; `auto`: try_load_latest_save), and a note when that
    passes over the YAML's own load_path (the weights the run started from): OLMo does so without a word."""
    cfg.try_load_latest_save |= resume == "auto"
    if resume != "always":
        return []
    note = passed_over(cfg)
    cfg.load_path = cfg.save_folder
    return [note] if note else []


def run(cfg: TrainConfig, notes: list[str] | None = None) -> int:
    """Train `cfg` on this process (`spes.node.run`: one rank of a torchrun job), imported once the config holds."""
    from spes.node import run as run_node

    return run_node(cfg, notes)


if __name__ == "__main__":
    raise SystemExit(main())
