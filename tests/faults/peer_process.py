"""A peer as its own process, for tests that SIGKILL it: joins, syncs the given rounds, saves what it got.

    python tests/faults/peer_process.py --addr 127.0.0.1:PORT --peer 1 --num_peers 2 --steps 1 2 --out DIR

A restarted process passes `--run_id` (the run it belongs to, as a node resumed from its checkpoint knows it). The
token comes from SPES_TOKEN. Round `s` uploads `peer_upload(spec, peer, seed=s)`
(tests/sync_helpers.py), so a restarted process sends exactly what the killed one would have; each round's
download lands in DIR/round-<s>.safetensors.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sync_helpers import make_client, peer_upload, tiny_spec  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--addr", required=True)
    parser.add_argument("--peer", type=int, required=True)
    parser.add_argument("--num_peers", type=int, default=2)
    parser.add_argument("--mode", default="spes", choices=("spes", "diloco"))
    parser.add_argument("--width", type=int, default=8, help="d_model of tiny_spec's model (expert width is half)")
    parser.add_argument("--steps", type=int, nargs="+", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--run_id", default=None, help="the run this peer belongs to (default: it starts fresh)")
    parser.add_argument("--round_timeout_s", type=float, default=60, help="spes_config.round_timeout_s")
    args = parser.parse_args()
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = tiny_spec(mode=args.mode, num_peers=args.num_peers, d=args.width, f=max(1, args.width // 2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with make_client(
        args.addr,
        spec,
        args.peer,
        token=os.environ.get("SPES_TOKEN"),
        rpc_timeout_s=10,
        round_timeout_s=args.round_timeout_s,
        max_retries=8,
        run_id=args.run_id,
    ) as client:
        client.join()
        for step in args.steps:
            got, stats = client.sync(step, peer_upload(spec, args.peer, seed=step))
            save_file(got, str(out / f"round-{step}.safetensors"))
            print(f"round {step} done: up {stats.bytes_up} down {stats.bytes_down}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
