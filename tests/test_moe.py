"""Tests of spes.moe: every expert backend against a naive per-token loop, the auxiliary losses and their
SPES decayed factor, top-k weight normalization and dropless routing."""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from spes.moe import (
    ExpertBlock,
    ExpertBlocks,
    MoE,
    decayed_lb_factor,
    fuse_expert_blocks,
    init_truncated_normal_,
    load_balancing_loss,
    parse_expert_block,
    router_z_loss,
    split_expert_blocks,
)

D, HIDDEN, E, K = 16, 12, 8, 2
BACKENDS = ["torch", "grouped_mm"]


def make_moe(
    backend: str = "torch",
    *,
    block_size: int = 2,
    trainable_block: int | None = None,
    normalize_p: float | None = None,
    num_layers: int = 1,
    seed: int = 0,
    hidden: int = HIDDEN,
    frozen_dtype: torch.dtype | None = None,
) -> MoE:
    """A small MoE with weights large enough that routing and expert outputs are far from trivial."""
    moe = MoE(
        d_model=D,
        hidden=hidden,
        num_experts=E,
        top_k=K,
        block_size=block_size,
        trainable_block=trainable_block,
        num_layers=num_layers,
        lb_weight=0.01,
        z_weight=0.001,
        normalize_p=normalize_p,
        backend=backend,  # type: ignore[arg-type]
        frozen_dtype=frozen_dtype,
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            init_truncated_normal_(p, 0.3, 3.0)
    return moe


def full_experts(ex: ExpertBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All experts of the layer as (E, ...) tensors, concatenated from the ownership blocks (differentiably)."""
    return torch.cat(list(ex.w1)), torch.cat(list(ex.v1)), torch.cat(list(ex.w2))


def naive_moe_forward(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The definition: each token visits its top-k experts one at a time and sums their weighted SwiGLU outputs."""
    x_TD = x.reshape(-1, x.shape[-1])
    w1, v1, w2 = full_experts(moe.experts)
    probs = torch.softmax(x_TD @ moe.router.weight.T, dim=-1)
    rows = []
    for t in range(x_TD.shape[0]):
        weights, experts = torch.topk(probs[t], moe.top_k)
        if moe.normalize_p is not None:
            weights = weights / weights.abs().pow(moe.normalize_p).sum().pow(1 / moe.normalize_p)
        out = torch.zeros(x_TD.shape[-1])
        for w, e in zip(weights, experts.tolist()):
            h = F.silu(x_TD[t] @ w1[e]) * (x_TD[t] @ v1[e])
            out = out + w * (h @ w2[e])
        rows.append(out)
    return torch.stack(rows).reshape(x.shape)


def grads_of(moe: MoE, x: torch.Tensor, forward) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Gradients of a real loss (MSE against a fixed target) w.r.t. the input and every trainable parameter."""
    moe.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    target = torch.linspace(-1.0, 1.0, x.numel()).reshape(x.shape)
    loss = F.mse_loss(forward(moe, x), target)
    loss.backward()
    grads = {"input": x.grad.clone()}
    grads.update({n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None})
    return grads


def module_forward(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    return moe(x)[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("normalize_p", [None, 1.0])
@pytest.mark.parametrize("trainable_block", [None, 1])
def test_backend_matches_naive_loop_forward_and_gradients(
    backend: str, block_size: int, normalize_p: float | None, trainable_block: int | None
) -> None:
    """Every block layout, trained by a full model, by one SPES peer (grouped_mm then puts its experts first), or
    by none (block 1 of a one-block layer does not exist)."""
    moe = make_moe(backend, block_size=block_size, normalize_p=normalize_p, trainable_block=trainable_block)
    x = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe(x)[0], naive_moe_forward(moe, x), atol=1e-5, rtol=1e-5)

    got, want = grads_of(moe, x, module_forward), grads_of(moe, x, naive_moe_forward)
    assert got.keys() == want.keys()
    trained = sum(p.requires_grad for p in moe.experts.w1)
    assert len(got) == 1 + 1 + 3 * trained  # input, router, every trained block of w1/v1/w2
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_blocks_get_no_gradient(backend: str) -> None:
    moe = make_moe(backend, block_size=2, trainable_block=1)
    grads = grads_of(moe, torch.randn(4, 9, D), module_forward)
    assert sorted(n for n in grads if n.startswith("experts.")) == ["experts.v1.1", "experts.w1.1", "experts.w2.1"]
    assert "router.weight" in grads
    assert all(p.grad is None for n, p in moe.named_parameters() if n.startswith("experts.") and not n.endswith(".1"))


def test_megablocks_backend_missing_is_a_clear_error() -> None:
    if importlib.util.find_spec("megablocks") is not None and importlib.util.find_spec("grouped_gemm") is not None:
        pytest.skip("megablocks is installed here")
    message = (
        "config key 'model.moe_backend' = 'megablocks' needs the megablocks and grouped_gemm packages, which build "
        "only on CUDA machines (`pip install megablocks`); use moe_backend: torch or grouped_mm here"
    )
    with pytest.raises(ValueError) as err:
        make_moe("megablocks")
    assert str(err.value) == message


def test_load_balancing_loss_by_hand() -> None:
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    counts = torch.tensor([2, 1, 1])
    # E * w / (L * T * K) * sum_e count_e * mean_t p_te = 3 * 0.01 / (2 * 4 * 1) * (2*0.4 + 1*0.375 + 1*0.225)
    got = load_balancing_loss(probs, counts, top_k=1, weight=0.01, num_layers=2)
    assert got.item() == pytest.approx(0.00375 * 1.4, rel=1e-6)
    scaled = load_balancing_loss(
        probs, counts, top_k=1, weight=0.01, num_layers=2, count_scale_E=torch.tensor([0.7, 1.0, 1.0])
    )
    assert scaled.item() == pytest.approx(0.00375 * (0.7 * 2 * 0.4 + 0.375 + 0.225), rel=1e-6)


def test_router_z_loss_by_hand() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    lse = [math.log(math.exp(1) + math.exp(2) + math.exp(3)), math.log(3.0)]
    want = 0.001 * (lse[0] ** 2 + lse[1] ** 2) / 2  # the reference's per-layer term: not divided by the layers
    assert router_z_loss(logits, weight=0.001).item() == pytest.approx(want, rel=1e-6)


def test_module_aux_losses_follow_the_formulas() -> None:
    moe = make_moe(block_size=2, trainable_block=1, num_layers=3)
    x = torch.randn(5, 6, D)
    _, aux = moe(x)
    x_TD = x.reshape(-1, D)
    logits = x_TD @ moe.router.weight.T
    probs = logits.softmax(-1)
    counts = torch.bincount(probs.topk(K, dim=-1).indices.reshape(-1), minlength=E).float()
    torch.testing.assert_close(aux.tokens_per_expert, counts.long())
    assert int(aux.tokens_per_expert.sum()) == x_TD.shape[0] * K
    lb = E * 0.01 / (3 * x_TD.shape[0] * K) * (counts * probs.mean(0)).sum()
    torch.testing.assert_close(aux.lb_loss, lb)
    torch.testing.assert_close(aux.z_loss, 0.001 * torch.logsumexp(logits, -1).square().mean())

    moe.set_own_count_scale(0.7)  # the trainable block 1 holds experts 2 and 3
    scale = torch.tensor([1.0, 1.0, 0.7, 0.7, 1.0, 1.0, 1.0, 1.0])
    scaled_lb = E * 0.01 / (3 * x_TD.shape[0] * K) * (scale * counts * probs.mean(0)).sum()
    torch.testing.assert_close(moe(x)[1].lb_loss, scaled_lb)


def test_decayed_lb_factor_schedule() -> None:
    max_steps, every = 1000, 10  # ramp over the first 200 steps, refreshed every 10
    # as in the reference: 1.0 until the first refresh step, then the ramp's value at that step
    assert all(decayed_lb_factor(s, max_steps, every) == 1.0 for s in range(every))
    assert decayed_lb_factor(10, max_steps, every) == pytest.approx(0.7 + 0.3 * 10 / 200)
    assert decayed_lb_factor(50, max_steps, every) == pytest.approx(0.775)
    assert decayed_lb_factor(100, max_steps, every) == pytest.approx(0.85)
    assert decayed_lb_factor(200, max_steps, every) == pytest.approx(1.0)
    assert decayed_lb_factor(999, max_steps, every) == pytest.approx(1.0)
    assert decayed_lb_factor(5000, max_steps, every) == pytest.approx(1.0)
    # constant between refreshes, then the next point of the line
    at_refresh = decayed_lb_factor(100, max_steps, every)
    assert all(decayed_lb_factor(s, max_steps, every) == at_refresh for s in range(100, 110))
    assert decayed_lb_factor(110, max_steps, every) == pytest.approx(0.7 + 0.3 * 110 / 200)
    values = [decayed_lb_factor(s, max_steps, 1) for s in range(20, 201, 20)]
    steps = [b - a for a, b in zip(values, values[1:])]
    assert steps == pytest.approx([0.03] * 9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_normalized_topk_weights_sum_to_one(backend: str) -> None:
    """With identical experts the output is (sum of the top-k weights) x expert(x): 1 x when normalized."""
    x = torch.randn(4, 5, D)
    outputs = {}
    for p in (None, 1.0):
        moe = make_moe(backend, normalize_p=p)
        with torch.no_grad():
            for blocks in (moe.experts.w1, moe.experts.v1, moe.experts.w2):
                first = blocks[0][0].clone()
                for block in blocks:
                    block.copy_(first.expand_as(block))
        outputs[p] = moe(x)[0]
    w1, v1, w2 = (b[0][0] for b in (moe.experts.w1, moe.experts.v1, moe.experts.w2))
    one_expert = (F.silu(x @ w1) * (x @ v1)) @ w2
    torch.testing.assert_close(outputs[1.0], one_expert, atol=1e-5, rtol=1e-5)
    ratio = outputs[None].norm(dim=-1) / one_expert.norm(dim=-1)
    assert bool(((ratio > 2 / E) & (ratio < 1 - 1e-3)).all())  # unnormalized top-2 of 8 probabilities


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropless_when_every_token_picks_the_same_experts(backend: str) -> None:
    moe = make_moe(backend, block_size=2)
    x = torch.randn(6, 8, D) * 0.1
    x[..., 0] = 1.0  # a constant feature the router reads: experts 0 then 1 win for every token
    with torch.no_grad():
        moe.router.weight[:, 0] = torch.tensor([20.0, 10.0, 0, 0, 0, 0, 0, 0])
    y, aux = moe(x)
    tokens = x.shape[0] * x.shape[1]
    assert aux.tokens_per_expert.tolist() == [tokens, tokens, 0, 0, 0, 0, 0, 0]
    torch.testing.assert_close(y, naive_moe_forward(moe, x), atol=1e-5, rtol=1e-5)
    assert bool((y.norm(dim=-1) > 0).all())  # no token was dropped


def test_parse_expert_block() -> None:
    assert parse_expert_block("blocks.3.ffn.experts.w1.2") == ExpertBlock("blocks.3.ffn.experts", "w1", 2)
    assert parse_expert_block("blocks.0.ffn.experts.w2.10") == ExpertBlock("blocks.0.ffn.experts", "w2", 10)
    for shared in (
        "blocks.3.ffn.router.weight",
        "embed.weight",
        "blocks.1.ffn.experts.w3.0",
        "blocks.1.ffn.experts.w1.01",
    ):
        assert parse_expert_block(shared) is None


def test_fuse_split_round_trip_uneven_blocks() -> None:
    full = {
        "blocks.0.ffn.experts.w1": torch.randn(5, 3, 2),
        "blocks.0.ffn.experts.w2": torch.randn(5, 2, 3),
        "embed.weight": torch.randn(4, 3),
    }
    blocks = split_expert_blocks(full, 2)
    assert [tuple(blocks[f"blocks.0.ffn.experts.w1.{b}"].shape) for b in range(3)] == [(2, 3, 2), (2, 3, 2), (1, 3, 2)]
    fused = fuse_expert_blocks(blocks)
    assert fused.keys() == full.keys() and all(torch.equal(fused[k], full[k]) for k in full)


def test_fuse_refuses_missing_block() -> None:
    with pytest.raises(ValueError, match="not numbered"):
        fuse_expert_blocks({"x.experts.w1.0": torch.zeros(1, 1, 1), "x.experts.w1.2": torch.zeros(1, 1, 1)})


@pytest.mark.parametrize(("block_size", "counts"), [(2, [3, 2, 0, 0]), (1, [3, 0, 2, 0])])
def test_trainable_block_without_tokens_still_gets_a_zero_gradient(block_size: int, counts: list[int]) -> None:
    """DDP needs every trainable parameter in each backward, even when no token routed to the owned block (of two
    experts, or of one)."""
    blocks = ExpertBlocks(num_experts=4, block_size=block_size, d_model=8, hidden=8, trainable_block=1)
    for p in [*blocks.w1, *blocks.v1, *blocks.w2]:
        torch.nn.init.normal_(p)
    x = torch.randn(5, 8, requires_grad=True)
    for backend in BACKENDS:
        blocks.zero_grad(set_to_none=True)
        blocks(x, torch.tensor(counts), backend).square().sum().backward()
        for kind in (blocks.w1, blocks.v1, blocks.w2):
            assert kind[0].grad is None  # frozen
            assert kind[1].grad is not None and not kind[1].grad.any()  # owned, untouched by tokens


def test_auto_backend_is_the_loop_off_cuda() -> None:
    from spes.moe import resolve_backend

    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("grouped_mm", torch.device("cpu")) == "grouped_mm"
    assert make_moe("auto").experts.resolved_backend(torch.device("cpu")) == "torch"


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_blocks_held_in_bf16_give_the_same_results_under_autocast(backend: str) -> None:
    """Autocast computes the experts in bf16 whatever they are held in: bf16 frozen blocks give the fp32-held
    ones' outputs and gradients exactly, and the trained block stays fp32 (it has fp32 master weights)."""
    # NOTE: grouped_mm wants bf16 rows of a multiple of 16 bytes: a width of 16
    plain = make_moe(backend, block_size=2, trainable_block=1, hidden=16)
    held = make_moe(backend, block_size=2, trainable_block=1, hidden=16, frozen_dtype=torch.bfloat16)
    held.load_state_dict(plain.state_dict())
    assert [p.dtype for p in held.experts.w1] == [torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16]
    x = torch.randn(4, 9, D, generator=torch.Generator().manual_seed(2))

    def autocast_forward(moe: MoE, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return moe(x)[0].float()

    torch.testing.assert_close(autocast_forward(held, x), autocast_forward(plain, x), atol=0, rtol=0)
    got, want = grads_of(held, x, autocast_forward), grads_of(plain, x, autocast_forward)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_under_autocast_each_routed_copy_is_weighted_in_the_experts_dtype() -> None:
    """As transformers' OLMoE (routing weights cast to the hidden states' dtype): a copy's output times its top-k
    weight is rounded to bf16, then the copies of a token are summed in the output's dtype."""
    moe = make_moe("torch", block_size=2, trainable_block=1)
    x_TD = torch.randn(12, D, generator=torch.Generator().manual_seed(4))
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    moe.experts.register_forward_hook(lambda _m, args, y: seen.append((args[0], args[1], y)))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        out = moe(x_TD)[0]
        topw_TK, topi_TK = moe.router(x_TD).float().softmax(dim=-1).topk(K, dim=-1)
    [(rows_AD, tokens_per_expert_E, y_AD)] = seen
    assert y_AD.dtype == torch.bfloat16
    token_A = torch.tensor([int((x_TD == row).all(-1).nonzero()) for row in rows_AD])  # the copies' tokens
    expert_A = torch.repeat_interleave(torch.arange(E), tokens_per_expert_E)  # copies in expert order
    weight_A = torch.stack([topw_TK[t][topi_TK[t] == e][0] for t, e in zip(token_A.tolist(), expert_A.tolist())])
    weighted = (y_AD * weight_A.to(torch.bfloat16).unsqueeze(-1)).float()
    assert torch.equal(out, torch.zeros_like(x_TD).index_add_(0, token_A, weighted))


@pytest.fixture
def fake_grouped_gemm(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[torch.dtype]]:
    """megablocks importable, with grouped_gemm's `ops.gmm` as its contract says (rows of `a` in consecutive groups of
    `batch_sizes`, a CPU int64 tensor, times `b[i]`; `a` and `b` of one dtype) in plain torch: the megablocks
    backend's own code then runs here. Yields the dtypes gmm was called with."""
    dtypes: list[torch.dtype] = []

    def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor) -> torch.Tensor:
        assert batch_sizes.dtype == torch.long and batch_sizes.device.type == "cpu"
        assert a.dtype == b.dtype and len(batch_sizes) == len(b), (a.dtype, b.dtype, batch_sizes)
        dtypes.append(a.dtype)
        rows = a.split(batch_sizes.tolist())
        return torch.cat([r @ w for r, w in zip(rows, b)])

    grouped_gemm = types.ModuleType("grouped_gemm")
    grouped_gemm.ops = types.SimpleNamespace(gmm=gmm)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "grouped_gemm", grouped_gemm)
    monkeypatch.setitem(sys.modules, "megablocks", types.ModuleType("megablocks"))
    yield dtypes


@pytest.mark.parametrize("block_size", [1, 3])
@pytest.mark.parametrize("trainable_block", [None, 1])
def test_the_megablocks_path_matches_the_naive_loop(
    fake_grouped_gemm: list[torch.dtype], block_size: int, trainable_block: int | None
) -> None:
    moe = make_moe("megablocks", block_size=block_size, trainable_block=trainable_block)
    x = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(moe(x)[0], naive_moe_forward(moe, x), atol=1e-5, rtol=1e-5)
    got, want = grads_of(moe, x, module_forward), grads_of(moe, x, naive_moe_forward)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_under_autocast_the_megablocks_path_multiplies_in_bf16(fake_grouped_gemm: list[torch.dtype]) -> None:
    """gmm is not covered by autocast: the backend casts rows and weights (fp32 trained, bf16 frozen) to bf16
    itself, and gives the loop's results."""
    held = make_moe("megablocks", block_size=2, trainable_block=1, hidden=16, frozen_dtype=torch.bfloat16)
    loop = make_moe("torch", block_size=2, trainable_block=1, hidden=16, frozen_dtype=torch.bfloat16)
    loop.load_state_dict(held.state_dict())
    x = torch.randn(4, 9, D, generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = held(x)[0], loop(x)[0]
    assert fake_grouped_gemm and set(fake_grouped_gemm) == {torch.bfloat16}
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


def test_a_moe_built_with_the_default_backend_runs_the_loop_here() -> None:
    moe = MoE(
        d_model=D,
        hidden=HIDDEN,
        num_experts=E,
        top_k=K,
        block_size=2,
        trainable_block=None,
        num_layers=1,
        lb_weight=0.01,
        z_weight=0.001,
        normalize_p=None,
    )
    moe.load_state_dict(make_moe().state_dict())
    x = torch.randn(2, 5, D)
    torch.testing.assert_close(moe(x)[0], naive_moe_forward(moe, x), atol=1e-5, rtol=1e-5)
    assert moe.experts.backend == "auto" and moe.experts.resolved_backend(x.device) == "torch"
    assert ExpertBlocks(num_experts=E, block_size=2, d_model=D, hidden=HIDDEN, trainable_block=None).backend == "auto"


@pytest.mark.parametrize("backend", BACKENDS)
def test_blocks_without_tokens_before_and_between_others_are_skipped(backend: str) -> None:
    """Only the last blocks got tokens, or none did (an empty batch): each gets what is routed to it."""
    blocks = ExpertBlocks(num_experts=6, block_size=2, d_model=8, hidden=8, trainable_block=None)
    for p in [*blocks.w1, *blocks.v1, *blocks.w2]:
        torch.nn.init.normal_(p)
    x = torch.randn(5, 8)
    got = blocks(x, torch.tensor([0, 0, 3, 0, 0, 2]), backend)
    w1, v1, w2 = full_experts(blocks)
    want = torch.cat([(F.silu(x[r] @ w1[e]) * (x[r] @ v1[e])) @ w2[e] for r, e in ((slice(0, 3), 2), (slice(3, 5), 5))])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        empty = blocks(x[:0], torch.zeros(6, dtype=torch.long), backend)
    assert empty.shape == (0, 8)


def test_the_own_count_scale_is_set_for_a_peer_only() -> None:
    """A full model trains every expert and a peer past the last block none: neither scales any count."""
    for trainable_block in (None, E // 2):
        moe = make_moe(block_size=2, trainable_block=trainable_block)
        moe.set_own_count_scale(0.8)
        assert moe.own_count_scale is None
    moe = make_moe(block_size=2, trainable_block=1)
    moe.set_own_count_scale(0.8)
    assert moe.own_count_scale is not None
    assert moe.own_count_scale.tolist() == pytest.approx([1, 1, 0.8, 0.8, 1, 1, 1, 1])


def test_block_size_one_splits_into_single_experts_and_zero_is_refused() -> None:
    state = {"embed.weight": torch.randn(4, 3), "x.experts.w1": torch.randn(3, 2, 2)}
    blocks = split_expert_blocks(state, 1)
    assert sorted(blocks) == ["embed.weight", "x.experts.w1.0", "x.experts.w1.1", "x.experts.w1.2"]
    with pytest.raises(ValueError, match="^block_size must be >= 1, got 0$"):
        split_expert_blocks(state, 0)


def test_fuse_names_the_blocks_it_found() -> None:
    with pytest.raises(ValueError, match=r"^expert blocks of 'x.experts.w1' are not numbered 0\.\.1: found \[0, 2\]$"):
        fuse_expert_blocks({"x.experts.w1.0": torch.zeros(1, 1, 1), "x.experts.w1.2": torch.zeros(1, 1, 1)})


@pytest.mark.parametrize("cutoff", [None, 3.0])
def test_init_is_olmos_normal_truncated_at_the_cutoff(cutoff: float | None) -> None:
    """N(0, std^2), its tails cut at +-cutoff * std when a cutoff is given (a 3-std cut keeps 98.7% of the std)."""
    std, n = 0.02, 200_000
    t = torch.empty(n)
    torch.manual_seed(0)
    init_truncated_normal_(t, std, cutoff)
    assert abs(float(t.mean())) < 5 * std / math.sqrt(n)
    if cutoff is None:
        assert float(t.std()) == pytest.approx(std, rel=0.01)
        assert int((t.abs() > 3 * std).sum()) > 300  # 0.27% of a normal lies past 3 std
    else:
        assert float(t.std()) == pytest.approx(0.9866 * std, rel=0.01)
        assert -cutoff * std <= float(t.min()) < -0.99 * cutoff * std
        assert 0.99 * cutoff * std < float(t.max()) <= cutoff * std


@pytest.mark.gpu
def test_on_a_gpu_auto_is_grouped_mm_and_a_peers_layer_runs_there() -> None:
    """`auto` resolves to grouped_mm on a CUDA GPU of capability 8.0 or newer, and a SPES peer's layer (its own
    counts scaled, bf16 autocast) runs there with every tensor it makes on the GPU."""
    from spes.moe import resolve_backend

    device = torch.device("cuda")
    assert resolve_backend("auto", device) == "grouped_mm"
    moe = make_moe("auto", block_size=2, trainable_block=1, hidden=16).to(device)
    moe.set_own_count_scale(0.8)
    assert moe.own_count_scale is not None and moe.own_count_scale.device.type == "cuda"
    x = torch.randn(4, 9, D, device=device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, aux = moe(x)
    assert moe.experts.resolved_backend(device) == "grouped_mm"
    assert y.device.type == "cuda" and bool(torch.isfinite(y).all()) and bool(torch.isfinite(aux.lb_loss))
    assert int(aux.tokens_per_expert.sum()) == 4 * 9 * K
