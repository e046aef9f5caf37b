"""The garbage collector while a node trains: no automatic collection, a generation-1 one at the scheduled steps."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from conftest import littering, make_garbage
from spes.config import load_config
from spes.distributed import DistInfo
from spes.gc_schedule import scheduled_collection
from spes.node import build_node
from spes.schema import ConfigError
from spes.trainer import Trainer

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


def test_collections_happen_at_the_scheduled_steps_only(collections: list[int]) -> None:
    assert gc.isenabled()
    with scheduled_collection(2) as collect:
        assert not gc.isenabled()
        collections.clear()  # NOTE: an automatic collection may have run between the fixture's start and here
        make_garbage()
        collect(1)
        assert collections == []  # no automatic collection, and step 1 is not a multiple of 2
        collect(2)
        make_garbage()
        collect(3)
        collect(4)
        assert collections == [1, 1]
    assert gc.isenabled()


def test_the_collector_is_restored_after_an_error_and_left_alone_without_a_schedule() -> None:
    with pytest.raises(RuntimeError), scheduled_collection(1):
        raise RuntimeError("a failed step")
    assert gc.isenabled()
    gc.disable()
    try:
        with scheduled_collection(3):
            pass
        assert not gc.isenabled()  # off before, off after
    finally:
        gc.enable()
    with scheduled_collection(None) as collect:
        assert gc.isenabled()
        collect(0)


def test_training_runs_no_automatic_collection(tiny_corpus, tmp_path: Path, collections: list[int]) -> None:  # type: ignore[no-untyped-def]
    """A real (tiny) run of 6 steps with gen1_gc_interval 2, each step also making thousands of reference cycles
    (automatic collection would run several times a step): the only collections during `fit` are generation-1
    ones at steps 2, 4 and 6, and they leave a full collection nothing to find."""
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    overrides = [*tiny_corpus.overrides(tmp_path), "--eval_interval=null", "--save_interval=null"]
    cfg, _ = load_config(TINY, [*overrides, "--max_duration=6st", "--gen1_gc_interval=2"])
    node = build_node(cfg, info, log=lambda _m: None)
    trainer = Trainer(
        cfg=cfg, model=node.model, optimizer=node.optimizer, loader=node.loader, info=info, log=lambda _m: None
    )
    littering(trainer)
    gc.collect()
    collections.clear()
    trainer.fit()
    assert collections == [1, 1, 1]
    assert gc.collect() < 100


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_schedule_below_one_step_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="gen1_gc_interval.*must be >= 1 or null"):
        load_config(TINY, [f"--gen1_gc_interval={value}"])
