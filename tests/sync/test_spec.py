"""The run spec (spes.sync.spec): built once from a run's YAML by the server and every node alike."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from spes.config import load_config
from spes.model import Transformer
from spes.sync.peer import model_manifest
from spes.sync.server import spec_of_run
from spes.sync.spec import FIELD_KEYS, RunSpec, run_spec
from sync_helpers import tiny_spec

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def node_spec(path: Path, *overrides: str) -> tuple[RunSpec, list[str]]:
    """What a node builds: the spec of its config and its own model, and the names its model trains."""
    cfg, _ = load_config(path, list(overrides))
    with torch.device("meta"):
        manifest, trainable = model_manifest(Transformer.for_run(cfg))
    return run_spec(cfg, manifest), trainable


@pytest.mark.parametrize(
    "config, peer",
    [
        ("tiny.yaml", 0),
        ("tiny.yaml", 3),
        ("spes_1b/node_2.yaml", 2),
        ("diloco_1b/node_1.yaml", 1),
        ("upcycled_9b/node_7.yaml", 7),
    ],
)
def test_the_server_and_every_node_build_the_same_spec_and_it_says_what_each_trains(config: str, peer: int) -> None:
    """The server's spec (from any node's YAML) equals each node's, and its ownership is what the node's model
    trains: the shared tensors and its own expert blocks (DiLoCo: everything)."""
    path = CONFIGS / config
    node, trainable = node_spec(path, f"--spes_config.peer_id={peer}")
    server = spec_of_run(str(path))
    assert node == server and node.manifest == server.manifest and not server.differences(node, "the node")
    assert node.trainable(peer) == trainable
    assert set(node.downloads(peer, merged=False)) | set(node.own(peer)) == set(node.manifest or {})


def test_a_round_moves_uploads_in_the_peers_format_and_relayed_blocks_as_uploaded() -> None:
    spec = tiny_spec(codec="sparse", codec_settings={"chunk": 64, "topk": 4, "down_topk": 16})
    codec, manifest = spec.codec_impl, spec.manifest or {}

    def size(name: str) -> int:
        return math.prod(manifest[name])

    up, down = spec.round_bytes(1, merged=False)
    assert up == sum(codec.round_bytes(size(n)) for n in spec.trainable(1))
    relayed = [n for n in spec.downloads(1, merged=False) if spec.owner(n) is not None]
    averaged = [n for n in spec.downloads(1, merged=False) if spec.owner(n) is None]
    assert relayed and averaged
    assert down == sum(codec.round_bytes(size(n)) for n in relayed) + sum(codec.down_bytes(size(n)) for n in averaged)
    assert spec.round_bytes(1, merged=True)[1] == sum(codec.down_bytes(size(n)) for n in manifest)


def test_the_paper_layout_gives_block_b_to_peer_b() -> None:
    spec, _ = node_spec(CONFIGS / "spes_1b" / "node_0.yaml")
    assert spec.mode == "spes" and spec.block_owners == (0, 1, 2, 3) and spec.experts_per_block == 4
    assert spec.owner("blocks.3.ffn.experts.w2.2") == 2 and spec.owner("blocks.3.attn.w_q.weight") is None
    diloco, _ = node_spec(CONFIGS / "diloco_1b" / "node_0.yaml")
    assert diloco.block_owners == () and diloco.owner("blocks.3.ffn.experts.w2.0") is None


def test_a_spec_travels_as_its_message_and_back() -> None:
    spec = replace(
        tiny_spec(codec="sparse", codec_settings={"topk": 32}, overlap_fragments=2, sync_steps=4), last_step=40
    )
    back = RunSpec.from_proto(spec.to_proto(), spec.manifest or {}, origin="peer 0's config")
    assert back == spec and back.codec_settings == (
        ("bits", 2),
        ("chunk", 4096),
        ("down_bits", 8),
        ("down_topk", 256),
        ("topk", 32),
    )
    assert back.last_step == 40 and back.manifest == spec.manifest and back.origin == "peer 0's config"
    unset = replace(spec, experts_per_block=None, sync_steps=None, last_step=None)  # open fields travel as open
    again = RunSpec.from_proto(unset.to_proto(), {}, origin="")
    assert (again.experts_per_block, again.sync_steps, again.last_step) == (None, None, None)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(mode="central"), "run mode 'central': a parameter server runs 'spes' or 'diloco'"),
        (dict(num_peers=0), "a run needs num_peers >= 1 and experts per block >= 1, got 0, 2"),
        (dict(experts_per_block=0), "a run needs num_peers >= 1 and experts per block >= 1, got 2, 0"),
        (dict(block_owners=(0, 2)), r"block_owners \(0, 2\) name peers outside \[0, 2\)"),
        (dict(overlap_fragments=0), "config key 'spes_config.overlap_fragments' = 0 must be >= 1"),
        (
            dict(sync_steps=0),
            "config key 'spes_config.sync_steps' = 0 must be >= 1 and a multiple of spes_config.overlap_fragments=1",
        ),
        (
            dict(sync_steps=5, overlap_fragments=2),
            "config key 'spes_config.sync_steps' = 5 must be >= 1 and a multiple of",
        ),
    ],
)
def test_a_spec_that_cannot_be_run_is_refused_naming_the_setting(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        replace(tiny_spec(), **changes)


def test_the_smallest_specs_are_valid() -> None:
    one = replace(tiny_spec(num_peers=1, k=1), sync_steps=2, overlap_fragments=2)
    assert (one.num_peers, one.experts_per_block, one.block_owners, one.round_interval) == (1, 1, (0,), 1)


def test_ownership_questions_about_given_names_and_the_open_or_unknown_ones() -> None:
    spec = tiny_spec(num_peers=2)
    names = ["blocks.0.ffn.experts.w1.1", "blocks.0.ffn.experts.w1.0", "blocks.0.attn.w_q.weight"]
    assert spec.trainable(1, names) == names[::2] and spec.own(1, names) == names[:1]
    assert spec.downloads(1, names, merged=False) == names[1:] and spec.downloads(1, names, merged=True) == names
    with pytest.raises(ValueError, match=r"^expert block 'blocks.0.ffn.experts.w1.2' has no owner: the run has 2 "):
        spec.owner("blocks.0.ffn.experts.w1.2")
    unowned = replace(spec, block_owners=None, manifest=None)
    with pytest.raises(
        ValueError, match=r"^the run spec's ownership is open \(no node has joined a server started without YAML\)$"
    ):
        unowned.owner(names[0])
    with pytest.raises(
        ValueError, match=r"^the run spec has no manifest yet \(no node has joined a server started without YAML\)$"
    ):
        unowned.trainable(0)


def test_the_first_difference_is_the_root_cause_with_both_values_and_where_each_came_from() -> None:
    ours = replace(tiny_spec(), origin="configs/tiny.yaml")
    theirs = tiny_spec(mode="diloco", num_peers=3, codec="int8")
    assert list(FIELD_KEYS)[:2] == ["mode", "num_peers"]
    assert ours.differences(theirs, "peer 1") == (
        "peer 1 has mode = 'diloco' but the run has mode = 'spes' (from configs/tiny.yaml): set "
        "using_spes / using_dilico alike in every node's YAML and the server's"
    )
    assert ours.differences(tiny_spec(), "peer 1") == ""
    assert tiny_spec().differences(tiny_spec(num_peers=3), "peer 2") == (  # no origin; tuples as lists
        "peer 2 has num_peers = 3 but the run has num_peers = 2: set spes_config.num_peers alike in every node's YAML "
        "and the server's"
    )
    two_blocks = replace(tiny_spec(num_peers=3), block_owners=(0, 1))
    assert "block_owners = [0, 1, 2] but the run has block_owners = [0, 1]" in two_blocks.differences(
        tiny_spec(num_peers=3), "peer 2"
    )
    assert replace(ours, sync_steps=None).differences(tiny_spec(sync_steps=7), "peer 1") == ""  # open: agrees


def test_a_centralized_run_or_a_bad_codec_setting_has_no_spec_and_says_why() -> None:
    with pytest.raises(ValueError, match="is a centralized run .* set using_spes: true"):
        spec_of_run(str(CONFIGS / "centralized_1b.yaml"))
    with pytest.raises(ValueError, match=r"^the config is a centralized run \(using_spes: false\), .*\(SPES\) or "):
        run_spec(load_config(CONFIGS / "centralized_1b.yaml")[0], None)
    with pytest.raises(ValueError, match="unknown config key 'spes_config.codec_settings.top_k'; did you mean 'topk'"):
        spec_of_run(str(CONFIGS / "tiny.yaml"), ["--spes_config.codec=sparse", "--spes_config.codec_settings.top_k=8"])
    with pytest.raises(ValueError, match="the int8 codec takes"):
        tiny_spec(codec="int8", codec_settings={"chunk": 8})
    with pytest.raises(ValueError, match="^config key 'spes_config.codec' = 'fp16' is not a codec: use one of"):
        tiny_spec(codec="fp16")


def test_a_server_without_the_runs_yaml_has_an_open_spec_that_the_first_join_completes() -> None:
    spec = spec_of_run(None, ["--spes_config.num_peers=4", "--spes_config.num_train_experts_per_node=4"])
    assert (spec.mode, spec.num_peers, spec.experts_per_block) == ("spes", 4, 4)
    assert spec.manifest is None and spec.sync_steps is None and not spec.complete
    node, _ = node_spec(CONFIGS / "spes_1b" / "node_1.yaml")
    assert not spec.differences(node, "peer 1")
    complete = spec.completed_by(node)
    assert complete.complete and complete.manifest == node.manifest and complete.sync_steps == 100
    with pytest.raises(ValueError, match="the run spec is open"):
        spec.layout  # noqa: B018
    pinned = spec_of_run(None, ["--spes_config.num_peers=4", "--spes_config.sync_steps=50"])
    assert pinned.sync_steps == 50


def test_the_schedule_names_the_round_expected_next() -> None:
    plain = replace(tiny_spec(sync_steps=10), last_step=35)
    assert [plain.next_round(after) for after in (None, 10, 19, 20, 30)] == [10, 20, 20, 30, None]
    fragments = replace(tiny_spec(sync_steps=10, overlap_fragments=2), last_step=37)  # a round every 5 steps
    assert [fragments.next_round(after) for after in (None, 5, 30, 35, 37)] == [5, 10, 35, 37, None]
    assert replace(plain, last_step=None).next_round(30) == 40  # open: no end known
    assert [replace(plain, last_step=40).next_round(after) for after in (30, 40)] == [40, None]  # the last is a round
    every_step = replace(tiny_spec(sync_steps=1), last_step=3)
    assert [every_step.next_round(after) for after in (None, 1, 2, 3)] == [1, 2, 3, None]


def test_a_nodes_spec_carries_its_configs_last_step_server_section_and_origin() -> None:
    overrides = [
        "--server.merge_topk=3",
        "--max_duration=77",
        "--spes_config.overlap_sync=true",
        "--spes_config.overlap_fragments=2",
    ]
    cfg, _ = load_config(CONFIGS / "tiny.yaml", overrides)
    spec = run_spec(cfg, None, origin="configs/tiny.yaml")
    assert spec.overlap_fragments == 2 and spec.sync_steps == cfg.spes_config.sync_steps
    assert spec.last_step == cfg.duration_steps == 77 and spec.server == cfg.server and spec.server.merge_topk == 3
    assert spec.origin == "configs/tiny.yaml" and spec.manifest is None and run_spec(cfg, None).origin == ""
