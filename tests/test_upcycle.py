"""Upcycling dense Llama/Qwen3 checkpoints into spes MoEs: exact start, partition mode, refusals, 9B config (the
end-to-end run of configs/upcycle_tiny.yaml is tests/test_shipped_commands.py's)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch.testing import assert_close

from conftest import usage_error
from hf_fixtures import save_tiny_olmoe
from spes import upcycle
from spes.checkpoint import load_model_state
from spes.config import ModelConfig, load_config
from spes.hf import run_config_for
from spes.model import Transformer
from spes.tokenizer import LoadedTokenizer

REPO = Path(__file__).resolve().parents[1]
BASE: dict[str, Any] = dict(
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    n_layers=2,
    moe_num_experts=4,
    moe_top_k=2,
    max_sequence_length=64,
    rope_theta=1e6,
    layer_norm_eps=1e-6,
)
QWEN3 = dict(attention_layer_norm=True, attention_layer_norm_over_head=True)


def model_options(tokenizer: LoadedTokenizer, **options: Any) -> dict[str, Any]:
    return {
        **BASE,
        "vocab_size": tokenizer.vocab_size,
        "embedding_size": tokenizer.vocab_size + 12,
        "mlp_hidden_size": 96,
        **options,
    }


def dense_model(
    tmp_path: Path, m: ModelConfig, model_type: str, tokenizer: LoadedTokenizer, *, partition: bool = False
) -> tuple[Path, torch.nn.Module]:
    """A random dense HF model whose norms are not ones (so their copying is tested), saved and reloaded."""
    path = upcycle.make_random_dense(
        m, tmp_path / "dense", model_type=model_type, partition=partition, tokenizer=tokenizer.path.parent
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return path, model.eval()


def upcycled_logits(
    tmp_path: Path,
    dense_dir: Path,
    options: dict[str, Any],
    ids: torch.Tensor,
    *,
    partition: bool = False,
    router_std: float | None = None,
) -> torch.Tensor:
    cfg = run_config_for(options, experts_per_peer=2, run_name="up")
    step, _ = upcycle.upcycle(dense_dir, cfg, tmp_path / "run" / "step0", partition=partition, router_std=router_std)
    model = Transformer.for_run(cfg)
    model.load_state_dict(load_model_state(step))
    with torch.no_grad():
        return model.eval()(ids).logits


@pytest.mark.parametrize(
    "normalize_p, partition, router_std, std, scale, exact, tied",
    [
        (1.0, False, None, 0.02, 1.0, True, False),  # renormalized copies: any router is exact
        (None, False, 0.0, 0.0, 8 / 2, True, True),  # probabilities 1/E: scale by E/k; a zero router ties
        (None, False, None, 1e-4, 8 / 2, False, False),  # ... so by default a tiny random router breaks the tie
        (2.0, False, 0.0, 0.0, 2**0.5 / 2, True, True),  # weights k^(-1/p) each
        (1.0, True, None, 0.02, 2.0, False, False),  # partition, k < E: each chosen slice counts once
        (None, True, None, 0.02, 8.0, False, False),
    ],
)
def test_expert_plan(
    normalize_p: float | None,
    partition: bool,
    router_std: float | None,
    std: float,
    scale: float,
    exact: bool,
    tied: bool,
) -> None:
    plan = upcycle.expert_plan(
        num_experts=8, top_k=2, normalize_p=normalize_p, partition=partition, init_std=0.02, router_std=router_std
    )
    assert (plan.router_std, plan.exact, plan.tied) == (std, exact, tied)
    assert math.isclose(plan.down_scale, scale)
    every = upcycle.expert_plan(num_experts=8, top_k=8, normalize_p=normalize_p, partition=True, init_std=0.02)
    assert every.exact and every.router_std == 0.0 and not every.tied


@pytest.mark.parametrize(
    "model_type, options, router_std",
    [
        ("qwen3", dict(QWEN3, moe_normalize_expert_weights=True), None),  # random router, per-head QK-norm, GQA
        ("llama", dict(moe_normalize_expert_weights=None), 0.0),  # zero router, experts scaled by E/k
        ("llama", dict(moe_normalize_expert_weights=None), None),  # tie-breaking router: within 1e-4
        ("qwen3", dict(QWEN3, moe_normalize_expert_weights=2.0), 0.0),  # p-norm renormalization
    ],
)
def test_upcycled_moe_equals_dense(
    model_type: str, options: dict[str, Any], router_std: float | None, tmp_path: Path, tokenizer: LoadedTokenizer
) -> None:
    opts = model_options(tokenizer, **options)
    dense_dir, dense = dense_model(tmp_path, ModelConfig(**opts), model_type, tokenizer)
    ids = torch.randint(0, tokenizer.vocab_size, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = dense(ids).logits
    got = upcycled_logits(tmp_path, dense_dir, opts, ids, router_std=router_std)
    assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("router_std, distinct", [(0.0, 2), (None, 4)])
def test_zero_router_keeps_copies_tied_and_the_default_separates_them(
    router_std: float | None, distinct: int, tmp_path: Path, tokenizer: LoadedTokenizer
) -> None:
    """Unnormalized copies: with a zero router, experts and router rows stay in identical pairs under training."""
    opts = model_options(tokenizer, moe_normalize_expert_weights=None)
    dense_dir, _ = dense_model(tmp_path, ModelConfig(**opts), "llama", tokenizer)
    cfg = run_config_for(opts, experts_per_peer=4, run_name="up")
    step, _ = upcycle.upcycle(dense_dir, cfg, tmp_path / "run" / "step0", router_std=router_std)
    model = Transformer.for_run(cfg)
    model.load_state_dict(load_model_state(step))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        ids = torch.randint(0, tokenizer.vocab_size, (4, 17), generator=generator)
        out = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten()) + out.lb_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    ffn = model.blocks[0].ffn
    assert len({tuple(w.flatten().tolist()) for w in ffn.experts.w1[0]}) == distinct
    assert len({tuple(row.tolist()) for row in ffn.router.weight}) == distinct


@pytest.mark.parametrize("normalize", [True, None])
def test_partition_with_every_expert_active_equals_dense(
    normalize: bool | None, tmp_path: Path, tokenizer: LoadedTokenizer
) -> None:
    opts = model_options(tokenizer, **QWEN3, moe_top_k=4, mlp_hidden_size=24, moe_normalize_expert_weights=normalize)
    dense_dir, dense = dense_model(tmp_path, ModelConfig(**opts), "qwen3", tokenizer, partition=True)
    assert dense.config.intermediate_size == 48  # 4 experts x 12
    ids = torch.randint(0, tokenizer.vocab_size, (1, 17))
    with torch.no_grad():
        expected = dense(ids).logits
    assert_close(upcycled_logits(tmp_path, dense_dir, opts, ids, partition=True), expected, atol=1e-4, rtol=1e-4)


def test_partition_slices_the_dense_mlp(tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    opts = model_options(tokenizer, **QWEN3, mlp_hidden_size=24, moe_normalize_expert_weights=True)
    dense_dir, dense = dense_model(tmp_path, ModelConfig(**opts), "qwen3", tokenizer, partition=True)
    cfg = run_config_for(opts, experts_per_peer=4, run_name="up")
    step, plan = upcycle.upcycle(dense_dir, cfg, tmp_path / "run" / "step0", partition=True)
    assert not plan.exact and plan.down_scale == 2.0
    state = load_model_state(step)
    mlp = dense.model.layers[1].mlp
    w1, w2 = state["blocks.1.ffn.experts.w1.0"], state["blocks.1.ffn.experts.w2.0"]
    assert torch.equal(w1[3], mlp.gate_proj.weight[36:48].T)
    assert torch.equal(w2[1], mlp.down_proj.weight[:, 12:24].T * 2.0)


def test_untied_copy_of_tied_embeddings(tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    opts = model_options(tokenizer, **QWEN3, moe_normalize_expert_weights=True)
    dense_dir, dense = dense_model(tmp_path, ModelConfig(**opts), "qwen3", tokenizer)
    assert dense.config.tie_word_embeddings
    cfg = run_config_for(opts, experts_per_peer=2, run_name="up")
    step, _ = upcycle.upcycle(dense_dir, cfg, tmp_path / "r" / "step0")
    state = load_model_state(step)
    assert torch.equal(state["lm_head.weight"], state["embed.weight"])
    assert state["lm_head.weight"].data_ptr() != state["embed.weight"].data_ptr()


# ---------------------------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(mlp_hidden_size=48), r"'model.mlp_hidden_size' = 48 must be 96: .* 2 \* intermediate_size = 2 \* 48"),
        (dict(attention_layer_norm=False), r"'model.attention_layer_norm' = False must be True"),
        (dict(attention_layer_norm_over_head=False), r"'model.attention_layer_norm_over_head' = False must be True"),
        (dict(n_kv_heads=4), r"'model.n_kv_heads' = 4 must be 2"),
        (dict(rope_theta=1e4), r"'model.rope_theta' = 10000.0 must be 1000000.0"),
    ],
)
def test_mismatched_config_is_refused(
    change: dict[str, Any], message: str, tmp_path: Path, tokenizer: LoadedTokenizer
) -> None:
    opts = model_options(tokenizer, **QWEN3, moe_normalize_expert_weights=True)
    dense_dir, _ = dense_model(tmp_path, ModelConfig(**opts), "qwen3", tokenizer)
    with pytest.raises(ValueError, match=message):
        upcycle.upcycle(
            dense_dir, run_config_for({**opts, **change}, experts_per_peer=2, run_name="x"), tmp_path / "step0"
        )


def test_partition_needs_equal_slices(tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    opts = model_options(tokenizer, **QWEN3, moe_normalize_expert_weights=True)
    dense_dir, _ = dense_model(tmp_path, ModelConfig(**opts), "qwen3", tokenizer)
    with pytest.raises(ValueError, match="intermediate_size 48 does not split into model.moe_num_experts=5"):
        upcycle.upcycle(
            dense_dir,
            run_config_for({**opts, "moe_num_experts": 5}, experts_per_peer=5, run_name="x"),
            tmp_path / "step0",
            partition=True,
        )
    with pytest.raises(ValueError, match=r"'model.mlp_hidden_size' = 96 must be 24: .* 2 \* 48 / 4"):
        upcycle.upcycle(
            dense_dir, run_config_for(opts, experts_per_peer=2, run_name="x"), tmp_path / "step0", partition=True
        )


def test_unsupported_dense_models_are_refused(tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    opts = model_options(tokenizer, moe_normalize_expert_weights=True)
    cfg = run_config_for(opts, experts_per_peer=2, run_name="x")
    config = transformers.LlamaConfig(
        vocab_size=opts["embedding_size"],
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-6,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(str(tmp_path / "biased"))
    with pytest.raises(ValueError, match="'attention_bias' = True is not supported"):
        upcycle.upcycle(tmp_path / "biased", cfg, tmp_path / "a" / "step0")
    moe = save_tiny_olmoe(tmp_path / "moe")
    with pytest.raises(
        ValueError,
        match=r"model_type 'olmoe' is not supported here; expected one of \['llama', "
        r"'qwen3'\]",
    ):
        upcycle.upcycle(moe, cfg, tmp_path / "b" / "step0")


def test_cli(tmp_path: Path, tokenizer: LoadedTokenizer, capsys: pytest.CaptureFixture[str]) -> None:
    config = REPO / "configs" / "upcycle_tiny.yaml"
    overrides = [
        f"--tokenizer.identifier={tokenizer.path.parent}",
        f"--model.vocab_size={tokenizer.vocab_size}",
        f"--model.embedding_size={tokenizer.vocab_size}",
    ]
    dense = str(tmp_path / "dense")
    assert upcycle.main(["--config", str(config), "--hf", dense, "--make_random_dense", "qwen3", *overrides]) == 0
    out = tmp_path / "init" / "step0"
    assert upcycle.main(["--config", str(config), "--hf", dense, "--out", str(out), *overrides]) == 0
    assert "equals the dense model at step 0" in capsys.readouterr().out
    assert load_config(out / "config.yaml")[0].experts_per_peer == 2
    assert upcycle.main(["--config", str(config), "--hf", dense, "--out", str(out), *overrides]) == 2
    assert "--overwrite" in capsys.readouterr().err
    smaller_vocab = f"--model.vocab_size={tokenizer.vocab_size - 1}"
    assert (
        upcycle.main(
            ["--config", str(config), "--hf", dense, "--out", str(tmp_path / "x" / "step0"), *overrides, smaller_vocab]
        )
        == 2
    )
    assert f"model.vocab_size={tokenizer.vocab_size - 1} but the tokenizer has" in capsys.readouterr().err
    for std in ("-0.1", "nan"):
        bad = ["--config", str(config), "--hf", dense, "--out", str(tmp_path / "y" / "step0"), "--router_std", std]
        rule = f"argument --router_std: {std} must be a finite number >= 0"
        assert usage_error(capsys, lambda bad=bad: upcycle.main([*bad, *overrides])).endswith(f": error: {rule}")


# ---------------------------------------------------------------------------------------------------------------
# Shipped configs


def test_9b_config_upcycles_qwen3_1_7b_shapes() -> None:
    """configs/upcycled_9b matches the published Qwen3-1.7B config (shapes only, no weights)."""
    qwen3_1_7b = transformers.Qwen3Config(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        max_position_embeddings=40960,
    )
    configs = [load_config(REPO / "configs" / "upcycled_9b" / f"node_{n}.yaml")[0] for n in range(8)]
    for n, cfg in enumerate(configs):
        upcycle.check_dense_match(cfg.model, qwen3_1_7b, upcycle.DENSE_FAMILIES["qwen3"], partition=False)
        assert cfg.spes_config.peer_id == n and cfg.data_seed == 6198 + 1000 * n
        assert cfg.owned_experts() == (min(2 * n, 8), min(2 * n + 2, 8))  # nodes 4..7 own no expert
        assert cfg.model == configs[0].model and cfg.load_path == configs[0].load_path
    m = configs[0].model
    assert (
        m.moe_num_experts,
        m.moe_top_k,
        m.normalize_expert_weights_p,
        m.max_sequence_length,
        m.vocab_size,
        m.embedding_size,
    ) == (8, 2, 1.0, 4096, 151669, 151936)
    plan = upcycle.expert_plan(num_experts=8, top_k=2, normalize_p=1.0, partition=False, init_std=m.init_std)
    assert plan.exact and plan.router_std == 0.02 and not plan.tied
