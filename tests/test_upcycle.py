"""Upcycling dense Llama/Qwen3 checkpoints into spes MoEs: exact start, partition mode, refusals, 9B config (the
end-to-end run of configs/upcycle_tiny.yaml is tests/test_shipped_commands.py's)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch.testing import assert_close

from conftest import usage_error
from dist_helpers import without_torch
from hf_fixtures import UPCYCLE_TINY, perturb_norms, save_tiny_olmoe, tokenizer_overrides
from spes import hf_convert, hf_map, upcycle, upcycling
from spes.checkpoint import load_model_state
from spes.config import ModelConfig, load_config
from spes.hf_convert import run_config_for
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
    path = upcycling.make_random_dense(
        m, tmp_path / "dense", model_type=model_type, partition=partition, tokenizer=tokenizer.path.parent
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    perturb_norms(model)
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
    cfg = run_config_for(options, num_train_experts_per_node=2, run_name="up")
    step, _ = upcycling.upcycle(dense_dir, cfg, tmp_path / "run" / "step0", partition=partition, router_std=router_std)
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
    plan = upcycling.expert_plan(
        num_experts=8, top_k=2, normalize_p=normalize_p, partition=partition, init_std=0.02, router_std=router_std
    )
    assert (plan.router_std, plan.exact, plan.tied) == (std, exact, tied)
    assert math.isclose(plan.down_scale, scale)
    every = upcycling.expert_plan(num_experts=8, top_k=8, normalize_p=normalize_p, partition=True, init_std=0.02)
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
    cfg = run_config_for(opts, num_train_experts_per_node=4, run_name="up")
    step, _ = upcycling.upcycle(dense_dir, cfg, tmp_path / "run" / "step0", router_std=router_std)
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
    cfg = run_config_for(opts, num_train_experts_per_node=4, run_name="up")
    step, plan = upcycling.upcycle(dense_dir, cfg, tmp_path / "run" / "step0", partition=True)
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
    cfg = run_config_for(opts, num_train_experts_per_node=2, run_name="up")
    step, _ = upcycling.upcycle(dense_dir, cfg, tmp_path / "r" / "step0")
    state = load_model_state(step)
    assert torch.equal(state["lm_head.weight"], state["embed.weight"])
    assert state["lm_head.weight"].data_ptr() != state["embed.weight"].data_ptr()


def test_a_dense_tokenizer_of_another_eos_is_named(
    tmp_path: Path, tokenizer: LoadedTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    """The 9B config ends documents with Qwen3's <|endoftext|>, while a post-trained model's tokenizer may name its
    end of turn: the shards tokenized with it are refused at the start of training, so upcycling, which reads that
    tokenizer first, says so and what to set."""
    opts = model_options(tokenizer, **QWEN3, moe_normalize_expert_weights=True)
    dense_dir, _ = dense_model(tmp_path, ModelConfig(**opts), "qwen3", tokenizer)
    eos = tokenizer.eos_token_id
    other = eos + 1
    token, other_token = (tokenizer.tokenizer.id_to_token(i) for i in (eos, other))
    with caplog.at_level(logging.WARNING, logger="spes.upcycling"):
        upcycling.upcycle(
            dense_dir, run_config_for(opts, num_train_experts_per_node=2, run_name="up"), tmp_path / "a" / "step0"
        )
        assert caplog.messages == []
        cfg = run_config_for({**opts, "eos_token_id": other}, num_train_experts_per_node=2, run_name="up")
        upcycling.upcycle(dense_dir, cfg, tmp_path / "b" / "step0")
    assert caplog.messages == [
        f"note: the dense model's tokenizer ends documents with {token!r} (id {eos}) but model.eos_token_id is "
        f"{other} ({other_token!r}), and training refuses shards of another EOS: tokenize with eos_token "
        f"{other_token!r} in the tokenizer's tokenizer_config.json, or set model.eos_token_id={eos}"
    ]


# ---------------------------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(mlp_hidden_size=48),
            r"^config key 'model.mlp_hidden_size' = 48 must be 96 = 2 \* intermediate_size = 2 \* 48: each expert is a "
            r"full copy of the dense qwen3 model's MLP, mlp_hidden_size / 2 wide; set "
            r"model.mlp_hidden_size=96 \(or model.mlp_ratio\)$",
        ),
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
        upcycling.upcycle(
            dense_dir,
            run_config_for({**opts, **change}, num_train_experts_per_node=2, run_name="x"),
            tmp_path / "step0",
        )


def test_partition_needs_equal_slices(tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    opts = model_options(tokenizer, **QWEN3, moe_normalize_expert_weights=True)
    dense_dir, _ = dense_model(tmp_path, ModelConfig(**opts), "qwen3", tokenizer)
    with pytest.raises(
        ValueError,
        match=r"^--partition: the dense intermediate_size 48 does not split into model.moe_num_experts=5 equal "
        r"slices; choose a number of experts that divides it, or upcycle without --partition \(every expert a full "
        r"copy\)$",
    ):
        upcycling.upcycle(
            dense_dir,
            run_config_for({**opts, "moe_num_experts": 5}, num_train_experts_per_node=5, run_name="x"),
            tmp_path / "step0",
            partition=True,
        )
    with pytest.raises(
        ValueError,
        match=r"^config key 'model.mlp_hidden_size' = 96 must be 24 = 2 \* intermediate_size / moe_num_experts = "
        r"2 \* 48 / 4: each expert is a slice of the dense qwen3 model's MLP, mlp_hidden_size / 2 "
        r"wide; set model.mlp_hidden_size=24 \(or model.mlp_ratio\)$",
    ):
        upcycling.upcycle(
            dense_dir,
            run_config_for(opts, num_train_experts_per_node=2, run_name="x"),
            tmp_path / "step0",
            partition=True,
        )


def test_the_import_names_the_dense_families_upcycling_takes() -> None:
    assert sorted(hf_map.DENSE_MODEL_TYPES) == sorted(upcycling.DENSE_FAMILIES)


def test_unsupported_dense_models_are_refused(tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    opts = model_options(tokenizer, moe_normalize_expert_weights=True)
    cfg = run_config_for(opts, num_train_experts_per_node=2, run_name="x")
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
        upcycling.upcycle(tmp_path / "biased", cfg, tmp_path / "a" / "step0")
    moe = save_tiny_olmoe(tmp_path / "moe")
    with pytest.raises(
        ValueError,
        match=r"model_type 'olmoe' is not supported here; expected one of \['llama', 'qwen3'\]; it is an MoE "
        rf"already: start a run from it with python -m spes.hf import --hf {moe} --out <dir>/step0$",
    ):
        upcycling.upcycle(moe, cfg, tmp_path / "b" / "step0")
    with pytest.raises(  # the other way round: a dense model given to the import
        ValueError,
        match=r"model_type 'llama' is not supported here; expected one of \['mixtral', 'olmoe', 'qwen3_moe'\]; it is "
        rf"a dense model: upcycle it with python -m spes.upcycle --hf {tmp_path / 'biased'} --config <run.yaml>",
    ):
        hf_convert.import_hf(tmp_path / "biased", tmp_path / "c" / "step0")
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_cli(tmp_path: Path, tokenizer: LoadedTokenizer, capsys: pytest.CaptureFixture[str]) -> None:
    config = UPCYCLE_TINY
    overrides = tokenizer_overrides(tokenizer)
    dense = str(tmp_path / "dense")
    assert upcycle.main(["--config", config, "--hf", dense, "--make_random_dense", "qwen3", *overrides]) == 0
    out = tmp_path / "init" / "step0"
    assert upcycle.main(["--config", config, "--hf", dense, "--out", str(out), *overrides]) == 0
    assert "equals the dense model at step 0" in capsys.readouterr().out
    assert load_config(out / "config.yaml")[0].experts_per_block == 2
    assert upcycle.main(["--config", config, "--hf", dense, "--out", str(out), *overrides]) == 2
    assert "--overwrite" in capsys.readouterr().err
    smaller_vocab = f"--model.vocab_size={tokenizer.vocab_size - 1}"
    assert (
        upcycle.main(
            ["--config", config, "--hf", dense, "--out", str(tmp_path / "x" / "step0"), *overrides, smaller_vocab]
        )
        == 2
    )
    assert f"model.vocab_size={tokenizer.vocab_size - 1} but the tokenizer has" in capsys.readouterr().err
    for std in ("-0.1", "nan"):
        bad = ["--config", config, "--hf", dense, "--out", str(tmp_path / "y" / "step0"), "--router_std", std]
        rule = f"argument --router_std: {std} must be a finite number >= 0"
        assert usage_error(capsys, lambda bad=bad: upcycle.main([*bad, *overrides])).endswith(f": error: {rule}")


# ---------------------------------------------------------------------------------------------------------------
# Shipped configs


def test_the_9b_config_shrunk_upcycles_a_qwen3_into_the_same_model(
    tmp_path: Path, tokenizer: LoadedTokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    """The 9B run's own settings (renormalized top-2 of 8, per-head QK-norm, GQA, RoPE 1e6, untied head from a tied
    embedding), shrunk by --section.key=value as a user without the 1.7B model would: the upcycled MoE's logits
    are a transformers Qwen3's, laid out by transformers itself (not spes's make_random_dense)."""
    dense_config = transformers.Qwen3Config(
        vocab_size=tokenizer.vocab_size + 8,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
    )
    torch.manual_seed(3)
    dense = transformers.Qwen3ForCausalLM(dense_config).eval()
    perturb_norms(dense)
    dense.save_pretrained(str(tmp_path / "dense"))
    shrink = "d_model=32 n_heads=4 n_kv_heads=2 n_layers=2 mlp_hidden_size=80 max_sequence_length=64"
    argv = [f"--model.{kv}" for kv in shrink.split()] + [
        f"--model.vocab_size={tokenizer.vocab_size}",
        f"--model.embedding_size={tokenizer.vocab_size + 8}",
        f"--model.eos_token_id={tokenizer.eos_token_id}",
        f"--model.pad_token_id={tokenizer.pad_token_id}",
        f"--tokenizer.identifier={tokenizer.path.parent}",
    ]
    config = str(REPO / "configs" / "upcycled_9b" / "node_0.yaml")
    step = tmp_path / "init" / "step0"
    assert upcycle.main(["--hf", str(tmp_path / "dense"), "--config", config, "--out", str(step), *argv]) == 0
    assert "equals the dense model at step 0" in capsys.readouterr().out
    cfg = load_config(step / "config.yaml")[0]
    model = Transformer.for_run(cfg)
    model.load_state_dict(load_model_state(step))
    ids = torch.randint(0, tokenizer.vocab_size, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(model.eval()(ids).logits, dense(ids).logits, atol=1e-5, rtol=1e-5)


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
        upcycling.check_dense_match(cfg.model, qwen3_1_7b, upcycling.DENSE_FAMILIES["qwen3"], partition=False)
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
    plan = upcycling.expert_plan(num_experts=8, top_k=2, normalize_p=1.0, partition=False, init_std=m.init_std)
    assert plan.exact and plan.router_std == 0.02 and not plan.tied


# ---------------------------------------------------------------------------------------------------------------
# The plan's edges, the files written, and the command line


def test_a_stated_router_std_is_taken_in_every_mode() -> None:
    """--router_std overrides the automatic choice in partition and in renormalized copy mode too; a zero router
    makes partition exact only with every expert active."""
    common = dict(num_experts=8, init_std=0.02, router_std=0.5)
    part = upcycling.expert_plan(top_k=2, normalize_p=1.0, partition=True, **common)
    copy = upcycling.expert_plan(top_k=2, normalize_p=1.0, partition=False, **common)
    plain = upcycling.expert_plan(top_k=2, normalize_p=None, partition=False, **common)
    assert (part.router_std, copy.router_std, plain.router_std) == (0.5, 0.5, 0.5)
    assert part.partition is True and copy.partition is False and plain.partition is False
    assert (copy.exact, copy.tied, plain.exact, plain.tied) == (True, False, False, False)
    zero = upcycling.expert_plan(num_experts=8, top_k=2, normalize_p=1.0, partition=True, init_std=0.02, router_std=0.0)
    assert not zero.exact and zero.router_std == 0.0


def test_the_router_init_is_truncated_at_the_configs_cutoff(tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    opts = model_options(tokenizer, **QWEN3, moe_normalize_expert_weights=True, init_cutoff_factor=1.0)
    dense_dir, _ = dense_model(tmp_path, ModelConfig(**opts), "qwen3", tokenizer)
    cfg = run_config_for(opts, num_train_experts_per_node=4, run_name="up")
    step, plan = upcycling.upcycle(dense_dir, cfg, tmp_path / "run" / "step0", router_std=1.0)
    routers = torch.cat([load_model_state(step)[f"blocks.{i}.ffn.router.weight"] for i in range(2)])
    assert plan.router_std == 1.0 and routers.abs().max() <= 1.0 and routers.std() > 0.4


def test_what_an_upcycled_checkpoint_holds_and_where_its_tokenizer_goes(
    tmp_path: Path, tokenizer: LoadedTokenizer
) -> None:
    opts = model_options(tokenizer, **QWEN3, moe_normalize_expert_weights=True)
    m = ModelConfig(**opts)
    dense_dir, _ = dense_model(tmp_path, m, "qwen3", tokenizer)
    config = transformers.AutoConfig.from_pretrained(str(dense_dir), local_files_only=True)
    assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (m.eos_token_id, m.pad_token_id, None)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    cfg = run_config_for(opts, num_train_experts_per_node=2, run_name="up")
    step, _ = upcycling.upcycle(dense_dir, cfg, tmp_path / "run" / "step0")
    assert load_config(step / "config.yaml")[0].tokenizer.identifier == str(tmp_path / "run" / "tokenizer")
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").is_file()
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        upcycling.upcycle(dense_dir, cfg, step)
    (dense_dir / "tokenizer.json").unlink()  # a dense model without a tokenizer: the config's stays
    bare, _ = upcycling.upcycle(dense_dir, cfg, tmp_path / "bare" / "step0")
    assert load_config(bare / "config.yaml")[0].tokenizer.identifier == cfg.tokenizer.identifier
    assert not (tmp_path / "bare" / "tokenizer").exists()
    plain = upcycling.make_random_dense(m, tmp_path / "plain")
    again = upcycling.make_random_dense(m, tmp_path / "again", model_type="qwen3", partition=False, seed=0)
    assert not (plain / "tokenizer.json").exists()
    assert (plain / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    assert transformers.AutoConfig.from_pretrained(str(plain), local_files_only=True).intermediate_size == 48
    with pytest.raises(ValueError, match=f"model.vocab_size={tokenizer.vocab_size - 1}"):
        upcycling.make_random_dense(
            ModelConfig(**{**opts, "vocab_size": tokenizer.vocab_size - 1}), tmp_path / "v", tokenizer=tokenizer.path
        )


def test_refusals_name_the_dense_config_and_the_architecture(tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    opts = model_options(tokenizer, **QWEN3, moe_normalize_expert_weights=True)
    dense_dir, _ = dense_model(tmp_path, ModelConfig(**opts), "qwen3", tokenizer)
    for change in (dict(layer_norm_with_affine=False), dict(attention_layer_norm_with_affine=False)):
        ((key, value),) = change.items()
        with pytest.raises(ValueError) as err:
            upcycling.upcycle(
                dense_dir, run_config_for({**opts, **change}, num_train_experts_per_node=2, run_name="x"), "step0"
            )
        assert str(err.value) == (
            f"config key 'model.{key}' = {value!r} must be True to match the dense Hugging Face config (qwen3)"
        )
    longer = run_config_for(
        {**opts, "max_sequence_length": 4096, "init_std": 0.5}, num_train_experts_per_node=2, run_name="x"
    )
    upcycling.check_dense_match(
        longer.model,
        transformers.AutoConfig.from_pretrained(str(dense_dir)),
        upcycling.DENSE_FAMILIES["qwen3"],
        partition=False,
    )  # the window and the init are the run's own
    state = dict(hf_convert.read_hf_weights(dense_dir))
    del state["model.norm.weight"]
    hf_convert.write_safetensors(iter(state.items()), dense_dir)
    with pytest.raises(
        ValueError,
        match=r"^Hugging Face weights have no tensor 'model.norm.weight' \(expected for "
        r"Qwen3ForCausalLM\)$",
    ):
        upcycling.upcycle(
            dense_dir, run_config_for(opts, num_train_experts_per_node=2, run_name="x"), tmp_path / "y" / "step0"
        )
    with pytest.raises(FileNotFoundError, match="--hf"):
        upcycling.upcycle(
            tmp_path / "nowhere", run_config_for(opts, num_train_experts_per_node=2, run_name="x"), "step0"
        )


def test_the_command_line_prints_the_plan_and_warns_of_tied_experts(
    tmp_path: Path, tokenizer: LoadedTokenizer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = UPCYCLE_TINY
    overrides = tokenizer_overrides(tokenizer)
    dense = str(tmp_path / "dense")
    assert upcycle.main(["--config", config, "--hf", dense, "--make_random_dense", "qwen3", *overrides]) == 0
    made = capsys.readouterr()  # NOTE: not transformers' `Writing model shards: 100%|...` bar on stderr
    assert made.out == f"{dense}\n" and made.err == "" and (tmp_path / "dense" / "tokenizer.json").is_file()
    assert transformers.utils.logging.is_progress_bar_enabled()  # off only while spes writes the model
    out = tmp_path / "init" / "step0"
    assert upcycle.main(["--config", config, "--hf", dense, "--out", str(out), "--router_std", "0", *overrides]) == 0
    printed = capsys.readouterr()
    assert printed.out == f"{out}  (router zeros, down projection x 1, equals the dense model at step 0)\n"
    assert printed.err == (
        "note: every expert and every router row starts identical, so they get identical gradients and stay tied; "
        "for training, leave --router_std at its default\n"
    )
    assert torch.count_nonzero(load_model_state(out)["blocks.0.ffn.router.weight"]) == 0
    argv = ["--config", config, "--hf", dense, "--out", str(out), "--partition", "--overwrite", "--router_std", "0.5"]
    assert upcycle.main([*argv, *overrides, "--model.mlp_hidden_size=32"]) == 0
    assert capsys.readouterr().out == (
        f"{out}  (router random, std 0.5, down projection x 2, approximates the dense model)\n"
    )
    assert load_model_state(out)["blocks.0.ffn.experts.w1.0"].shape == (2, 64, 16)  # each expert one slice
    assert upcycle.main(["--config", config, "--hf", dense, *overrides]) == 2
    assert capsys.readouterr().err == (
        "error: --out is required: the checkpoint step directory to write, e.g. output/run/init/step0\n"
    )
    assert usage_error(capsys, lambda: upcycle.main(["--hf", dense])).endswith(
        "error: the following arguments are required: --config"
    )
    assert usage_error(capsys, lambda: upcycle.main(["--config", config])).endswith(
        "error: the following arguments are required: --hf"
    )
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        upcycle.main(["--help"])
    raw = capsys.readouterr().out
    assert "\n    python -m spes.upcycle --hf path/to/Qwen3-1.7B --config configs/upcycled_9b/node_0.yaml \\\n" in raw
    shown = " ".join(raw.split())
    assert shown.startswith("usage: python -m spes.upcycle [-h] --hf HF --config CONFIG [--out OUT] [--partition]")
    assert upcycle.__doc__ is not None and " ".join(upcycle.__doc__.split()) in shown
    for flag, meaning in {
        "--hf HF": "dense HF model directory or Hub id (e.g. Qwen/Qwen3-1.7B; local cache first), model_type one of "
        "['llama', 'qwen3']",
        "--config CONFIG": "the spes run config (YAML) the MoE is built from",
        "--out OUT": "output checkpoint step directory, e.g. output/run/init/step0; point the run's load_path at it",
        "--partition": "split the dense intermediate dim across experts instead of copying it into each",
        "--router_std ROUTER_STD": "router init std, overriding the automatic choice (see above); 0 = all zeros, the "
        "exact start of the copy modes without sum-to-one top-k weights (experts then stay tied)",
        "--overwrite": "replace --out (with --make_random_dense: --hf) if it exists",
        "--make_random_dense {llama,qwen3}": "demo/testing only: write a random dense model of this type that "
        "--config can upcycle to --hf (with the config's tokenizer when it exists), then exit",
    }.items():
        assert f"{flag} {meaning}" in shown, flag


@pytest.mark.timeout(180)
def test_help_and_a_refused_command_line_or_config_are_answered_without_torch(tmp_path: Path) -> None:
    """Importing torch took most of the two seconds `--help` took (longer on a busy host): the command line and the
    run config are read, and refused, before it, with the same lines and exit codes."""
    code, out, err = without_torch(tmp_path, "spes.upcycle", "--help")
    assert code == 0 and out.startswith("usage: python -m spes.upcycle [-h] --hf HF --config CONFIG") and not err
    config = UPCYCLE_TINY
    refused = {
        (): "python -m spes.upcycle: error: the following arguments are required: --hf, --config",
        ("--hf", "h", "--config", config, "--router_std", "-1"): "python -m spes.upcycle: error: argument "
        "--router_std: -1 must be a finite number >= 0",
        ("--hf", "h", "--config", config, "--make_random_dense", "gpt2"): "python -m spes.upcycle: error: argument "
        "--make_random_dense: invalid choice: 'gpt2' (choose from 'llama', 'qwen3')",
        ("--hf", "h", "--config", "gone.yaml", "--out", "o/step0"): "error: config file not found: gone.yaml (pass a "
        "YAML file, e.g. configs/tiny.yaml)",
        ("--hf", "h", "--config", config, "--out", "o/step0", "--model.d_modle=3"): "error: command line "
        "(--model.d_modle=3): unknown config key 'model.d_modle'; did you mean 'model.d_model'?",
        ("--hf", "h", "--config", config): "error: --out is required: the checkpoint step directory to write, e.g. "
        "output/run/init/step0",
        ("--hf", "h", "--cofig", config): "python -m spes.upcycle: error: the following arguments are required: "
        "--config (--cofig is not a flag of this command; did you mean --config?)",
        ("--hf", "h", "--config", config, "--out", "o/step0", "--partiton"): "python -m spes.upcycle: error: "
        "unrecognized arguments: --partiton; did you mean --partition?",  # was: a malformed override
    }
    for argv, line in refused.items():
        code, out, err = without_torch(tmp_path, "spes.upcycle", *argv)
        assert (code, out, err[-1]) == (2, "", line), argv


def test_the_random_dense_model_is_made_as_the_command_line_asks(
    tmp_path: Path, tokenizer: LoadedTokenizer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    made: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    monkeypatch.setattr(upcycling, "make_random_dense", lambda *a, **k: made.append((a, k)) or "made")
    overrides = tokenizer_overrides(tokenizer)
    argv = ["--config", UPCYCLE_TINY, "--hf", "d", "--make_random_dense", "llama", "--partition", "--seed=7"]
    assert upcycle.main([*argv, *overrides]) == 0 and capsys.readouterr().out == "made\n"
    assert upcycle.main([*argv, *overrides[1:], f"--tokenizer.identifier={tmp_path / 'none'}"]) == 0
    (model, out), kwargs = made[0]
    assert isinstance(model, ModelConfig) and model.d_model == 64 and out == "d"
    assert kwargs == dict(model_type="llama", partition=True, tokenizer=tokenizer.path.parent, seed=7, overwrite=False)
    assert made[1][1]["tokenizer"] is None  # the config's tokenizer does not exist: the model comes without one


def test_a_random_dense_model_replaces_a_model_at_hf_only_when_asked(
    tmp_path: Path, tokenizer: LoadedTokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    """--hf names the model read everywhere else: --make_random_dense added to a real model's command would have
    written random weights over it."""
    argv = ["--config", UPCYCLE_TINY, "--hf", str(tmp_path / "dense"), *tokenizer_overrides(tokenizer)]
    assert upcycle.main([*argv, "--make_random_dense", "qwen3"]) == 0
    weights = (tmp_path / "dense" / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert upcycle.main([*argv, "--make_random_dense", "qwen3", "--seed=1"]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'dense'} already exists and is not empty; pass --overwrite to replace it\n"
    )
    assert (tmp_path / "dense" / "model.safetensors").read_bytes() == weights
    model = load_config(UPCYCLE_TINY, tokenizer_overrides(tokenizer))[0].model
    with pytest.raises(FileExistsError):  # the function's own default: nothing replaced unasked
        upcycling.make_random_dense(model, tmp_path / "dense", seed=1)
    assert upcycle.main([*argv, "--make_random_dense", "qwen3", "--seed=1", "--overwrite"]) == 0
    assert (tmp_path / "dense" / "model.safetensors").read_bytes() != weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense"]  # no staging directory left


def test_refusals_name_the_dense_config_they_read(tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    opts = model_options(tokenizer, **QWEN3, moe_normalize_expert_weights=True)
    dense_dir, _ = dense_model(tmp_path, ModelConfig(**opts), "qwen3", tokenizer)
    settings = json.loads((dense_dir / "config.json").read_text(encoding="utf-8"))
    settings["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0}
    (dense_dir / "config.json").write_text(json.dumps(settings), encoding="utf-8")
    with pytest.raises(ValueError, match=r"^dense Hugging Face config \(qwen3\): 'rope_parameters.rope_type' = 'yarn'"):
        upcycling.upcycle(
            dense_dir, run_config_for(opts, num_train_experts_per_node=2, run_name="x"), tmp_path / "s" / "step0"
        )
    with pytest.raises(FileNotFoundError, match=rf"^--hf '{tmp_path / 'nowhere'}' is not a local file or directory"):
        upcycling.upcycle(
            tmp_path / "nowhere", run_config_for(opts, num_train_experts_per_node=2, run_name="x"), "step0"
        )
