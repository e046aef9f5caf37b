"""Tests for spes.sync.merge: the SPES round math against naive loops and hand-computed cases."""

from __future__ import annotations

import pytest
import torch

from spes.config import ServerSection
from spes.moe import parse_expert_block
from spes.schema import ConfigError
from spes.sync import merge
from spes.sync.merge import build_global, mean_over_peers, merge_experts, outer_nesterov_step, round_alpha
from spes.sync.spec import RunSpec
from sync_helpers import peer_upload, tiny_spec


def naive_merge(w1: torch.Tensor, v1: torch.Tensor, w2: torch.Tensor, alpha: float, topk: int) -> list[torch.Tensor]:
    """The paper's rule written as plain loops: one expert at a time, donors from pre-merge values."""
    num_experts = w1.shape[0]
    k = min(topk, num_experts - 1)
    out = [w.clone() for w in (w1, v1, w2)]
    for i in range(num_experts):
        sims = []
        for j in range(num_experts):
            if j != i:
                cos = torch.nn.functional.cosine_similarity(w1[i].flatten(), w1[j].flatten(), dim=0)
                sims.append((-cos.item(), j))
        donors = [j for _, j in sorted(sims)[:k]]
        for orig, new in zip((w1, v1, w2), out):
            task_vector = sum(orig[j] - orig[i] for j in donors) / k
            new[i] = orig[i] + alpha * task_vector
    return out


def random_layer(
    num_experts: int, seed: int, d: int = 6, f: int = 5
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(num_experts, d, f, generator=gen),
        torch.randn(num_experts, d, f, generator=gen),
        torch.randn(num_experts, f, d, generator=gen),
    )


def test_trainable_and_download_names() -> None:
    spes = tiny_spec(num_layers=1)
    names = list(spes.manifest or {})
    own = spes.trainable(1)
    assert "blocks.0.ffn.experts.w1.1" in own and "blocks.0.ffn.experts.w1.0" not in own and "embed.weight" in own
    assert spes.own(1) == [n for n in names if n.endswith("experts.w1.1") or n.endswith("v1.1") or n.endswith("w2.1")]
    assert tiny_spec(mode="diloco", num_layers=1).trainable(1) == list(tiny_spec(mode="diloco", num_layers=1).manifest)
    down = spes.downloads(1, merged=False)
    assert "blocks.0.ffn.experts.w1.0" in down and "blocks.0.ffn.experts.w1.1" not in down and "embed.weight" in down
    assert spes.downloads(1, merged=True) == names


def test_alpha_schedule() -> None:
    cfg = ServerSection(merge_interval=500, merge_alpha_start=0.05, merge_decay_steps=10000)
    assert round_alpha(0, "spes", cfg) == 0.05
    assert round_alpha(5000, "spes", cfg) == pytest.approx(0.025)
    assert round_alpha(1500, "spes", cfg) == pytest.approx(0.05 * 0.85)
    assert round_alpha(10000, "spes", cfg) == 0.0  # a multiple of the interval, but decayed to 0
    assert round_alpha(20000, "spes", cfg) == 0.0
    assert round_alpha(1501, "spes", cfg) == 0.0  # not a merge round
    assert round_alpha(1500, "diloco", cfg) == 0.0
    assert round_alpha(500, "spes", ServerSection(merge_interval=0, merge_alpha_start=0.05)) == 0.0


@pytest.mark.parametrize("num_experts,topk", [(8, 4), (5, 2), (3, 4), (2, 1), (4, 3)])
def test_merge_matches_naive_loop(num_experts: int, topk: int) -> None:
    w1, v1, w2 = random_layer(num_experts, seed=num_experts * 10 + topk)
    got = merge_experts(w1, v1, w2, alpha=0.3, topk=topk)
    for g, want in zip(got, naive_merge(w1, v1, w2, alpha=0.3, topk=topk)):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


def test_merge_hand_computed() -> None:
    # Three 1x1 "experts" with w1 along distinct directions of a 2-vector: e0=(1,0), e1=(1,0.1), e2=(0,1).
    w1 = torch.tensor([[[1.0, 0.0]], [[1.0, 0.1]], [[0.0, 1.0]]])
    v1 = torch.tensor([[[1.0, 1.0]], [[3.0, 3.0]], [[5.0, 5.0]]])
    w2 = torch.tensor([[[2.0], [0.0]], [[4.0], [0.0]], [[8.0], [0.0]]])
    new_w1, new_v1, new_w2 = merge_experts(w1, v1, w2, alpha=0.5, topk=1)
    # Nearest others: 0 -> 1, 1 -> 0, 2 -> 1. theta_i + 0.5 * (theta_j - theta_i) is the midpoint.
    torch.testing.assert_close(new_v1[:, 0, 0], torch.tensor([2.0, 2.0, 4.0]))
    torch.testing.assert_close(new_w2[:, 0, 0], torch.tensor([3.0, 3.0, 6.0]))
    torch.testing.assert_close(new_w1[2, 0], torch.tensor([0.5, 0.55]))
    # topk=2 with 3 experts: each takes the mean of both others.
    _, v1_all, _ = merge_experts(w1, v1, w2, alpha=1.0, topk=2)
    torch.testing.assert_close(v1_all[:, 0, 0], torch.tensor([4.0, 3.0, 2.0]))


def test_merge_alpha_zero_is_bit_identical() -> None:
    w1, v1, w2 = random_layer(4, seed=1)
    for got, orig in zip(merge_experts(w1, v1, w2, alpha=0.0, topk=2), (w1, v1, w2)):
        assert torch.equal(got, orig)


def test_merge_topk_clipped_to_other_experts() -> None:
    w1, v1, w2 = random_layer(3, seed=2)
    clipped = merge_experts(w1, v1, w2, alpha=0.2, topk=100)
    exact = merge_experts(w1, v1, w2, alpha=0.2, topk=2)
    for a, b in zip(clipped, exact):
        assert torch.equal(a, b)
    single = merge_experts(w1[:1], v1[:1], w2[:1], alpha=0.2, topk=4)  # no other expert: unchanged
    assert torch.equal(single[0], w1[:1])


def test_merge_is_permutation_equivariant_and_deterministic() -> None:
    w1, v1, w2 = random_layer(8, seed=3)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    base = merge_experts(w1, v1, w2, alpha=0.1, topk=3)
    permuted = merge_experts(w1[perm], v1[perm], w2[perm], alpha=0.1, topk=3)
    for a, b in zip(base, permuted):
        torch.testing.assert_close(a[perm], b, rtol=1e-6, atol=1e-7)
    for a, b in zip(base, merge_experts(w1, v1, w2, alpha=0.1, topk=3)):
        assert torch.equal(a, b)


def test_merge_with_identical_experts_is_deterministic() -> None:
    w1 = torch.ones(4, 2, 2)  # every similarity ties: donors are the lowest other indices
    v1 = torch.arange(4.0).reshape(4, 1, 1).expand(4, 2, 2).contiguous()
    new_v1 = merge_experts(w1, v1, v1.transpose(1, 2).contiguous(), alpha=1.0, topk=1)[1]
    torch.testing.assert_close(new_v1[:, 0, 0], torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_aggregate_spes_takes_owners_and_averages_shared() -> None:
    spec = tiny_spec(server=ServerSection(merge_interval=500))
    manifest = spec.manifest or {}
    uploads = {p: peer_upload(spec, p, seed=0) for p in range(2)}
    out = build_global(uploads, spec=spec, step=7).tensors
    assert set(out) == set(manifest)
    for name in manifest:
        parsed = parse_expert_block(name)
        if parsed is None:
            torch.testing.assert_close(out[name], (uploads[0][name] + uploads[1][name]) / 2)
        else:
            assert torch.equal(out[name], uploads[parsed.block][name])
        assert out[name].dtype == torch.float32


def test_aggregate_spes_merge_round_matches_layerwise_merge() -> None:
    cfg = ServerSection(merge_interval=100, merge_alpha_start=0.5, merge_decay_steps=1000, merge_topk=2)
    spec = tiny_spec(server=cfg)
    uploads = {p: peer_upload(spec, p, seed=1) for p in range(2)}
    out = build_global(uploads, spec=spec, step=200).tensors
    alpha = round_alpha(200, "spes", cfg)
    for layer in range(2):
        prefix = f"blocks.{layer}.ffn.experts"
        stacked = [torch.cat([uploads[b][f"{prefix}.{kind}.{b}"] for b in range(2)]) for kind in ("w1", "v1", "w2")]
        want = naive_merge(*stacked, alpha=alpha, topk=2)
        for kind, w in zip(("w1", "v1", "w2"), want):
            for b in range(2):
                torch.testing.assert_close(out[f"{prefix}.{kind}.{b}"], w[2 * b : 2 * b + 2], rtol=1e-5, atol=1e-6)
    # Past decay the same interval multiple changes nothing.
    late = build_global(uploads, spec=spec, step=1000).tensors
    assert torch.equal(late["blocks.0.ffn.experts.w1.1"], uploads[1]["blocks.0.ffn.experts.w1.1"])


def test_aggregate_diloco_averages_everything_in_bf16_too() -> None:
    merge = ServerSection(merge_interval=1, merge_alpha_start=1.0)
    spec = tiny_spec(mode="diloco", num_peers=3, num_layers=1, k=4, server=merge)
    manifest = spec.manifest or {}
    uploads = {p: {n: t.bfloat16() for n, t in peer_upload(spec, p, seed=2).items()} for p in range(3)}
    out = build_global(uploads, spec=spec, step=0).tensors
    for name in manifest:
        torch.testing.assert_close(out[name], sum(uploads[p][name].float() for p in range(3)) / 3)


def test_mean_in_place_equals_the_copying_mean() -> None:
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(5, 7, generator=gen) for _ in range(3)]
    want = mean_over_peers(tensors)
    assert torch.equal(want, (tensors[0] + tensors[1] + tensors[2]) / 3)
    first = tensors[0].clone()
    got = mean_over_peers([first, *tensors[1:]], reuse_first=True)
    assert got is first and torch.equal(got, want)
    half = tensors[0].bfloat16()  # not fp32: never reused, whatever the caller says
    assert mean_over_peers([half, *tensors[1:]], reuse_first=True) is not half


def test_bf16_uploads_are_widened_exactly_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(merge, "_WIDEN_ELEMS", 7)  # pieces that split rows, and a shorter last one
    gen = torch.Generator().manual_seed(4)
    tensors = [torch.randn(5, 9, generator=gen).bfloat16() for _ in range(3)]
    got = mean_over_peers(tensors)
    assert got.dtype == torch.float32
    assert torch.equal(got, (tensors[0].float() + tensors[1].float() + tensors[2].float()) / 3)


def test_aggregate_keeps_experts_in_their_upload_dtype() -> None:
    spec = tiny_spec(num_layers=1, server=ServerSection(merge_interval=100, merge_alpha_start=0.5, merge_topk=1))
    manifest = spec.manifest or {}
    uploads = {p: {n: t.bfloat16() for n, t in peer_upload(spec, p, seed=5).items()} for p in range(2)}
    out = build_global(uploads, spec=spec, step=1).tensors
    for name in manifest:
        parsed = parse_expert_block(name)
        if parsed is None:
            assert out[name].dtype == torch.float32
        else:  # the very upload: widening it would only be undone to send it back in bf16
            assert out[name] is uploads[parsed.block][name]
    merged = build_global(uploads, spec=spec, step=100).tensors
    assert all(t.dtype == torch.float32 for t in merged.values())


def test_aggregate_rejects_incomplete_uploads() -> None:
    spec = tiny_spec(num_layers=1)
    manifest = spec.manifest or {}
    uploads = {p: peer_upload(spec, p, seed=3) for p in range(2)}
    with pytest.raises(ValueError, match="owner, peer 1"):  # no upload of peer 1 and no previous global model
        build_global({0: uploads[0]}, names=list(manifest), spec=spec, step=1)
    with pytest.raises(ValueError, match=r"uploads of peers in 0..1, got peers \[0, 2\]"):
        build_global({0: uploads[0], 2: uploads[1]}, spec=spec, step=1)
    uploads[0]["blocks.0.ffn.experts.w1.1"] = uploads[1].pop("blocks.0.ffn.experts.w1.1")  # sent by a non-owner
    with pytest.raises(ValueError, match="owner, peer 1"):
        build_global(uploads, spec=spec, step=1)
    uploads[1]["blocks.0.ffn.experts.w1.1"] = uploads[0].pop("blocks.0.ffn.experts.w1.1")
    del uploads[0]["embed.weight"]
    with pytest.raises(ValueError, match="embed.weight"):
        build_global(uploads, spec=spec, step=1)


def test_outer_nesterov_matches_torch_sgd() -> None:
    gen = torch.Generator().manual_seed(4)
    theta = {"a": torch.randn(5, generator=gen), "b": torch.randn(2, 3, generator=gen)}
    params = {n: torch.nn.Parameter(t.clone()) for n, t in theta.items()}
    sgd = torch.optim.SGD(params.values(), lr=0.7, momentum=0.9, nesterov=True)
    buf: dict[str, torch.Tensor] = {}
    for _ in range(3):
        mean = {n: t + torch.randn(t.shape, generator=gen) for n, t in theta.items()}
        for n, p in params.items():
            p.grad = p.detach() - mean[n]
        sgd.step()
        theta, buf = outer_nesterov_step(theta, mean, buf, lr=0.7, momentum=0.9)
        for n, p in params.items():
            torch.testing.assert_close(theta[n], p.detach())


MERGE_ON = {"merge_interval": 10, "merge_alpha_start": 0.5, "merge_decay_steps": 100, "merge_topk": 2}
QUORUM_MERGE = ServerSection(merge_interval=10, merge_alpha_start=0.5, merge_decay_steps=100, merge_topk=2)
QUORUM_SPEC = tiny_spec(server=QUORUM_MERGE)
QUORUM_MANIFEST = QUORUM_SPEC.manifest or {}


def uploads_for(peers: list[int], seed: int, spec: RunSpec = QUORUM_SPEC) -> dict:
    return {p: peer_upload(spec, p, seed) for p in peers}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("step", [10, 15], ids=["merge", "plain"])
def test_consuming_build_global_equals_the_copying_one(step: int) -> None:
    want = build_global(uploads_for([0, 1], step), spec=QUORUM_SPEC, step=step).tensors
    uploads = uploads_for([0, 1], step)
    got = build_global(uploads, names=list(QUORUM_MANIFEST), spec=QUORUM_SPEC, step=step, consume=True)
    assert_same(got.tensors, want)
    assert list(got.tensors) == list(QUORUM_MANIFEST) and got.momentum == {}
    assert all(not upload for upload in uploads.values())  # consumed tensor by tensor
    assert got.alpha == (0.5 * (1 - step / 100) if step % 10 == 0 else 0.0)


def test_build_global_diloco_nesterov_over_rounds_equals_the_pure_functions() -> None:
    outer = tiny_spec(mode="diloco", num_peers=3, server=ServerSection(outer_optimizer="nesterov", **MERGE_ON))
    plain = tiny_spec(mode="diloco", num_peers=3)
    manifest = plain.manifest or {}
    previous: dict = {}
    momentum: dict = {}
    want_global: dict = {}
    want_momentum: dict = {}
    for step in (1, 2, 3):
        mean = build_global(uploads_for([0, 1, 2], step, plain), spec=plain, step=step).tensors
        if want_global:
            want_global, want_momentum = outer_nesterov_step(want_global, mean, want_momentum, lr=0.7, momentum=0.9)
        else:
            want_global = mean
        built = build_global(
            uploads_for([0, 1, 2], step, plain),
            names=list(manifest),
            previous=previous,
            momentum=momentum,
            spec=outer,
            step=step,
            consume=True,
        )
        previous, momentum = built.tensors, built.momentum
        assert_same(previous, want_global)
        assert_same(momentum, want_momentum)
        assert built.alpha == 0.0  # no merge in DiLoCo mode


@pytest.mark.parametrize("step", [10, 15], ids=["merge", "plain"])
def test_quorum_averages_the_arrived_and_keeps_a_missing_owners_experts(step: int) -> None:
    spec = tiny_spec(num_peers=3, server=QUORUM_MERGE)
    manifest = spec.manifest or {}
    names = list(manifest)
    previous = {n: torch.randn(s) for n, s in manifest.items()}
    arrived = uploads_for([0, 2], step, spec)
    got = build_global(
        uploads_for([0, 2], step, spec), names=names, previous=previous, spec=spec, step=step, consume=True
    ).tensors
    assert sorted(got) == sorted(names)
    for name in names:
        parsed = parse_expert_block(name)
        if parsed is None:
            assert torch.equal(got[name], mean_over_peers([arrived[0][name], arrived[2][name]])), name
    for layer in range(2):
        prefix = f"blocks.{layer}.ffn.experts"
        source = {0: arrived[0], 1: previous, 2: arrived[2]}
        stacked = [torch.cat([source[b][f"{prefix}.{kind}.{b}"] for b in range(3)]) for kind in ("w1", "v1", "w2")]
        alpha = 0.5 * (1 - step / 100) if step % 10 == 0 else 0.0
        merged = merge_experts(*stacked, alpha=alpha, topk=2)
        for kind, full in zip(("w1", "v1", "w2"), merged, strict=True):
            for b, part in enumerate(full.split(2)):
                assert torch.equal(got[f"{prefix}.{kind}.{b}"], part), (kind, b)


def test_the_outer_step_starts_per_tensor_so_a_fragments_first_round_is_its_mean() -> None:
    """With fragments the previous global model may lack some tensors: those start from their mean, the rest take
    the outer step, as each would in a run of its own."""
    plain = tiny_spec(mode="diloco", num_peers=3)
    manifest = plain.manifest or {}
    uploads = uploads_for([0, 1, 2], 1, plain)
    mean = build_global(uploads, spec=plain, step=1).tensors
    previous = {"embed.weight": torch.zeros(manifest["embed.weight"])}
    outer = tiny_spec(mode="diloco", num_peers=3, server=ServerSection(outer_optimizer="nesterov"))
    built = build_global(uploads, spec=outer, step=1, previous=previous)
    want, _ = outer_nesterov_step(previous, {"embed.weight": mean["embed.weight"]}, {}, lr=0.7, momentum=0.9)
    assert_same({"embed.weight": built.tensors["embed.weight"]}, want)
    assert_same(
        {n: t for n, t in built.tensors.items() if n != "embed.weight"},
        {n: t for n, t in mean.items() if n != "embed.weight"},
    )
    assert sorted(built.momentum) == ["embed.weight"]


def test_a_merge_round_changes_only_the_mergeable_layers() -> None:
    spec = tiny_spec(server=ServerSection(merge_interval=100, merge_alpha_start=0.5, merge_topk=2))
    manifest = spec.manifest or {}
    uploads = {p: peer_upload(spec, p, seed=1) for p in range(2)}
    layer0 = {n for n in manifest if n.startswith("blocks.0.")}
    full = build_global(uploads, spec=spec, step=200).tensors
    part = build_global(uploads, mergeable=layer0, spec=spec, step=200).tensors
    for name in manifest:
        if name in layer0:
            assert torch.equal(part[name], full[name]), name
        elif parse_expert_block(name) is not None:
            assert torch.equal(part[name], uploads[parse_expert_block(name).block][name]), name  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------------------------
# What mutation testing (bench/mutation.py) found unpinned: the messages of bad input, the bounds of the settings,
# the buffers a mean is summed into, the copies a merge of strength 0 returns, donors chosen by direction only.

MERGE_ROUND = {"spec": tiny_spec(num_layers=1, server=ServerSection(merge_interval=100)), "step": 100}


def test_settings_at_their_bounds() -> None:
    for ok in (
        ServerSection(merge_alpha_start=0.0, merge_decay_steps=1),
        ServerSection(outer_optimizer="none", outer_momentum=0.0),
    ):
        assert ok is not None
    bad = [
        (lambda: ServerSection(merge_alpha_start=-0.5), "'server.merge_alpha_start' = -0.5 must be >= 0"),
        (lambda: ServerSection(merge_alpha_start=float("nan")), "'server.merge_alpha_start' = nan must be a finite"),
        (lambda: ServerSection(outer_lr=0.0), r"'server.outer_lr' = 0.0 must be > 0"),
        (lambda: ServerSection(outer_momentum=1.0), r"'server.outer_momentum' = 1.0 must be in \[0, 1\)"),
        (lambda: ServerSection(outer_momentum=1.5), r"'server.outer_momentum' = 1.5 must be in \[0, 1\)"),
    ]
    for make, message in bad:
        with pytest.raises(ConfigError, match=message):
            make()


def test_an_interval_of_one_merges_every_round_and_diloco_downloads_everything() -> None:
    server = ServerSection(merge_interval=1, merge_alpha_start=0.5, merge_decay_steps=10)
    assert round_alpha(3, "spes", server) == pytest.approx(0.35)
    spec = tiny_spec(mode="diloco", num_layers=1)
    assert spec.downloads(1, merged=False) == list(spec.manifest or {})


def test_bad_layers_and_blocks_are_refused_naming_them() -> None:
    spec = MERGE_ROUND["spec"]
    manifest = spec.manifest or {}
    uploads = {p: peer_upload(spec, p, seed=6) for p in range(2)}
    no_w2 = [n for n in manifest if ".w2." not in n]
    with pytest.raises(
        ValueError, match=r"^merging 'blocks.0.ffn.experts' needs w1, v1 and w2 blocks, got kinds \['v1', 'w1'\]$"
    ):
        build_global(uploads, names=no_w2, **MERGE_ROUND)  # type: ignore[arg-type]
    without_v1_1 = [n for n in manifest if n != "blocks.0.ffn.experts.v1.1"]
    with pytest.raises(ValueError, match=r"^'blocks.0.ffn.experts': kind 'v1' has blocks \[0\] but w1 has \[0, 1\]$"):
        build_global(uploads, names=without_v1_1, **MERGE_ROUND)  # type: ignore[arg-type]
    uploads[1]["blocks.0.ffn.experts.w1.1"] = torch.randn(3, 8, 4)  # 3 experts in a block of 2
    with pytest.raises(
        ValueError,
        match=r"^expert block 'blocks.0.ffn.experts.w1.1' from peer 1 holds 3 experts, more than the run's "
        r"num_train_experts_per_node=2$",
    ):
        build_global(uploads, **MERGE_ROUND)  # type: ignore[arg-type]
    w1, v1, w2 = random_layer(3, seed=7)
    with pytest.raises(ValueError, match=r"^w1/v1/w2 disagree on the number of experts: 3, 2, 3$"):
        merge_experts(w1, v1[:2], w2, alpha=0.5, topk=1)


def test_a_merge_of_strength_zero_returns_new_fp32_tensors() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        layer = [t.to(dtype) for t in random_layer(3, seed=8)]
        for got, orig in zip(merge_experts(*layer, alpha=0.0, topk=1), layer, strict=True):
            assert got.dtype == torch.float32 and torch.equal(got, orig.float())
            assert got.untyped_storage().data_ptr() != orig.untyped_storage().data_ptr()  # a copy, never the input


def test_donors_are_chosen_by_direction_whatever_the_scale() -> None:
    """Cosine similarity is scale-free: the same layer shrunk a thousand times (norms far below 1) merges the same
    way. Its experts' norms differ, so a similarity that depended on them would pick other donors."""
    w1, v1, w2 = random_layer(6, seed=9)
    w1 = w1 * torch.tensor([0.5, 4.0, 1.0, 8.0, 0.25, 2.0])[:, None, None]
    want = merge_experts(w1, v1, w2, alpha=0.5, topk=1)[1]
    assert torch.equal(merge_experts(w1 * 1e-3, v1, w2, alpha=0.5, topk=1)[1], want)


def test_tied_donors_are_the_lowest_indices_for_any_number_of_experts() -> None:
    """40 identical experts: every similarity ties, and the donors are the lowest other indices (a sort that is
    not stable picks others once there are more than ~32)."""
    num_experts = 40
    w1 = torch.ones(num_experts, 2, 2)
    v1 = torch.arange(float(num_experts)).reshape(-1, 1, 1).expand(-1, 2, 2).contiguous()
    new_v1 = merge_experts(w1, v1, v1.transpose(1, 2).contiguous(), alpha=1.0, topk=2)[1][:, 0, 0]
    assert new_v1.tolist() == [1.5, 1.0] + [0.5] * (num_experts - 2)


def test_the_outer_step_is_diloco_only() -> None:
    spec = tiny_spec(num_layers=1)
    nesterov_spec = tiny_spec(num_layers=1, server=ServerSection(outer_optimizer="nesterov"))
    uploads = {p: peer_upload(spec, p, seed=10) for p in range(2)}
    previous = {n: torch.zeros(s) for n, s in (spec.manifest or {}).items()}
    plain = build_global(uploads, spec=spec, step=7, previous=previous)
    nesterov = build_global(uploads, spec=nesterov_spec, step=7, previous=previous)
    assert_same(nesterov.tensors, plain.tensors)
    assert nesterov.momentum == {}


def test_means_are_summed_in_the_buffers_they_are_given() -> None:
    """A bf16 mean goes into the fp32 tensor `empty` hands out (one arrived peer is enough); an fp32 one, when
    consumed, into the first peer's upload; `mean_over_peers(out=...)` into `out`."""
    spec = tiny_spec(mode="diloco", num_layers=1)
    manifest = spec.manifest or {}
    lone = {0: {n: t.bfloat16() for n, t in peer_upload(spec, 0, seed=11).items()}}
    handed: list[torch.Tensor] = []

    def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        assert dtype == torch.float32
        handed.append(torch.full(shape, float("nan")))
        return handed[-1]

    out = build_global({0: dict(lone[0])}, spec=spec, step=1, empty=empty).tensors
    assert [t.shape for t in handed] == [torch.Size(manifest[n]) for n in sorted(manifest)]  # in the order built
    for name, tensor in out.items():
        assert any(tensor is h for h in handed) and torch.equal(tensor, lone[0][name].float()), name
    handed.clear()
    fp32 = {p: peer_upload(spec, p, seed=12) for p in range(2)}
    firsts = {n: fp32[0][n] for n in manifest}
    out = build_global(fp32, spec=spec, step=1, empty=empty, consume=True).tensors
    assert not handed and all(out[n] is firsts[n] for n in manifest)  # summed in place in peer 0's upload
    tensors = [torch.randn(3, 4) for _ in range(2)]
    buffer = torch.empty(3, 4)
    assert mean_over_peers(tensors, out=buffer) is buffer and torch.equal(buffer, (tensors[0] + tensors[1]) / 2)
