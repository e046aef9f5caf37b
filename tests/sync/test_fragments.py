"""The pure rules of rounds over fragments of the model (spes.sync.fragments)."""

from __future__ import annotations

import math

import pytest

from spes.sync.fragments import WHOLE, Layout, fragment_unit, merge_step, split_fragments, turn_of, wire_weight
from tests.sync_helpers import tiny_manifest


def test_a_tensor_moves_with_its_decoder_block_and_the_rest_alone() -> None:
    assert fragment_unit("blocks.12.ffn.experts.w1.3") == fragment_unit("blocks.12.attn.qkv.weight") == "blocks.12"
    assert fragment_unit("blocks.1.ffn.router.weight") != fragment_unit("blocks.12.ffn.router.weight")
    assert fragment_unit("embed.weight") == "embed.weight" and fragment_unit("lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("count", [1, 2, 3, 5, 6])
def test_fragments_cover_every_tensor_once_in_whole_blocks_and_balanced(count: int) -> None:
    manifest = tiny_manifest(num_layers=4)
    parts = split_fragments(manifest, count)
    assert len(parts) == count
    assert sorted(n for part in parts for n in part) == sorted(manifest)
    for part in parts:
        assert list(part) == [n for n in manifest if n in part]  # the manifest's order
    homes = {fragment_unit(n): k for k, part in enumerate(parts) for n in part}
    assert all(homes[fragment_unit(n)] == k for k, part in enumerate(parts) for n in part)  # units never split
    sizes = [sum(math.prod(manifest[n]) for n in part) for part in parts]
    largest_unit = max(
        sum(math.prod(s) for n, s in manifest.items() if fragment_unit(n) == u) for u in map(fragment_unit, manifest)
    )
    assert max(sizes) - min(sizes) <= largest_unit
    assert split_fragments(manifest, count) == parts  # the peers and the server cut alike


def test_a_model_with_fewer_parts_than_fragments_is_refused_naming_the_key() -> None:
    manifest = tiny_manifest(num_layers=2)  # 2 blocks + embedding + LM head
    assert len(split_fragments(manifest, 4)) == 4
    with pytest.raises(ValueError, match=r"4 parts .* fewer than the 5 fragments .*spes_config.overlap_fragments"):
        split_fragments(manifest, 5)
    with pytest.raises(ValueError, match=">= 1"):
        split_fragments(manifest, 0)


def test_each_fragment_comes_round_once_per_sync_steps_and_the_last_step_syncs_everything() -> None:
    layout = Layout.of(tiny_manifest(num_layers=4), 5, 10)
    assert [step for step in range(1, 42) if layout.syncs_at(step, last_step=41)] == [*range(2, 41, 2), 41]
    schedule = [layout.fragment_at(step, last_step=40) for step in range(2, 41, 2)]
    assert schedule == [1, 2, 3, 4, 5] * 3 + [1, 2, 3, 4, WHOLE]
    whole = Layout.of(tiny_manifest(), 1, 10)
    assert {whole.fragment_at(step, last_step=40) for step in (10, 20, 40)} == {WHOLE}
    assert [step for step in range(1, 42) if whole.syncs_at(step, last_step=41)] == [10, 20, 30, 40]


def test_a_fragments_round_merges_as_the_whole_round_it_stands_in_for() -> None:
    assert [merge_step(step, 10, 1 + (step // 2 - 1) % 5) for step in (2, 4, 10, 12, 20)] == [10, 10, 10, 20, 20]
    assert merge_step(7, 10, WHOLE) == 7


def test_a_layout_names_a_fragments_tensors_and_checks_fragment_numbers() -> None:
    manifest = tiny_manifest(num_layers=2)
    layout = Layout.of(manifest, 2, 4)
    assert layout.names(WHOLE, manifest) == list(manifest)
    assert sorted(layout.names(1, manifest) + layout.names(2, manifest)) == sorted(manifest)
    assert layout.names(1, ["lm_head.weight", "embed.weight"]) == [
        n for n in ["lm_head.weight", "embed.weight"] if n in layout.parts[0]
    ]
    layout.check(2)
    with pytest.raises(ValueError, match=r"fragment 3 is not one of this run's \(0 or 1..2\)"):
        layout.check(3)
    with pytest.raises(ValueError, match=r"fragment 1 is not one of this run's \(0: it has no fragments\)"):
        Layout.of(manifest, 1, 0).check(1)
    with pytest.raises(ValueError, match="sync_steps=5 is not a multiple of the 2 fragments"):
        Layout.of(manifest, 2, 5)


def test_a_whole_round_of_a_fragmented_run_merges_only_the_fragment_whose_turn_it_is() -> None:
    """The rounds before it merged the other fragments for the same whole round: merging them again would merge
    them twice. A whole round off the schedule merges nothing; a fragment's round merges what it covers."""
    manifest = tiny_manifest(num_layers=2)
    layout = Layout.of(manifest, 2, 4)
    assert layout.merged_names(8, WHOLE, manifest) == (8, set(layout.parts[1]))
    assert layout.merged_names(7, WHOLE, manifest) == (7, set())
    assert layout.merged_names(6, 1, manifest) == (8, None)
    assert Layout.of(manifest, 1, 0).merged_names(6, WHOLE, manifest) == (6, None)
    assert [turn_of(step, 10, 5) for step in (2, 4, 10, 12, 3)] == [1, 2, 5, 1, WHOLE]


def test_an_expert_block_weighs_one_way_in_spes_mode_and_every_other_tensor_both_ways() -> None:
    expert = "blocks.3.ffn.experts.w1.2"
    assert [wire_weight(expert, "spes"), wire_weight(expert, "diloco")] == [1, 2]
    assert [wire_weight("blocks.3.ffn.router.weight", "spes"), wire_weight("embed.weight", "spes")] == [2, 2]


# Units of 20 (embedding), 30 (an expert block: 30 values, one way), 50 (attention: 25 values, both ways) and 20
# (LM head) wire bytes in SPES mode; 20, 60, 50 and 20 in DiLoCo, where the experts travel both ways.
WEIGHED = {"embed.weight": (10,), "blocks.0.ffn.experts.w1.0": (30,), "blocks.1.attn.qkv.weight": (25,)}
WEIGHED["lm_head.weight"] = (10,)


def test_fragments_are_balanced_by_wire_bytes_heaviest_unit_first() -> None:
    """Heaviest first, each to the lightest fragment so far (ties: the lowest number). SPES: attention 50 to 1,
    experts 30 to 2, embedding 20 to 2 (now 50), LM head to the tie's lowest, 1. DiLoCo: experts 60 to 1,
    attention 50 to 2, embedding to 2 (70), LM head to 1 (80). Taking units in another order (lightest first, by
    name) or weighing every tensor alike cuts otherwise."""
    spes = (("blocks.1.attn.qkv.weight", "lm_head.weight"), ("embed.weight", "blocks.0.ffn.experts.w1.0"))
    diloco = (("blocks.0.ffn.experts.w1.0", "lm_head.weight"), ("embed.weight", "blocks.1.attn.qkv.weight"))
    assert split_fragments(WEIGHED, 2) == split_fragments(WEIGHED, 2, "spes") == spes
    assert split_fragments(WEIGHED, 2, "diloco") == diloco
    assert Layout.of(WEIGHED, 2, 4).parts == Layout.of(WEIGHED, 2, 4, "spes").parts == spes
    assert Layout.of(WEIGHED, 2, 4, "diloco").parts == diloco


def test_the_bounds_of_a_layout() -> None:
    """The whole round is a fragment number of every layout; sync_steps may equal the number of fragments (a round
    every step); with 2 fragments the run's last step syncs even off the schedule."""
    layout = Layout.of(WEIGHED, 2, 4)
    layout.check(WHOLE)
    Layout.of(WEIGHED, 1, 4).check(WHOLE)
    assert Layout.of(WEIGHED, 2, 2).round_interval == 1
    with pytest.raises(ValueError, match="sync_steps=1 is not a multiple of the 2 fragments"):
        Layout.of(WEIGHED, 2, 1)
    assert layout.syncs_at(7, last_step=7) and not layout.syncs_at(7, last_step=9)
