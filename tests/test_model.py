"""Tests of spes.model: parameter accounting of the shipped configs, expert freezing under SPES (no gradient,
no optimizer state, bit-identical frozen experts), causality, layout-independent init, and bf16 autocast."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from spes.config import TrainConfig, load_config
from spes.head_loss import ChunkFns, chunk_loss_grads, chunk_loss_sums
from spes.model import (
    ParamCounts,
    RMSNorm,
    Transformer,
    analytic_param_counts,
    apply_rope,
    count_params,
    rope_tables,
    tflops_done_per_token,
    tflops_per_token,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def tiny(*overrides: str) -> TrainConfig:
    return load_config(CONFIGS / "tiny.yaml", list(overrides))[0]


def built(cfg: TrainConfig, seed: int = 0) -> Transformer:
    """The node's model, built on the meta device and materialized on the CPU as the trainer does."""
    with torch.device("meta"):
        model = Transformer.for_run(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def test_paper_1b_parameter_counts() -> None:
    cfg = load_config(CONFIGS / "spes_1b" / "node_0.yaml")[0]
    with torch.device("meta"):
        model = Transformer.for_run(cfg)
    counts = count_params(model)
    assert counts == analytic_param_counts(cfg.model, trained_experts=4)
    # The same numbers written out: d=768, L=12, 16 experts of width 2048, 151936 embedding rows, QK-norm.
    d, layers, experts, width, rows = 768, 12, 16, 2048, 151936
    per_layer_shared = 4 * d * d + 2 * d + 2 * d + experts * d  # q,k,v,o + QK-norm + 2 RMSNorms + router
    shared = layers * per_layer_shared + 2 * rows * d + d  # + embedding, LM head, final norm
    one_expert = 3 * d * width
    assert counts.total == shared + layers * experts * one_expert == 1_167_840_000
    assert counts.active_per_token == shared + layers * 2 * one_expert == 375_116_544
    assert counts.trainable == shared + layers * 4 * one_expert == 488_362_752


def test_paper_1b_flops_per_token_written_out() -> None:
    """MFU's numerator: 6 FLOPs per active matmul parameter (forward 2, input gradient 2, weight gradient 2; the input
    embedding is a lookup, no matmul) plus causal attention's 12 L d S / 2; a node that trains a share s of the
    routed copies' experts skips the weight gradient of the rest (4 + 2 s per expert parameter)."""
    model = load_config(CONFIGS / "spes_1b" / "node_0.yaml")[0].model
    d, layers, width, seq, rows = 768, 12, 2048, 2048, 151936
    matmul = 375_116_544 - rows * d  # active per token (test_paper_1b_parameter_counts) less the input embedding
    expert = layers * 2 * 3 * d * width  # top-2 SwiGLU experts
    attention = 12 * layers * d * seq // 2
    assert tflops_per_token(model) == (6 * matmul + attention) / 1e12  # integers summed exactly, then one division
    assert tflops_per_token(model) == pytest.approx(0.001664, abs=1e-6)  # issue 29's figure
    for share in (0.0, 0.25, 1.0):
        done = 6 * (matmul - expert) + (4 + 2 * share) * expert + attention
        assert tflops_done_per_token(model, share) == done / 1e12


@pytest.mark.parametrize("path", ["diloco_1b/node_2.yaml", "centralized_1b.yaml"])
def test_baselines_train_every_parameter(path: str) -> None:
    cfg = load_config(CONFIGS / path)[0]
    with torch.device("meta"):
        counts = count_params(Transformer.for_run(cfg))
    assert counts == analytic_param_counts(cfg.model)
    assert counts.trainable == counts.total == 1_167_840_000


@pytest.mark.parametrize(
    "overrides",
    [
        ["--model.n_kv_heads=2"],
        ["--model.attention_layer_norm=true", "--model.attention_layer_norm_over_head=true", "--model.n_kv_heads=2"],
        ["--model.attention_layer_norm=true", "--model.attention_layer_norm_with_affine=false"],
        ["--model.mlp_hidden_size=null", "--model.mlp_ratio=3"],
        ["--model.embedding_size=4160"],
        ["--model.layer_norm_with_affine=false"],
    ],
)
def test_param_counts_of_model_variants(overrides: list[str]) -> None:
    cfg = tiny(*overrides)
    model = built(cfg)
    assert count_params(model) == analytic_param_counts(cfg.model, trained_experts=2)
    m, attn = cfg.model, model.blocks[0].attn
    assert attn.k_proj.weight.shape == (m.n_kv_heads * m.head_dim, m.d_model)
    if m.attention_layer_norm and m.attention_layer_norm_with_affine:
        q_norm_size = m.head_dim if m.attention_layer_norm_over_head else m.d_model
        assert attn.q_norm is not None and attn.q_norm.weight is not None
        assert attn.q_norm.weight.shape == (q_norm_size,)
    assert model.blocks[0].ffn.experts.w1[0].shape == (2, m.d_model, m.mlp_hidden_size // 2)
    logits = model(torch.randint(0, m.vocab_size, (2, 16))).logits
    assert logits.shape == (2, 16, m.embedding_size) and bool(torch.isfinite(logits).all())


def test_mlp_ratio_sets_the_expert_width() -> None:
    cfg = tiny("--model.mlp_hidden_size=null", "--model.mlp_ratio=3")
    assert cfg.model.mlp_hidden_size == 3 * 64 and cfg.model.expert_hidden_size == 96


def test_only_the_owned_block_and_shared_parameters_train() -> None:
    model = built(tiny("--spes_config.peer_id=1"))
    for name, p in model.named_parameters():
        expert = re.fullmatch(r"blocks\.\d+\.ffn\.experts\.(w1|v1|w2)\.(\d+)", name)
        assert p.requires_grad == (expert is None or expert.group(2) == "1"), name
    assert sum(".experts." in n for n, p in model.named_parameters() if p.requires_grad) == 2 * 3  # layers x kinds


def loss_of(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return ce + out.lb_loss + out.z_loss


def test_frozen_experts_stay_bit_identical_without_grad_or_optimizer_state() -> None:
    torch.manual_seed(0)
    model = built(tiny("--spes_config.peer_id=2"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, torch.randint(0, 4096, (4, 32))).backward()
        optimizer.step()

    for name, p in model.named_parameters():
        if p.requires_grad:
            assert not torch.equal(p, before[name]), f"{name} did not train"
        else:
            assert ".experts." in name and not name.endswith(".2")
            assert p.grad is None and torch.equal(p, before[name]), f"frozen {name} changed"
    state = optimizer.state_dict()["state"]
    assert len(state) == len(trainable)
    moment_bytes = sum(t.numel() * t.element_size() for s in state.values() for k, t in s.items() if k != "step")
    assert moment_bytes == 2 * 4 * count_params(model).trainable  # exp_avg + exp_avg_sq in fp32
    assert all(s["step"].numel() == 1 for s in state.values())


def test_causal() -> None:
    model = built(tiny()).eval()
    ids = torch.randint(0, 4096, (2, 48), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[:, 30] = (ids[:, 30] + 1) % 4096
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :30], b[:, :30], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 30:], b[:, 30:])


def test_init_is_identical_across_block_layouts_and_devices() -> None:
    cfg = tiny()
    layouts = [Transformer(cfg.model, block_size=k, trainable_block=0 if k < 8 else None) for k in (2, 3, 8)]
    for model in layouts:
        model.init_weights(1234)
    layouts.append(built(cfg, seed=1234))  # meta -> to_empty -> init, block size 2

    def flat(model: Transformer) -> dict[str, torch.Tensor]:
        """Every parameter, with each expert kind of a layer joined into one (E, ...) tensor."""
        out: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():
            key = re.sub(r"\.\d+$", "", name) if ".experts." in name else name
            out[key] = torch.cat([out[key], p.detach()]) if key in out else p.detach()
        return out

    reference = flat(layouts[0])
    assert reference["blocks.0.ffn.experts.w1"].shape[0] == 8
    for model in layouts[1:]:
        other = flat(model)
        assert other.keys() == reference.keys()
        for key in reference:
            assert torch.equal(other[key], reference[key]), key
    assert not torch.equal(flat(built(cfg, seed=1235))["blocks.0.ffn.experts.w1"], reference["blocks.0.ffn.experts.w1"])


def test_init_is_truncated_normal() -> None:
    model = built(load_config(CONFIGS / "small.yaml")[0])
    w = torch.cat([p.detach().flatten() for n, p in model.named_parameters() if p.ndim >= 2])
    assert w.abs().max() <= 3 * 0.02 + 1e-7
    assert w.std().item() == pytest.approx(0.02 * 0.986, rel=0.02)  # std of N(0,1) truncated at +-3 is 0.9866


@pytest.mark.parametrize("backend", ["torch", "grouped_mm"])
def test_bf16_autocast_forward_and_backward_on_cpu(backend: str) -> None:
    model = built(tiny(f"--model.moe_backend={backend}"))
    ids = torch.randint(0, 4096, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids)
        loss = loss_of(model, ids)
    assert out.logits.dtype == torch.bfloat16 and bool(torch.isfinite(out.logits.float()).all())
    loss.backward()
    owned = model.blocks[0].ffn.experts.w1[0]
    assert owned.grad is not None and owned.grad.dtype == torch.float32 and bool(torch.isfinite(owned.grad).all())
    with torch.no_grad():
        fp32 = model(ids).logits
    torch.testing.assert_close(out.logits.float(), fp32, atol=0.1, rtol=0.1)


def test_sequence_longer_than_max_sequence_length_is_refused() -> None:
    model = built(tiny())
    assert model(torch.zeros(2, 64, dtype=torch.long)).logits.shape[1] == 64  # the longest there is
    with pytest.raises(ValueError, match="^a sequence of 65 tokens is longer than model.max_sequence_length=64: "):
        model(torch.zeros(2, 65, dtype=torch.long))


def test_frozen_experts_are_held_in_bf16_only_by_an_amp_bf16_node_that_trains() -> None:
    amp = tiny("--precision=amp_bf16", "--spes_config.peer_id=1")

    def dtypes(model: Transformer) -> set[tuple[bool, torch.dtype]]:
        return {(p.requires_grad, p.dtype) for p in model.parameters()}

    assert dtypes(Transformer.for_run(amp, training=True)) == {(True, torch.float32), (False, torch.bfloat16)}
    assert dtypes(Transformer.for_run(amp)) == {(True, torch.float32), (False, torch.float32)}  # an export, an eval
    assert dtypes(Transformer.for_run(tiny("--spes_config.peer_id=1"), training=True)) == {
        (True, torch.float32),
        (False, torch.float32),
    }


def test_rope_is_rotate_half_with_llamas_frequencies_and_keeps_the_dtype() -> None:
    """cos/sin[s, i] of angle s theta^(-2i/d) for i < d/2, repeated for the second half; x rotated as
    (x1 cos - x2 sin, x2 cos + x1 sin) over its halves x1, x2."""
    seq, dim, theta = 5, 8, 500.0
    cos, sin = rope_tables(seq, dim, theta)
    angle = torch.arange(seq, dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, dim, 2) / dim)
    torch.testing.assert_close(cos, angle.cos().repeat(1, 2).float())
    torch.testing.assert_close(sin, angle.sin().repeat(1, 2).float())
    x = torch.randn(2, 3, seq, dim, generator=torch.Generator().manual_seed(0))
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    c, s_ = cos[:, : dim // 2], sin[:, : dim // 2]
    torch.testing.assert_close(apply_rope(x, cos, sin), torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], dim=-1))
    assert apply_rope(x.bfloat16(), cos, sin).dtype == torch.bfloat16
    model = built(tiny())
    assert "rope_cos" not in model.state_dict() and "rope_sin" not in model.state_dict()  # recomputed, not saved


def test_rms_norm_is_x_over_its_root_mean_square_times_the_weight_in_the_inputs_dtype() -> None:
    norm = RMSNorm(4, eps=0.5)
    assert norm.weight is not None and RMSNorm(4, eps=0.5, affine=False).weight is None
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    want = x / (x.square().mean() + 0.5).sqrt() * norm.weight
    torch.testing.assert_close(norm(x), want.detach())
    assert norm(x.bfloat16()).dtype == torch.bfloat16


def test_attention_dropout_drops_in_training_only() -> None:
    ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(1))
    plain, dropping = built(tiny()), built(tiny("--model.attention_dropout=0.5"))
    with torch.no_grad():
        torch.testing.assert_close(dropping.eval()(ids).logits, plain.eval()(ids).logits)
        assert not torch.allclose(dropping.train()(ids).logits, plain.train()(ids).logits)


def test_the_aux_losses_and_counts_are_the_layers_summed_and_stacked_on_either_path() -> None:
    cfg = tiny()
    model = built(cfg)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    layers: list = []
    for block in model.blocks:
        block.ffn.register_forward_hook(lambda _m, _i, out: layers.append(out[1]))
    with torch.no_grad():
        whole = model(ids[:, :-1])
        fused = model(ids[:, :-1], ids[:, 1:], logit_z_weight=1e-2)
    first = layers[: len(model.blocks)]
    torch.testing.assert_close(whole.lb_loss, sum(a.lb_loss for a in first))
    torch.testing.assert_close(whole.z_loss, sum(a.z_loss for a in first))
    assert whole.z_loss > 0 and whole.lb_loss > 0
    assert torch.equal(whole.tokens_per_expert, torch.stack([a.tokens_per_expert for a in first]))
    assert whole.tokens_per_expert.sum(-1).tolist() == [2 * 8 * cfg.model.moe_top_k] * cfg.model.n_layers
    torch.testing.assert_close(fused.z_loss, whole.z_loss)
    assert torch.equal(fused.tokens_per_expert, whole.tokens_per_expert)
    assert whole.logits is not None and fused.logit_z_sum is not None and fused.ce_sum is not None
    torch.testing.assert_close(fused.logit_z_sum, torch.logsumexp(whole.logits.float(), dim=-1).square().sum())
    torch.testing.assert_close(fused.loss_sum, fused.ce_sum + 1e-2 * fused.logit_z_sum)


def test_the_head_runs_the_models_chunk_fns_which_compile_replaces() -> None:
    model = built(tiny())
    assert isinstance(model.head_chunk_fns, ChunkFns)
    called: list[str] = []

    def sums(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        called.append("sums")
        return chunk_loss_sums(*args)  # type: ignore[arg-type]

    def grads(*args: object) -> tuple[torch.Tensor, ...]:
        called.append("grads")
        return chunk_loss_grads(*args)  # type: ignore[arg-type]

    model.head_chunk_fns = ChunkFns(sums, grads)
    ids = torch.randint(0, 4096, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids[:, :-1], ids[:, 1:])
    model(ids[:, :-1], ids[:, 1:]).loss_sum.backward()
    assert called == ["sums", "grads"]


def test_the_decayed_factor_scales_the_own_experts_counts_in_every_layer() -> None:
    model = built(tiny("--spes_config.peer_id=1"))
    model.set_own_count_scale(0.7)
    for block in model.blocks:
        assert block.ffn.own_count_scale.tolist() == pytest.approx([1, 1, 0.7, 0.7, 1, 1, 1, 1])


def test_every_layer_takes_the_configs_backend_and_renormalization() -> None:
    model = built(tiny("--model.moe_backend=grouped_mm", "--model.moe_normalize_expert_weights=2"))
    assert all(b.ffn.experts.backend == "grouped_mm" and b.ffn.normalize_p == 2.0 for b in model.blocks)


def test_param_counts_describe_themselves_in_millions() -> None:
    counts = ParamCounts(total=12_345_678_901, active_per_token=250_000, trainable=2_468_000_000_000)
    assert counts.describe() == (
        "parameters: total 12,345.68M | active per token 0.25M | trainable on this node 2,468,000.00M"
    )
    assert ParamCounts(1, 3_210_987_654, 1).describe().split(" | ")[1] == "active per token 3,210.99M"


def test_given_labels_the_model_returns_loss_sums_instead_of_logits() -> None:
    cfg = tiny()
    model = built(cfg)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    whole = model(ids[:, :-1])
    fused = model(ids[:, :-1], ids[:, 1:], logit_z_weight=1e-2)
    assert fused.logits is None and whole.logits is not None
    want = F.cross_entropy(whole.logits.flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")
    torch.testing.assert_close(fused.ce_sum, want)
    torch.testing.assert_close(fused.lb_loss, whole.lb_loss)
