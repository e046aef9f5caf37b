"""In-process SPES peers of configs/tiny.yaml (2 peers of 4 experts each, a round every 2 steps, 8 steps), started as
`python -m spes.train` starts them: for the tests that hold a real trainer and its syncer in their hands."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spes.config import TrainConfig, load_config
from spes.distributed import DistInfo
from spes.node import start_node
from spes.trainer import Trainer

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
QUIET = lambda _m: None  # noqa: E731
MERGE = [
    "--server.merge_interval=4",
    "--server.merge_alpha_start=0.05",
    "--server.merge_decay_steps=100",
    "--server.merge_topk=2",
]
"""The server's merge warm-up of these peers' runs: every 4 steps (the nodes' copy of the section is not compared)."""


def peer_overrides(corpus: Any, folder: Path, addr: str, peer: int, *extra: str) -> list[str]:
    """Peer `peer` of 2 (4 experts each) of configs/tiny.yaml, syncing every 2 steps, 8 steps; then `extra`."""
    return [
        *corpus.overrides(folder / f"node{peer}"),
        f"--spes_config.peer_id={peer}",
        "--spes_config.num_peers=2",
        "--spes_config.num_train_experts_per_node=4",
        f"--spes_config.server_addr={addr}",
        "--spes_config.sync_steps=2",
        "--max_duration=8st",
        "--eval_interval=null",
        "--save_interval=null",
        "--spes_config.rpc_timeout_s=30",
        "--spes_config.round_timeout_s=60",
        *extra,
    ]


def peer_config(corpus: Any, folder: Path, addr: str, peer: int, *extra: str) -> TrainConfig:
    return load_config(TINY, peer_overrides(corpus, folder, addr, peer, *extra))[0]


def start_peer(cfg: TrainConfig, log: Callable[[str], None] = QUIET) -> Trainer:
    """A node as `python -m spes.train` starts it (its syncer is `trainer.syncer`)."""
    return start_node(cfg, CPU, log=log)[0]
