"""Hugging Face export and import of spes checkpoints, through one declarative key map.

The command line: `--help`, a usage error or a bad flag value is answered without torch; the key map is
`spes.hf_map`, and the conversion (`spes.hf_convert`, which imports torch) is imported once the arguments hold and,
for an export, name a checkpoint (found by `spes.save_folder`, torch-free: a missing folder or step is refused
without torch too).

Commands (see `--help`):
    python -m spes.hf export --checkpoint output/run/node0/step1000 --out hf/run-step1000
    python -m spes.hf export --run_dir output/run/node0 --step latest --out hf/run-latest
    python -m spes.hf import --hf path/to/OLMoE-1B-7B --out output/olmoe-init/step0 --num_train_experts_per_node 16
    python -m spes.hf import --hf allenai/OLMoE-1B-7B-0924 --out output/olmoe-init/step0   # a Hub id
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spes.atomic import OutOfRoom, room_for
from spes.cli import ArgumentParser
from spes.hf_map import EXPORT_DTYPES, FAMILIES
from spes.interrupt import outliving_readers
from spes.save_folder import resolve_checkpoint, resolve_step
from spes.schema import number_flag


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m spes.hf",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="spes checkpoint -> Hugging Face model directory")
    where = exp.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--checkpoint",
        help="a checkpoint step directory (<save_folder>/step<N>), or a save folder (its latest checkpoint)",
    )
    where.add_argument("--run_dir", help="a save folder; the step comes from --step")
    exp.add_argument("--step", default="latest", help="with --run_dir: a step number or 'latest' (default)")
    exp.add_argument("--out", required=True, help="output Hugging Face model directory")
    exp.add_argument("--tokenizer", help="tokenizer directory (default: the run config's tokenizer.identifier)")
    exp.add_argument("--dtype", default="float32", choices=sorted(EXPORT_DTYPES), help="weight dtype (default float32)")
    exp.add_argument(
        "--max_shard_gb", type=number_flag(gt=0), default=5.0, help="largest safetensors shard in GiB (default 5)"
    )
    exp.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    imp = sub.add_parser("import", help="Hugging Face MoE directory -> spes checkpoint step directory")
    imp.add_argument(
        "--hf",
        required=True,
        help=f"HF model directory or Hub id (local cache first, see spes.hub), model_type one of {sorted(FAMILIES)}",
    )
    imp.add_argument(
        "--out",
        required=True,
        help="output checkpoint step directory, e.g. output/myrun/step0 (the tokenizer goes to output/myrun/tokenizer)",
    )
    imp.add_argument(
        "--num_train_experts_per_node",
        type=number_flag(int, ge=1),
        help="experts per stored block: spes_config.num_train_experts_per_node of the SPES run (default: all experts "
        "in one block)",
    )
    imp.add_argument(  # former names, still accepted; one name in --help
        "--experts_per_peer",
        "--block_size",
        dest="num_train_experts_per_node",
        type=number_flag(int, ge=1),
        help=argparse.SUPPRESS,
    )
    imp.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with room_for(
            f"--out {args.out}: cannot write the {args.command}",
            "nothing half-written is left (what --out held before is untouched); free space on that disk or choose "
            "another --out",
        ):
            out = run(args)
    except (ValueError, FileNotFoundError, FileExistsError, OutOfRoom) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


def run(args: argparse.Namespace) -> Path:
    """Export or import as the command line says; spes.hf_convert (torch) is imported here, once it holds (for an
    export, once it names a checkpoint)."""
    if args.command == "export":
        step = resolve_checkpoint(args.checkpoint) if args.checkpoint else resolve_step(args.run_dir, args.step)
        from spes.hf_convert import export_checkpoint

        return export_checkpoint(
            step,
            args.out,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            overwrite=args.overwrite,
            max_shard_bytes=int(args.max_shard_gb * 1024**3),
        )
    from spes.hf_convert import import_hf

    return import_hf(
        args.hf,
        args.out,
        num_train_experts_per_node=args.num_train_experts_per_node,
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    with outliving_readers(None):  # NOTE: `| head` ended a finished export in a BrokenPipeError traceback
        raise SystemExit(main())
