"""Hugging Face export/import: logits parity with transformers, bit-exact round trips, refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch.testing import assert_close

from conftest import usage_error
from hf_fixtures import BASE, CASES, make_checkpoint, save_tiny_olmoe
from spes import hf
from spes.checkpoint import CheckpointError, load_model_state
from spes.config import ModelConfig
from spes.model import Transformer
from spes.tokenizer import LoadedTokenizer


def hf_logits(hf_dir: Path, ids: torch.Tensor) -> tuple[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True).eval()
    with torch.no_grad():
        return type(model).__name__, model(ids).logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_logits_match_transformers(case: str, tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    options, architecture = CASES[case]
    step_dir, model = make_checkpoint(tmp_path / "run", tokenizer, options)
    out = hf.export_checkpoint(step_dir, tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    ids = torch.randint(0, tokenizer.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    name, logits = hf_logits(out, ids)
    assert name == architecture
    with torch.no_grad():
        expected = model(ids).logits
    assert_close(logits, expected, atol=1e-4, rtol=0)
    assert (
        transformers.AutoTokenizer.from_pretrained(str(out)).encode("def f(x):")
        == tokenizer.encode_batch(["def f(x):"])[0]
    )


@pytest.mark.parametrize("case", ["olmoe", "qwen3_per_head_gqa", "mixtral_no_qk_norm"])
def test_round_trip_spes_hf_spes_is_bit_exact(case: str, tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    step_dir, _ = make_checkpoint(tmp_path / "run", tokenizer, CASES[case][0])
    out = hf.export_checkpoint(step_dir, tmp_path / "hf")
    back = hf.import_hf(out, tmp_path / "back" / "step0", experts_per_peer=2)
    before, after = load_model_state(step_dir), load_model_state(back)
    assert set(before) == set(after)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    cfg_before, cfg_after = hf.load_step_config(step_dir).model, hf.load_step_config(back).model
    assert cfg_after == cfg_before


def test_export_sharded_with_index_loads(tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    step_dir, model = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0])
    out = hf.export_checkpoint(step_dir, tmp_path / "hf", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (out / "model.safetensors").exists()
    umask = os.umask(0o022)
    os.umask(umask)  # the files get what open() would give them: readable by the cluster's other users under 022
    assert {p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()} == {0o666 & ~umask}
    ids = torch.randint(0, tokenizer.vocab_size, (1, 9))
    with torch.no_grad():
        assert_close(hf_logits(out, ids)[1], model(ids).logits, atol=1e-4, rtol=0)


def test_export_bfloat16_writes_bf16(tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    step_dir, _ = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0])
    out = hf.export_checkpoint(step_dir, tmp_path / "hf", dtype="bfloat16")
    state = hf.read_hf_weights(out)
    assert {state[k].dtype for k in state} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
def test_import_model_saved_by_transformers(family: str, tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    """A model written by transformers itself (not by our export), Qwen3-MoE with tied embeddings."""
    common = dict(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if family == "olmoe":
        config = transformers.OlmoeConfig(intermediate_size=24, num_experts=4, **common)
        model = transformers.OlmoeForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(
            moe_intermediate_size=24,
            num_experts=4,
            num_key_value_heads=2,
            head_dim=8,
            norm_topk_prob=True,
            tie_word_embeddings=True,
            **common,
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(str(tmp_path / "hf"))
    for path in tokenizer.path.parent.iterdir():
        (tmp_path / "hf" / path.name).write_bytes(path.read_bytes())
    step_dir = hf.import_hf(tmp_path / "hf", tmp_path / "run" / "step0", experts_per_peer=1)
    cfg = hf.load_step_config(step_dir)
    assert cfg.spes_config.num_peers == 4 and cfg.experts_per_peer == 1
    assert Path(cfg.tokenizer.identifier) == step_dir.parent / "tokenizer"
    assert (step_dir.parent / "latest").read_text().strip() == "step0"
    spes_model = Transformer.for_run(cfg)
    spes_model.load_state_dict(dict(load_model_state(step_dir)))
    ids = torch.randint(0, tokenizer.vocab_size, (2, 11))
    with torch.no_grad():
        assert_close(spes_model.eval()(ids).logits, model.eval()(ids).logits, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# Refusals and bad input


@pytest.mark.parametrize(
    "options, setting",
    [
        (dict(attention_layer_norm=False), "model.attention_layer_norm"),
        (dict(attention_layer_norm=True, moe_normalize_expert_weights=2.0), "model.moe_normalize_expert_weights"),
    ],
)
def test_inexpressible_config_is_refused(options: dict[str, Any], setting: str) -> None:
    with pytest.raises(ValueError, match=setting):
        hf.choose_family(ModelConfig(**{**BASE, **options}))


def test_bad_checkpoint_paths(tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    step_dir, _ = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0], step=5)
    with pytest.raises(FileNotFoundError, match=r"step7 does not exist; available: step5"):
        hf.resolve_step(tmp_path / "run", 7)
    assert hf.resolve_step(tmp_path / "run", "latest") == step_dir
    (tmp_path / "run" / "latest").unlink()
    with pytest.raises(FileNotFoundError, match="no 'latest' file"):
        hf.resolve_step(tmp_path / "run", "latest")
    (tmp_path / "run" / "latest").write_text("step5\n")
    assert hf.resolve_step(tmp_path / "run", "latest") == step_dir
    (tmp_path / "run" / "step9-sharded").mkdir()
    assert hf.resolve_step(tmp_path / "run", 9) == tmp_path / "run" / "step9-sharded"
    with pytest.raises(FileNotFoundError, match="run directory .* does not exist"):
        hf.resolve_step(tmp_path / "nowhere", 5)
    assert hf.export_checkpoint(tmp_path / "run", tmp_path / "hf") == tmp_path / "hf"  # a save folder: latest
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither a checkpoint directory .* nor a save folder"):
        hf.export_checkpoint(tmp_path / "empty", tmp_path / "hf2")
    with pytest.raises(FileNotFoundError, match="no step<N> directories: is it a spes run"):
        hf.resolve_step(tmp_path / "empty", "3")


def test_missing_tokenizer_and_existing_output(tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    step_dir, _ = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0])
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        hf.export_checkpoint(step_dir, tmp_path / "hf", tokenizer=tmp_path / "no_tok")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep").write_text("x")
    with pytest.raises(FileExistsError, match="--overwrite"):
        hf.export_checkpoint(step_dir, tmp_path / "hf")
    hf.export_checkpoint(step_dir, tmp_path / "hf", overwrite=True)
    assert not (tmp_path / "hf" / "keep").exists() and (tmp_path / "hf" / "config.json").is_file()


def test_import_refuses_unsupported_architecture(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    transformers.LlamaForCausalLM(config).save_pretrained(str(tmp_path / "llama"))
    with pytest.raises(ValueError, match=r"model_type 'llama' is not supported.*\['mixtral', 'olmoe', 'qwen3_moe'\]"):
        hf.import_hf(tmp_path / "llama", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf.import_hf(tmp_path, tmp_path / "out")


def test_import_names_an_hf_file_that_is_not_valid_json(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "olmoe"')  # cut short
    with pytest.raises(ValueError) as err:
        hf.import_hf(bad, tmp_path / "out")
    assert str(err.value).startswith(f"{bad / 'config.json'}: not valid JSON (Expecting ',' delimiter")
    olmoe = save_tiny_olmoe(tmp_path / "olmoe")
    (olmoe / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: no 'weight_map' of tensor names to files"):
        hf.import_hf(olmoe, tmp_path / "out")


def test_import_refuses_unsupported_options(tmp_path: Path) -> None:
    olmoe = save_tiny_olmoe(tmp_path / "olmoe", clip_qkv=8.0)
    with pytest.raises(ValueError, match="'clip_qkv' = 8.0 is not supported"):
        hf.import_hf(olmoe, tmp_path / "out")
    settings = json.loads((olmoe / "config.json").read_text())
    (olmoe / "config.json").write_text(json.dumps({**settings, "clip_qkv": None, "rms_norm_eps": 0.0}))
    with pytest.raises(ValueError) as err:
        hf.import_hf(olmoe, tmp_path / "out")
    assert str(err.value) == (
        f"{olmoe / 'config.json'}: importing it, config key 'model.layer_norm_eps' = 0.0 must be > 0 "
        "(its 'rms_norm_eps')"
    )
    (olmoe / "config.json").write_text(json.dumps({**settings, "clip_qkv": None, "num_experts_per_tok": 0}))
    with pytest.raises(
        ValueError, match=r"'model.moe_top_k' = 0 must be in \[1, moe_num_experts=2\] \(its 'num_experts_per_tok'\)$"
    ):
        hf.import_hf(olmoe, tmp_path / "out")


def test_cli_export_from_run_dir_and_error_exit(
    tmp_path: Path, tokenizer: LoadedTokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0], step=3)
    assert (
        hf.main(["export", "--run_dir", str(tmp_path / "run"), "--step", "latest", "--out", str(tmp_path / "hf")]) == 0
    )
    assert (tmp_path / "hf" / "config.json").is_file()
    assert hf.main(["export", "--run_dir", str(tmp_path / "run"), "--step", "9", "--out", str(tmp_path / "x")]) == 2
    assert "step9 does not exist; available: step3" in capsys.readouterr().err
    for size in ("0", "nan", "inf"):
        argv = ["export", "--checkpoint", str(tmp_path / "run"), "--out", "x", "--max_shard_gb", size]
        rule = f"argument --max_shard_gb: {size} must be a finite number > 0"
        assert usage_error(capsys, lambda argv=argv: hf.main(argv)).endswith(f": error: {rule}")
