"""`python -m spes.unshard <sharded checkpoint> <out dir>`: a sharded (FSDP) checkpoint -> the unsharded layout.

    python -m spes.unshard output/spes_1b/node0/step1000-sharded output/spes_1b/node0/step1000
    python -m spes.unshard output/spes_1b/node0 /tmp/node0_latest      # a save folder: its `latest`

Runs in one process on the CPU, whatever the number of ranks that wrote the checkpoint. The output holds
the same model, optimizer and trainer state (model.safetensors, optim.safetensors, meta.json,
config.yaml), so it can be exported to Hugging Face, evaluated, or resumed with any number of ranks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spes.cli import ArgumentParser
from spes.save_folder import CheckpointError, resolve_checkpoint


def main(argv: list[str] | None = None) -> int:
    summary, details = __doc__.split("\n\n", 1)
    parser = ArgumentParser(
        prog="python -m spes.unshard",
        description=summary,
        epilog=details,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("sharded", help="a step<N>-sharded directory, or a save folder whose `latest` is one")
    parser.add_argument("out_dir", help="where to write the unsharded checkpoint (must not exist yet)")
    args = parser.parse_args(argv)
    try:
        out = _unshard(args.sharded, args.out_dir)
    except (CheckpointError, OSError) as e:  # NOTE: OSError: a missing or existing path, a full disk
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote unsharded checkpoint {out}")
    return 0


def _unshard(sharded: str, out_dir: str) -> Path:
    """`spes.checkpoint.unshard`, which imports torch: only once the command line holds and `sharded` names a
    checkpoint (`--help`, a usage error and a path that names none are answered without it)."""
    src = resolve_checkpoint(sharded)
    from spes.checkpoint import unshard

    return unshard(src, out_dir)


if __name__ == "__main__":
    raise SystemExit(main())
