"""Sparse upcycling: start a spes MoE from a dense Hugging Face Llama- or Qwen3-style checkpoint.

Attention, norms and embeddings are copied (tied embeddings are untied: spes has its own LM head).
The dense SwiGLU MLP (gate, up, down) becomes the experts in one of two ways:

* copy (default): every expert is a full copy of the dense MLP, so `model.mlp_hidden_size` must be
  2 x the dense `intermediate_size` (an expert is mlp_hidden_size / 2 wide; with `mlp_ratio` that is
  mlp_ratio * d_model / 2). The 9B upcycled SPES config does this with Qwen3-1.7B (6144 = 6 * 2048 / 2).
* partition (`--partition`): the dense intermediate dimension is cut into E equal slices and
  expert e holds slice e (gate/up columns, down rows), so the expert width is intermediate_size / E.
  The dense MLP is the sum of all slices.

The router is chosen so that the upcycled model starts out computing the dense model. With a
router that is all zeros every expert has probability 1/E, so each of the k chosen experts gets
the weight u = 1/E without renormalization, or u = k^(-1/p) with p-norm renormalization (1/k for
p=1). Scaling each expert's down projection by s then gives

    copy:       MoE(x) = sum_{k chosen} w_e * s * MLP(x)   -> exact for s = 1 / (k u)
    partition:  MoE(x) = sum_{k chosen} w_e * s * MLP_e(x) -> each slice counts once for s = 1 / u,
                and the sum is the whole MLP only when top_k = E.

With renormalized weights that sum to one (p=1) the copy mode is exact for *any* router, so the
router gets the model's normal random init (s = 1): tokens spread over the experts from the first
step and the copies drift apart. This is the recommended setting (the 9B config uses it).

In the other copy modes exactness needs the zero router, but that start is symmetric: every token
picks the same top-k experts (torch.topk breaks ties the same way each time), and experts with
identical weights and identical router rows receive identical gradients, so they stay tied for good
(seen: 4 experts train as 2 distinct pairs). So these modes default to a tiny random router
(std TIE_BREAKING_STD = 1e-4), which starts within about router_std * sqrt(d_model) (relative) of the
dense model -- 1.5e-5 in the logits of a test model -- and lets the experts separate;
`--router_std 0` gives the exact, tied start. Partition with top_k = E is exact with the zero router
(the slices differ, so nothing is tied); with top_k < E it is an approximation (random router,
s = 1/u): each token sees k of the E slices.

    python -m spes.upcycle --hf path/to/Qwen3-1.7B --config configs/upcycled_9b/node_0.yaml \\
        --out output/spes_upcycled_9b/init/step0 [--partition] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spes.cli import ArgumentParser
from spes.config import load_config
from spes.hf_map import DENSE_MODEL_TYPES
from spes.schema import number_flag


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m spes.upcycle",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        takes_overrides=True,  # every other word: an override of the config
    )
    parser.add_argument(
        "--hf",
        required=True,
        help=f"dense HF model directory or Hub id (e.g. Qwen/Qwen3-1.7B; "
        f"local cache first), model_type one of {sorted(DENSE_MODEL_TYPES)}",
    )
    parser.add_argument("--config", required=True, help="the spes run config (YAML) the MoE is built from")
    parser.add_argument(
        "--out", help="output checkpoint step directory, e.g. output/run/init/step0; point the run's load_path at it"
    )
    parser.add_argument(
        "--partition",
        action="store_true",
        help="split the dense intermediate dim across experts instead of copying it into each",
    )
    parser.add_argument(
        "--router_std",
        type=number_flag(ge=0),
        help="router init std, overriding the automatic choice (see above); 0 = all zeros, the exact "
        "start of the copy modes without sum-to-one top-k weights (experts then stay tied)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace --out (with --make_random_dense: --hf) if it exists"
    )
    parser.add_argument(
        "--make_random_dense",
        choices=sorted(DENSE_MODEL_TYPES),
        help="demo/testing only: write a random dense model of this type that --config can upcycle "
        "to --hf (with the config's tokenizer when it exists), then exit",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    parser.refuse_unknown_flags()
    try:
        cfg, _ = load_config(args.config, overrides)
        if args.out is None and not args.make_random_dense:
            raise ValueError("--out is required: the checkpoint step directory to write, e.g. output/run/init/step0")
        # NOTE: imports torch: only once the command line and the config hold (they are refused in a fraction of a s)
        from spes.upcycling import make_random_dense, upcycle

        if args.make_random_dense:
            tokenizer = Path(cfg.tokenizer.identifier)
            print(
                make_random_dense(
                    cfg.model,
                    args.hf,
                    model_type=args.make_random_dense,
                    partition=args.partition,
                    tokenizer=tokenizer if tokenizer.exists() else None,
                    seed=cfg.seed,
                    overwrite=args.overwrite,
                )
            )
            return 0
        step, plan = upcycle(
            args.hf, cfg, args.out, partition=args.partition, router_std=args.router_std, overwrite=args.overwrite
        )
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    router = f"random, std {plan.router_std:g}" if plan.router_std > 0 else "zeros"
    print(
        f"{step}  (router {router}, down projection x {plan.down_scale:g}, "
        f"{'equals the dense model at step 0' if plan.exact else 'approximates the dense model'})"
    )
    if plan.tied:
        print(
            "note: every expert and every router row starts identical, so they get identical gradients and stay "
            "tied; for training, leave --router_std at its default",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
