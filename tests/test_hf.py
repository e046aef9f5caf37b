"""Hugging Face export/import: logits parity with transformers, bit-exact round trips, refusals."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers
import yaml
from safetensors import SafetensorError, safe_open
from torch.testing import assert_close

from conftest import usage_error
from disk_helpers import drop_checksums
from dist_helpers import without_torch
from hf_fixtures import BASE, CASES, make_checkpoint, save_tiny_olmoe
from spes import hf, hf_convert, hf_map
from spes.checkpoint import load_model_state, save_checkpoint
from spes.config import ModelConfig, TokenizerConfig
from spes.model import Transformer
from spes.save_folder import CONFIG_FILE, LATEST, META_FILE, CheckpointError, resolve_step
from spes.schema import ConfigError
from spes.tokenizer import LoadedTokenizer
from terminal_helpers import with_reader_gone


def hf_logits(hf_dir: Path, ids: torch.Tensor) -> tuple[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True).eval()
    with torch.no_grad():
        return type(model).__name__, model(ids).logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_logits_match_transformers(case: str, tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    options, architecture = CASES[case]
    step_dir, model = make_checkpoint(tmp_path / "run", tokenizer, options)
    out = hf_convert.export_checkpoint(step_dir, tmp_path / "hf")
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
    out = hf_convert.export_checkpoint(step_dir, tmp_path / "hf")
    back = hf_convert.import_hf(out, tmp_path / "back" / "step0", num_train_experts_per_node=2)
    before, after = load_model_state(step_dir), load_model_state(back)
    assert set(before) == set(after)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    cfg_before, cfg_after = hf_convert.load_step_config(step_dir).model, hf_convert.load_step_config(back).model
    assert cfg_after == cfg_before


def test_export_sharded_with_index_loads(tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    step_dir, model = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0])
    out = hf_convert.export_checkpoint(step_dir, tmp_path / "hf", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (out / "model.safetensors").exists()
    umask = os.umask(0o022)
    os.umask(umask)  # the files get what open() would give them: readable by the cluster's other users under 022
    assert {p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()} == {0o666 & ~umask}
    ids = torch.randint(0, tokenizer.vocab_size, (1, 9))
    with torch.no_grad():
        assert_close(hf_logits(out, ids)[1], model(ids).logits, atol=1e-4, rtol=0)


def test_a_checkpoint_an_earlier_spes_saved_exports_with_the_config_keys_renamed_since(
    tmp_path: Path, tokenizer: LoadedTokenizer
) -> None:
    """spes before 2026-11-27 saved spes_config.wire_dtype (now codec): its checkpoints resumed, but their export
    was refused naming the key to rename in the checkpoint's config.yaml, whose size meta.json records."""
    step_dir, model = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0])
    config = yaml.safe_load((step_dir / CONFIG_FILE).read_text())
    config["spes_config"]["wire_dtype"] = config["spes_config"].pop("codec")
    state = load_model_state(step_dir)
    old = save_checkpoint(tmp_path / "old", 5, model_state=state, optim_state=None, trainer_state={}, config=config)
    out = hf_convert.export_checkpoint(old, tmp_path / "hf")
    ids = torch.randint(0, tokenizer.vocab_size, (1, 9))
    with torch.no_grad():
        assert_close(hf_logits(out, ids)[1], model(ids).logits, atol=1e-4, rtol=0)


def test_export_bfloat16_writes_bf16(tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    step_dir, _ = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0])
    out = hf_convert.export_checkpoint(step_dir, tmp_path / "hf", dtype="bfloat16")
    state = hf_convert.read_hf_weights(out)
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
    step_dir = hf_convert.import_hf(tmp_path / "hf", tmp_path / "run" / "step0", num_train_experts_per_node=1)
    cfg = hf_convert.load_step_config(step_dir)
    assert cfg.spes_config.num_peers == 4 and cfg.experts_per_block == 1
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
        hf_map.choose_family(ModelConfig(**{**BASE, **options}))


def test_bad_checkpoint_paths(tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    step_dir, _ = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0], step=5)
    with pytest.raises(FileNotFoundError, match=r"step7 does not exist; available: step5"):
        resolve_step(tmp_path / "run", 7)
    assert resolve_step(tmp_path / "run", "latest") == step_dir
    (tmp_path / "run" / "latest").unlink()
    with pytest.raises(FileNotFoundError, match="no 'latest' file"):
        resolve_step(tmp_path / "run", "latest")
    (tmp_path / "run" / "latest").write_text("step5\n")
    assert resolve_step(tmp_path / "run", "latest") == step_dir
    (tmp_path / "run" / "step9-sharded").mkdir()
    assert resolve_step(tmp_path / "run", 9) == tmp_path / "run" / "step9-sharded"
    with pytest.raises(FileNotFoundError, match="run directory .* does not exist"):
        resolve_step(tmp_path / "nowhere", 5)
    assert hf_convert.export_checkpoint(tmp_path / "run", tmp_path / "hf") == tmp_path / "hf"  # a save folder: latest
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither a checkpoint directory .* nor a save folder"):
        hf_convert.export_checkpoint(tmp_path / "empty", tmp_path / "hf2")
    with pytest.raises(FileNotFoundError, match="holds no checkpoint \\(no latest file, no step<N> directory\\)"):
        resolve_step(tmp_path / "empty", "3")


def test_missing_tokenizer_and_existing_output(tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    step_dir, _ = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0])
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        hf_convert.export_checkpoint(step_dir, tmp_path / "hf", tokenizer=tmp_path / "no_tok")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(FileExistsError, match="already exists and is not empty; pass --overwrite"):
        hf_convert.export_checkpoint(step_dir, out)
    with pytest.raises(FileExistsError) as err:
        hf_convert.export_checkpoint(step_dir, out, overwrite=True)  # someone else's folder
    assert str(err.value) == (
        f"{out} is not a folder this command wrote (no config.json): --overwrite would delete it whole; choose "
        "another --out"
    )
    (out / "keep").unlink()
    hf_convert.export_checkpoint(step_dir, out)  # an empty folder is written
    (out / "eval").mkdir()  # results kept beside the weights
    (out / "results").mkdir()
    with pytest.raises(FileExistsError) as err:
        hf_convert.export_checkpoint(step_dir, out, overwrite=True)
    assert str(err.value) == (
        f"{out} holds folders this command does not write (eval, results): --overwrite would delete them with it; "
        "move them out, or choose another --out"
    )
    (out / "eval").rmdir()
    (out / "results").rmdir()
    (out / "model-00002-of-00002.safetensors").write_text("x")  # a file of an earlier export
    hf_convert.export_checkpoint(step_dir, out, overwrite=True)
    assert not (out / "model-00002-of-00002.safetensors").exists() and (out / "config.json").is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="file is a file; choose another --out"):
        hf_convert.export_checkpoint(step_dir, tmp_path / "file", overwrite=True)


def test_an_export_over_its_own_checkpoint_or_save_folder_is_refused_and_deletes_nothing(
    tmp_path: Path, tokenizer: LoadedTokenizer
) -> None:
    step_dir, _ = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0])
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for out in (step_dir, tmp_path / "run", tmp_path):
        with pytest.raises(ValueError) as err:
            hf_convert.export_checkpoint(step_dir, out, overwrite=True)
        assert str(err.value) == (
            f"--out {out} holds the checkpoint being exported ({step_dir}): writing there would delete it; choose "
            f"another --out, e.g. {step_dir.parent / 'hf' / step_dir.name}"
        )
    with pytest.raises(ValueError, match="holds the checkpoint being exported"):  # a save folder: its latest
        hf_convert.export_checkpoint(tmp_path / "run", tmp_path / "run", overwrite=True)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert hf_convert.export_checkpoint(step_dir, step_dir / "hf") == step_dir / "hf"  # inside it: nothing replaced


def test_an_import_into_a_runs_save_folder_is_refused_and_leaves_its_latest(
    tmp_path: Path, tokenizer: LoadedTokenizer
) -> None:
    step_dir, _ = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0], step=5)
    exported = hf_convert.export_checkpoint(step_dir, tmp_path / "hf")
    with pytest.raises(ValueError) as err:
        hf_convert.import_hf(exported, tmp_path / "run" / "step0")
    assert str(err.value) == (
        f"--out {tmp_path / 'run' / 'step0'}: {tmp_path / 'run'} is a run's save folder (its latest is step5); "
        f"writing there would make step0 its latest: choose a folder of its own, e.g. {tmp_path / 'run/init/step0'}"
    )
    assert (tmp_path / "run" / "latest").read_text() == "step5\n" and not (tmp_path / "run" / "step0").exists()
    assert (
        hf_convert.import_hf(exported, tmp_path / "run" / "step5", overwrite=True) == step_dir
    )  # its latest, as asked


def test_import_refuses_unsupported_architecture(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    transformers.LlamaForCausalLM(config).save_pretrained(str(tmp_path / "llama"))
    with pytest.raises(ValueError, match=r"model_type 'llama' is not supported.*\['mixtral', 'olmoe', 'qwen3_moe'\]"):
        hf_convert.import_hf(tmp_path / "llama", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf_convert.import_hf(tmp_path, tmp_path / "out")


def test_import_names_an_hf_file_that_is_not_valid_json(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "olmoe"')  # cut short
    with pytest.raises(ValueError) as err:
        hf_convert.import_hf(bad, tmp_path / "out")
    assert str(err.value).startswith(f"{bad / 'config.json'}: not valid JSON (Expecting ',' delimiter")
    olmoe = save_tiny_olmoe(tmp_path / "olmoe")
    (olmoe / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: no 'weight_map' of tensor names to files"):
        hf_convert.import_hf(olmoe, tmp_path / "out")


def test_import_refuses_unsupported_options(tmp_path: Path) -> None:
    olmoe = save_tiny_olmoe(tmp_path / "olmoe", clip_qkv=8.0)
    with pytest.raises(ValueError, match="'clip_qkv' = 8.0 is not supported"):
        hf_convert.import_hf(olmoe, tmp_path / "out")
    settings = json.loads((olmoe / "config.json").read_text())
    (olmoe / "config.json").write_text(json.dumps({**settings, "clip_qkv": None, "rms_norm_eps": 0.0}))
    with pytest.raises(ValueError) as err:
        hf_convert.import_hf(olmoe, tmp_path / "out")
    assert str(err.value) == (
        f"{olmoe / 'config.json'}: importing it, config key 'model.layer_norm_eps' = 0.0 must be > 0 "
        "(its 'rms_norm_eps')"
    )
    (olmoe / "config.json").write_text(json.dumps({**settings, "clip_qkv": None, "num_experts_per_tok": 0}))
    with pytest.raises(
        ValueError, match=r"'model.moe_top_k' = 0 must be in \[1, moe_num_experts=2\] \(its 'num_experts_per_tok'\)$"
    ):
        hf_convert.import_hf(olmoe, tmp_path / "out")
    (olmoe / "config.json").write_text(json.dumps({**settings, "clip_qkv": None, "vocab_size": 0}))
    with pytest.raises(ValueError) as err:  # a key of no attribute of its own (spes reads a tokenizer's first)
        hf_convert.import_hf(olmoe, tmp_path / "out")
    assert str(err.value) == f"{olmoe / 'config.json'}: importing it, config key 'model.vocab_size' = 0 must be >= 1"
    for attr in ("eos_token_id", "pad_token_id"):  # ids past the vocabulary: an export would never stop or pad
        (olmoe / "config.json").write_text(json.dumps({**settings, "clip_qkv": None, attr: 64}))
        with pytest.raises(ValueError, match=rf"'model.{attr}' = 64 must be a token id below .*\(its '{attr}'\)$"):
            hf_convert.import_hf(olmoe, tmp_path / "out")


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
    exported = tmp_path / "hf"
    for flag in ("--num_train_experts_per_node", "--experts_per_peer"):  # 0 was taken as "all in one block"
        argv = ["import", "--hf", str(exported), "--out", str(tmp_path / "imp" / "step0"), flag, "0"]
        line = usage_error(capsys, lambda argv=argv: hf.main(argv))
        assert f": error: argument {flag}" in line and line.endswith(": 0 must be an integer >= 1")
    with pytest.raises(ValueError, match=r"^--num_train_experts_per_node must be in \[1, 4\] .*got 0$"):
        hf_convert.import_hf(exported, tmp_path / "imp" / "step0", num_train_experts_per_node=0)
    assert not (tmp_path / "imp").exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_export_whose_reader_stopped_early_ends_without_a_traceback(
    tmp_path: Path, tokenizer: LoadedTokenizer
) -> None:
    """`spes.hf export ... | head -n 1`: the export finished, then its last line ended it in a BrokenPipeError
    traceback, exit 1."""
    make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0], step=3)
    argv = ["-m", "spes.hf", "export", "--run_dir", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]
    proc = with_reader_gone(argv, 100)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert (tmp_path / "hf" / "config.json").is_file()


# ---------------------------------------------------------------------------------------------------------------
# What the exported and imported files hold, and the command line


def test_exported_config_names_the_architecture_untied_and_with_plain_rope(
    tmp_path: Path, tokenizer: LoadedTokenizer
) -> None:
    step_dir, _ = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0])
    out = hf_convert.export_checkpoint(step_dir, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["OlmoeForCausalLM"] and config["tie_word_embeddings"] is False
    assert config["bos_token_id"] is None and config["dtype"] == "float32"
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e5}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_a_tokenizer_without_its_config_gets_one_that_transformers_loads(
    tmp_path: Path, tokenizer: LoadedTokenizer
) -> None:
    """A bare tokenizer.json (spes's own tokenizers): the export writes tokenizer_config.json naming EOS and pad."""
    bare = tmp_path / "bare_tok"
    bare.mkdir()
    shutil.copyfile(tokenizer.path, bare / "tokenizer.json")
    step_dir, _ = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0])
    out = hf_convert.export_checkpoint(step_dir, tmp_path / "hf", tokenizer=bare)
    written = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    eos = tokenizer.tokenizer.id_to_token(tokenizer.eos_token_id)
    assert written == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "eos_token": eos,
        "pad_token": tokenizer.tokenizer.id_to_token(tokenizer.pad_token_id),
    }
    assert (out / "tokenizer_config.json").read_text(encoding="utf-8") == json.dumps(written, indent=2)
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    assert loaded.eos_token == eos and loaded.pad_token == written["pad_token"]
    hf_convert.copy_tokenizer(bare, tmp_path / "deep" / "new" / "tok")  # a folder made with its parents
    assert (tmp_path / "deep" / "new" / "tok" / "tokenizer_config.json").is_file()


def test_an_export_with_another_tokenizer_than_the_shards_were_written_with_warns(
    tmp_path: Path, tokenizer: LoadedTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    """A tokenizer of the run's size but other ids passes every size check; the fingerprint the data loader's state
    records (that of the tokenizer the shards were written with) tells it apart."""
    step_dir, _ = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0])
    meta_path = step_dir / "meta.json"
    drop_checksums(step_dir)  # NOTE: edited as a checkpoint saved before checksums, which spes still reads
    meta = json.loads(meta_path.read_text())
    for fingerprint, warned in ((tokenizer.fingerprint, False), ("f" * 64, True)):
        meta["trainer"] = {"step": 5, "data": {"tokenizer_fingerprint": fingerprint}}
        meta_path.write_text(json.dumps(meta))
        caplog.clear()
        hf_convert.export_checkpoint(step_dir, tmp_path / "hf", overwrite=True)
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert bool(said) == warned, said
    exported = step_dir.parent / "tokenizer" / "tokenizer.json"
    assert said == [
        f"warning: the tokenizer exported, {exported} (fingerprint {tokenizer.fingerprint[:12]}), is not the one the "
        "run's shards were written with (ffffffffffff): pass --tokenizer with the run's tokenizer, unless this one is "
        "it saved again"
    ]


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    step_dir, _ = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0])
    state, m = load_model_state(step_dir), hf_convert.load_step_config(step_dir).model
    small = dataclasses.replace(m, vocab_size=tokenizer.vocab_size - 1, embedding_size=tokenizer.vocab_size + 20)
    with pytest.raises(ValueError, match=f"{tokenizer.vocab_size}"):
        hf_convert.export_state(state, small, tmp_path / "hf", tokenizer=tokenizer.path.parent)
    with pytest.raises(ValueError, match=r"^--dtype must be one of \['bfloat16', 'float32'\], got 'int8'$"):
        hf_convert.export_state(state, m, tmp_path / "hf", tokenizer=tokenizer.path.parent, dtype="int8")


def test_shards_are_filled_up_to_their_bound_and_indexed_with_the_total_size(tmp_path: Path) -> None:
    """Tensors of 400 bytes under a bound of 800: two to a shard exactly, named 1-of-N on, the index adding up."""
    tensors = [(f"t{i}", torch.full((100,), float(i))) for i in range(5)]
    names = hf_convert.write_safetensors(iter(tensors), tmp_path, max_shard_bytes=800)
    shards = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert names == [*shards, "model.safetensors.index.json"]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text(encoding="utf-8"))
    assert index == {
        "metadata": {"total_size": 2000},
        "weight_map": {"t0": shards[0], "t1": shards[0], "t2": shards[1], "t3": shards[1], "t4": shards[2]},
    }
    assert (tmp_path / "model.safetensors.index.json").read_text(encoding="utf-8") == json.dumps(index, indent=2)
    state = hf_convert.read_hf_weights(tmp_path)
    assert sorted(state) == [name for name, _ in tensors] and torch.equal(state["t3"], tensors[3][1])
    (tmp_path / shards[1]).rename(tmp_path / "aside")
    with pytest.raises(FileNotFoundError) as err:
        hf_convert.read_hf_weights(tmp_path)  # a raw 'No such file or directory' before
    assert str(err.value) == (
        f"{tmp_path} lacks {shards[1]}, a shard its model.safetensors.index.json lists: the download is incomplete; "
        "fetch the model again (hf download <id> --local-dir ...) or copy the shard beside it"
    )
    (tmp_path / "aside").rename(tmp_path / shards[1])
    single = tmp_path / "single"
    single.mkdir()
    assert hf_convert.write_safetensors(iter(tensors[:2]), single, max_shard_bytes=800) == ["model.safetensors"]
    assert hf_convert.read_hf_weights(single)["t1"].dtype == torch.float32
    (single / "model.safetensors").unlink()
    (single / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError) as err:
        hf_convert.read_hf_weights(single)
    assert str(err.value) == (
        f"{single} has no model.safetensors or model.safetensors.index.json (pytorch_model.bin found: spes never "
        "unpickles weights; re-save it with safetensors)"
    )
    (single / "pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"index.json$"):
        hf_convert.read_hf_weights(single)


def test_hf_configs_spes_cannot_compute_are_refused_by_setting() -> None:
    fixed = hf_map.OLMOE.fixed
    plain = SimpleNamespace(hidden_size=32, num_attention_heads=4, rope_theta=1e4, **fixed)
    assert hf_map.check_hf_config(plain, fixed, "cfg") == 1e4  # a config of before rope_parameters: its rope_theta
    scaled = SimpleNamespace(**{**vars(plain), "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})
    with pytest.raises(ValueError) as err:
        hf_map.check_hf_config(scaled, fixed, "cfg")
    assert str(err.value) == "cfg: 'rope_parameters.rope_type' = 'yarn' is not supported by spes (plain RoPE only)"
    untyped = SimpleNamespace(**{**vars(plain), "rope_parameters": {"rope_theta": 2e4}})
    assert hf_map.check_hf_config(untyped, fixed, "cfg") == 2e4
    odd_heads = SimpleNamespace(**{**vars(plain), "head_dim": 16})
    with pytest.raises(ValueError) as err:
        hf_map.check_hf_config(odd_heads, fixed, "cfg")
    assert str(err.value) == (
        "cfg: 'head_dim' = 16 with 4 heads != hidden_size 32; spes needs head_dim = hidden_size / num_attention_heads"
    )
    uneven = SimpleNamespace(**{**vars(plain), "hidden_size": 30})
    with pytest.raises(ValueError, match=r"'head_dim' = 7 with 4 heads != hidden_size 30"):
        hf_map.check_hf_config(uneven, fixed, "cfg")
    assert (
        hf_map.check_hf_config(SimpleNamespace(hidden_size=32, num_attention_heads=4, rope_theta=1.0), fixed, "x")
        == 1.0
    )


def test_token_ids_and_renormalization_are_read_as_transformers_writes_them(tmp_path: Path) -> None:
    olmoe = save_tiny_olmoe(tmp_path / "a", eos_token_id=[5, 7], pad_token_id=None)
    config, family = hf_convert.read_hf_config(olmoe, hf_map.FAMILIES)
    model = hf_map.model_config_from_hf(family, config)
    assert (model["eos_token_id"], model["pad_token_id"], model["moe_normalize_expert_weights"]) == (5, 5, None)
    settings = {k: v for k, v in config.to_dict().items() if k != "norm_topk_prob"}
    bare = SimpleNamespace(**{**settings, "eos_token_id": None, "pad_token_id": []})  # as older files may hold
    model = hf_map.model_config_from_hf(family, bare)
    assert (model["eos_token_id"], model["pad_token_id"], model["moe_normalize_expert_weights"]) == (0, 0, None)
    bare.norm_topk_prob = True
    assert hf_map.model_config_from_hf(family, bare)["moe_normalize_expert_weights"] is True


def test_hf_weights_spes_has_no_place_for_are_refused_and_rotary_tables_ignored(tmp_path: Path) -> None:
    olmoe = save_tiny_olmoe(tmp_path / "a")
    config, family = hf_convert.read_hf_config(olmoe, hf_map.FAMILIES)
    cfg = hf_convert.run_config_for(
        hf_map.model_config_from_hf(family, config), num_train_experts_per_node=2, run_name="t"
    )
    weights = dict(hf_convert.read_hf_weights(olmoe))
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    assert set(hf_convert.hf_to_spes(weights, family.key_map(), cfg.model, architecture="X")) >= {"lm_head.weight"}
    extra = {f"model.layers.0.mlp.shared_expert.{i}.weight": torch.ones(2) for i in range(4)}
    with pytest.raises(ValueError) as err:
        hf_convert.hf_to_spes({**weights, **extra}, family.key_map(), cfg.model, architecture="X")
    assert str(err.value) == (
        f"Hugging Face weights hold 4 tensors spes has no place for (e.g. {sorted(extra)[:3]}); biases, shared "
        "experts and dense layers are not supported"
    )
    del weights["model.norm.weight"]
    with pytest.raises(ValueError) as err:
        hf_convert.hf_to_spes(weights, family.key_map(), cfg.model, architecture="OlmoeForCausalLM")
    assert str(err.value) == "Hugging Face weights have no tensor 'model.norm.weight' (expected for OlmoeForCausalLM)"


def test_a_checkpoint_missing_a_tensor_is_named(tmp_path: Path, tokenizer: LoadedTokenizer) -> None:
    step_dir, _ = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe_gqa_no_affine_normalized"][0])
    state = dict(load_model_state(step_dir))
    m = hf_convert.load_step_config(step_dir).model
    ones = hf_map.implicit_norm_shapes(m)
    assert ones["blocks.1.attn.q_norm.weight"] == (32,) and ones["blocks.1.attn.k_norm.weight"] == (16,)
    per_head = dataclasses.replace(m, attention_layer_norm_over_head=True)
    assert hf_map.implicit_norm_shapes(per_head)["blocks.0.attn.k_norm.weight"] == (8,)
    affine = dataclasses.replace(m, attention_layer_norm_with_affine=True, layer_norm_with_affine=True)
    assert hf_map.implicit_norm_shapes(affine) == {}
    del state["embed.weight"]
    with pytest.raises(ValueError) as err:
        list(hf_convert.spes_to_hf(state, hf_map.OLMOE.key_map(), m))
    assert str(err.value) == (
        "checkpoint has no tensor 'embed.weight' (expected for this model config); is it a checkpoint of this model?"
    )
    state["norm.weight"] = torch.full((32,), 2.0)  # a stored norm is exported as stored, not as ones
    state["embed.weight"] = torch.zeros(1)
    assert torch.equal(
        dict(hf_convert.spes_to_hf(state, hf_map.OLMOE.key_map(), m))["model.norm.weight"], state["norm.weight"]
    )


def test_import_layouts_and_their_refusals(tmp_path: Path) -> None:
    model = dict(BASE, vocab_size=64)
    assert (
        hf_convert.run_config_for(model, num_train_experts_per_node=3, run_name="r").spes_config.num_peers == 2
    )  # ceil(4 / 3)
    whole = hf_convert.run_config_for(model, num_train_experts_per_node=4, run_name="r")
    assert whole.using_spes is False and whole.save_folder == "output/r" and whole.run_name == "r"
    assert whole.tokenizer == TokenizerConfig()
    for bad in (0, 5):
        with pytest.raises(ValueError) as err:
            hf_convert.run_config_for(model, num_train_experts_per_node=bad, run_name="r")
        assert str(err.value) == f"--num_train_experts_per_node must be in [1, 4] (the number of experts), got {bad}"
    olmoe = save_tiny_olmoe(tmp_path / "a", num_experts_per_tok=0)
    with pytest.raises(ConfigError) as cerr:
        hf_convert.import_hf(olmoe, tmp_path / "out" / "step0")
    assert cerr.value.key == "model.moe_top_k"
    with pytest.raises(ValueError) as err:
        hf_convert.write_step_dir(tmp_path / "out" / "init", {}, whole)
    assert str(err.value) == (
        f"--out {tmp_path / 'out' / 'init'} must be a checkpoint step directory named step<N>, e.g. "
        "output/<run_name>/step0"
    )
    with pytest.raises(FileNotFoundError) as ferr:
        hf_convert.load_step_config(tmp_path)
    assert str(ferr.value) == (
        f"{tmp_path} is not a spes checkpoint: it has no config.yaml (expected a <save_folder>/step<N> directory "
        "written by spes training)"
    )
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError) as err:
        hf_convert._read_json(tmp_path / "list.json")
    assert str(err.value) == f"{tmp_path / 'list.json'}: a JSON object was expected, not list"
    (tmp_path / "utf8.json").write_bytes('{"name": "Grüße"}'.encode())
    assert hf_convert._read_json(tmp_path / "utf8.json") == {"name": "Grüße"}


def test_family_config_attributes_name_where_a_spes_key_came_from() -> None:
    attrs = {k: hf_map.QWEN3_MOE.config_attr(k) for k in ("model.mlp_hidden_size", "moe_num_experts", "rope_theta")}
    assert attrs == {
        "model.mlp_hidden_size": "moe_intermediate_size",
        "moe_num_experts": "num_experts",
        "rope_theta": "rope_parameters.rope_theta",
    }
    assert hf_map.OLMOE.config_attr(None) is None and hf_map.OLMOE.config_attr("model.d_model") == "hidden_size"
    with pytest.raises(ValueError) as err:
        hf_map.choose_family(ModelConfig(**{**BASE, "attention_layer_norm": False}))
    assert str(err.value) == (
        "config key 'model.attention_layer_norm' = False with 'model.moe_normalize_expert_weights' unset has no exact "
        "Hugging Face architecture: OLMoE and Qwen3-MoE always RMS-normalize queries and keys, Mixtral always "
        "renormalizes the top-k weights. Train with attention_layer_norm: true (OLMoE) or "
        "moe_normalize_expert_weights: true (Mixtral) to export"
    )


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        hf.main([*argv, "--help"])
    assert exit_.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_the_command_lines_help_names_each_flag_with_its_meaning(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    top = _help(capsys)
    assert top.startswith("usage: python -m spes.hf [-h] {export,import} ...")
    assert hf.__doc__ is not None and " ".join(hf.__doc__.split("\n\n")[0].split()) in top
    assert "export spes checkpoint -> Hugging Face model directory" in top
    assert "import Hugging Face MoE directory -> spes checkpoint step directory" in top
    export = _help(capsys, "export")
    for flag, meaning in {
        "--checkpoint CHECKPOINT": "a checkpoint step directory (<save_folder>/step<N>), or a save folder (its "
        "latest checkpoint)",
        "--run_dir RUN_DIR": "a save folder; the step comes from --step",
        "--step STEP": "with --run_dir: a step number or 'latest' (default)",
        "--out OUT": "output Hugging Face model directory",
        "--tokenizer TOKENIZER": "tokenizer directory (default: the run config's tokenizer.identifier)",
        "--dtype {bfloat16,float32}": "weight dtype (default float32)",
        "--max_shard_gb MAX_SHARD_GB": "largest safetensors shard in GiB (default 5)",
        "--overwrite": "replace --out if it exists",
    }.items():
        assert f"{flag} {meaning}" in export, flag
    assert "usage: python -m spes.hf export [-h] (--checkpoint CHECKPOINT | --run_dir RUN_DIR)" in export
    imported = _help(capsys, "import")
    for flag, meaning in {
        "--hf HF": "HF model directory or Hub id (local cache first, see spes.hub), model_type one of ['mixtral', "
        "'olmoe', 'qwen3_moe']",
        "--out OUT": "output checkpoint step directory, e.g. output/myrun/step0 (the tokenizer goes to "
        "output/myrun/tokenizer)",
        "--num_train_experts_per_node NUM_TRAIN_EXPERTS_PER_NODE": "experts per stored block: "
        "spes_config.num_train_experts_per_node of the SPES run (default: all experts in one block)",
        "--overwrite": "replace --out if it exists",
    }.items():
        assert f"{flag} {meaning}" in imported, flag
    assert "usage: python -m spes.hf import [-h] --hf HF --out OUT" in imported
    assert "--experts_per_peer" not in imported and "--block_size" not in imported  # former names, hidden


@pytest.mark.timeout(180)
def test_help_and_a_refused_command_line_are_answered_without_torch(tmp_path: Path) -> None:
    """Importing torch took most of the two seconds `--help` took (longer on a busy host): the command line is read,
    and refused, before it, with the same text and exit codes; the conversion is imported only once it holds, and
    for an export once it names a checkpoint (a missing or foreign folder, a bad or absent step: torch was imported
    to say so)."""
    for command in ("", "export", "import"):
        code, out, err = without_torch(tmp_path, "spes.hf", *command.split(), "--help")
        assert code == 0 and out.startswith(f"usage: python -m spes.hf {command}".strip() + " [-h]") and not err
    refused = {
        (): "python -m spes.hf: error: the following arguments are required: command",
        ("export", "--out", "o"): "python -m spes.hf export: error: one of the arguments --checkpoint --run_dir is "
        "required",
        ("export", "--checkpoint", "c", "--out", "o", "--dtype", "float16"): "python -m spes.hf export: error: "
        "argument --dtype: invalid choice: 'float16' (choose from 'bfloat16', 'float32')",
        ("export", "--checkpoint", "c", "--out", "o", "--max_shard_gb", "0"): "python -m spes.hf export: error: "
        "argument --max_shard_gb: 0 must be a finite number > 0",
        ("import", "--hf", "h", "--out", "o", "--num_train_experts_per_node", "0"): "python -m spes.hf import: "
        "error: argument --num_train_experts_per_node: 0 must be an integer >= 1",
    }
    for argv, line in refused.items():
        code, out, err = without_torch(tmp_path, "spes.hf", *argv)
        assert (code, out, err[-1]) == (2, "", line), argv
    for folder in ("empty", "run/node0/step3"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "run" / "node0" / LATEST).write_text("step3\n")
    (tmp_path / "run" / "node0" / "step3" / META_FILE).write_text("{}")
    fix = (
        "point it at a checkpoint directory such as output/<run_name>/node0/step100, or a save folder holding 'latest'"
    )
    no_checkpoint = {
        ("--run_dir", "missing"): f"run directory missing does not exist (relative to {tmp_path.resolve()}; expected "
        "a spes save_folder, e.g. output/<run_name>/node0)",
        ("--run_dir", "empty"): "run directory empty holds no checkpoint (no latest file, no step<N> directory): pass "
        "a node's save folder, e.g. output/<run>/node0",
        ("--run_dir", "run"): "run directory run holds the save folders of the nodes, not a checkpoint: pass one of "
        "them, e.g. run/node0",
        ("--run_dir", "run/node0", "--step", "last"): "checkpoint step must be an integer or 'latest', got 'last'",
        ("--run_dir", "run/node0", "--step", "7"): "checkpoint run/node0/step7 does not exist; available: step3",
        ("--run_dir", "run/node0/step3"): "run directory run/node0/step3 is a checkpoint, not a save folder: pass the "
        "save folder it is in, run/node0 with step 3",
        ("--checkpoint", "missing"): f"checkpoint missing: no such directory ({fix})",
        ("--checkpoint", "run"): "checkpoint run is neither a checkpoint nor a save folder itself, but holds them; "
        "point it at one: run/node0",
    }
    for argv, line in no_checkpoint.items():
        code, out, err = without_torch(tmp_path, "spes.hf", "export", *argv, "--out", "o")
        assert (code, out, err[-1]) == (2, "", f"error: {line}"), argv


def test_the_written_hf_commands_use_the_flags_help_shows(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's, the docs' and the module docstring's commands name each setting as --help does."""
    monkeypatch.setenv("COLUMNS", "200")
    root = Path(__file__).resolve().parents[1]
    texts = [hf.__doc__ or "", *(p.read_text() for p in [root / "README.md", *sorted(root.glob("docs/*.md"))])]
    written = [c for text in texts for c in re.findall(r"python -m spes\.hf (export|import)\b([^`#\n]*)", text)]
    assert {command for command, _ in written} == {"export", "import"}
    shown = {command: _help(capsys, command) for command in ("export", "import")}
    for command, rest in written:
        for flag in re.findall(r"--\w+", rest):
            assert f" {flag} " in shown[command], f"spes.hf {command}{rest}"


def test_the_command_line_exports_and_imports_with_every_flag(
    tmp_path: Path, tokenizer: LoadedTokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    step_dir, _ = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0])
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")  # an earlier export's
    (out / "old").write_text("x")
    export = ["export", "--checkpoint", str(step_dir), "--out", str(out), "--tokenizer", str(tokenizer.path.parent)]
    assert hf.main(export) == 2 and "pass --overwrite" in capsys.readouterr().err
    shard_gb = str(60_000 / 1024**3)  # 60,000 bytes a shard
    assert hf.main([*export, "--dtype", "bfloat16", "--max_shard_gb", shard_gb, "--overwrite"]) == 0
    assert capsys.readouterr().out == f"{out}\n" and not (out / "old").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text(encoding="utf-8"))
    sizes = [p.stat().st_size for p in out.glob("model-*.safetensors")]
    assert len(sizes) > 2 and max(sizes) < 60_000 + 2_000 and index["metadata"]["total_size"] < 60_000 * len(sizes)
    assert {hf_convert.read_hf_weights(out)[k].dtype for k in index["weight_map"]} == {torch.bfloat16}
    step0 = tmp_path / "back" / "step0"
    imported = ["import", "--hf", str(out), "--out", str(step0), "--num_train_experts_per_node", "1"]
    assert hf.main(imported) == 0 and capsys.readouterr().out == f"{step0}\n"
    assert hf_convert.load_step_config(step0).experts_per_block == 1
    assert hf.main(imported) == 2 and "pass --overwrite" in capsys.readouterr().err
    assert hf.main([*imported[:-2], "--experts_per_peer", "4", "--overwrite"]) == 0
    assert hf_convert.load_step_config(step0).using_spes is False
    assert usage_error(capsys, lambda: hf.main(["export", "--out", "x"])).endswith(
        "error: one of the arguments --checkpoint --run_dir is required"
    )
    assert usage_error(capsys, lambda: hf.main(["import", "--hf", "x"])).endswith(
        "error: the following arguments are required: --out"
    )
    assert usage_error(capsys, lambda: hf.main(["import", "--out", "x"])).endswith(
        "error: the following arguments are required: --hf"
    )
    assert usage_error(capsys, lambda: hf.main([])).endswith("error: the following arguments are required: command")


def test_what_the_command_line_passes_on_by_default(
    tmp_path: Path, tokenizer: LoadedTokenizer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each flag's default as the functions receive it, and the tokenizer resolved as a tokenizer, files only."""
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    monkeypatch.setattr(hf_convert, "export_checkpoint", lambda *a, **k: calls.append((a, k)) or Path("x"))
    monkeypatch.setattr(hf_convert, "import_hf", lambda *a, **k: calls.append((a, k)) or Path("y"))
    make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0], step=3)
    assert hf.main(["export", "--run_dir", str(tmp_path / "run"), "--out", "o"]) == 0
    assert hf.main(["export", "--checkpoint", str(tmp_path / "run"), "--out", "o", "--tokenizer", "t"]) == 0
    assert hf.main(["import", "--hf", "h", "--out", "o2"]) == 0
    for former in ("--experts_per_peer", "--block_size"):  # former names of --num_train_experts_per_node
        assert hf.main(["import", "--hf", "h", "--out", "o3", former, "2"]) == 0
    assert calls == [
        (
            (tmp_path / "run" / "step3", "o"),
            dict(tokenizer=None, dtype="float32", overwrite=False, max_shard_bytes=5 * 1024**3),
        ),
        (  # a save folder: the checkpoint its `latest` names
            (tmp_path / "run" / "step3", "o"),
            dict(tokenizer="t", dtype="float32", overwrite=False, max_shard_bytes=5 * 1024**3),
        ),
        (("h", "o2"), dict(num_train_experts_per_node=None, overwrite=False)),
        *[(("h", "o3"), dict(num_train_experts_per_node=2, overwrite=False))] * 2,
    ]
    assert usage_error(capsys, lambda: hf.main(["export", "--checkpoint", "c"])).endswith(
        "error: the following arguments are required: --out"
    )
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        hf.main(["--help"])
    assert hf.__doc__ is not None
    shown = capsys.readouterr().out
    assert shown.split("\n\n")[1] == hf.__doc__.split("\n\n")[0]  # its first paragraph, as written
    assert hf.__doc__.split("\n\n")[1] not in shown  # and no more of the module's docstring


def test_the_export_resolves_its_tokenizer_as_one_and_names_the_config_it_came_from(
    tmp_path: Path, tokenizer: LoadedTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    step_dir, _ = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0])
    asked: list[Any] = []
    real = hf_convert.resolve_tokenizer
    monkeypatch.setattr(hf_convert, "resolve_tokenizer", lambda name: asked.append(name) or real(name))
    out = hf_convert.export_checkpoint(step_dir, tmp_path / "deep" / "er" / "hf")  # its parents made too
    assert asked == [hf_convert.load_step_config(step_dir).tokenizer.identifier]
    assert (out / "config.json").is_file()
    (tmp_path / "gone").mkdir()
    with pytest.raises(FileNotFoundError) as err:
        hf_convert.export_checkpoint(step_dir, tmp_path / "hf2", tokenizer=tmp_path / "gone" / "tok")
    assert str(err.value).startswith(f"tokenizer '{tmp_path / 'gone' / 'tok'}' is not a local file or directory")
    assert str(err.value).endswith(
        f" (from config key 'tokenizer.identifier' of {step_dir / 'config.yaml'}); pass --tokenizer <dir> with the "
        "run's tokenizer"
    )


def test_nothing_is_replaced_unless_asked_and_a_copied_tokenizer_config_is_kept(
    tmp_path: Path, tokenizer: LoadedTokenizer
) -> None:
    step_dir, _ = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0])
    state, cfg = load_model_state(step_dir), hf_convert.load_step_config(step_dir)
    out = hf_convert.export_state(state, cfg.model, tmp_path / "hf", tokenizer=tokenizer.path.parent)
    source = tokenizer.path.parent / "tokenizer_config.json"
    assert source.is_file() and (out / "tokenizer_config.json").read_bytes() == source.read_bytes()
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        hf_convert.export_state(state, cfg.model, out, tokenizer=tokenizer.path.parent)
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        hf_convert.import_hf(out, step_dir)
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        hf_convert.write_step_dir(step_dir, state, cfg)
    small = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size - 1))
    with pytest.raises(ValueError, match=f"but the tokenizer has {tokenizer.vocab_size} tokens"):
        hf_convert.write_step_dir(tmp_path / "r2" / "step0", state, small, tokenizer=tokenizer.path.parent)
    m = cfg.model
    values = hf_map.hf_config_dict(hf_map.OLMOE, m)
    assert values["dtype"] == "float32" and values["tie_word_embeddings"] is False and values["bos_token_id"] is None
    assert "bos_token_id" in values and values["architectures"] == ["OlmoeForCausalLM"]
    per_head = dataclasses.replace(
        m, attention_layer_norm_over_head=True, attention_layer_norm_with_affine=False, n_kv_heads=2
    )
    shapes = hf_map.implicit_norm_shapes(per_head)
    assert shapes["blocks.0.attn.q_norm.weight"] == shapes["blocks.0.attn.k_norm.weight"] == (8,)


def test_an_imported_model_without_a_tokenizer_or_a_model_type_or_token_ids(tmp_path: Path) -> None:
    olmoe = save_tiny_olmoe(tmp_path / "a")
    step = hf_convert.import_hf(olmoe, tmp_path / "r" / "step0")
    assert (
        hf_convert.load_step_config(step).tokenizer == TokenizerConfig() and not (tmp_path / "r" / "tokenizer").exists()
    )
    settings = json.loads((olmoe / "config.json").read_text(encoding="utf-8"))
    del settings["model_type"]
    (olmoe / "config.json").write_text(json.dumps(settings), encoding="utf-8")
    with pytest.raises(ValueError) as err:
        hf_convert.read_hf_config(olmoe, hf_map.FAMILIES)
    assert str(err.value) == (
        f"{olmoe}: model_type '' is not supported here; expected one of ['mixtral', 'olmoe', 'qwen3_moe']"
    )
    with pytest.raises(FileNotFoundError) as err:
        hf_convert.read_hf_config(step, hf_map.FAMILIES)  # a spes checkpoint given where a Hugging Face model goes
    assert str(err.value) == (
        f"{step} is not a Hugging Face model directory: it has no config.json; it is a spes checkpoint: export it "
        "first (python -m spes.hf export --checkpoint ...)"
    )
    with pytest.raises(FileNotFoundError, match="it has no config.json$"):
        hf_convert.read_hf_config(tmp_path, hf_map.FAMILIES)
    config, family = hf_convert.read_hf_config(save_tiny_olmoe(tmp_path / "b"), hf_map.FAMILIES)
    settings = {k: v for k, v in config.to_dict().items() if k not in ("eos_token_id", "pad_token_id")}
    assert (hf_map.model_config_from_hf(family, SimpleNamespace(**settings))["pad_token_id"]) == 0
    scaled = SimpleNamespace(**{**settings, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match=r"^Hugging Face config \(olmoe\): 'rope_parameters.rope_type' = 'linear'"):
        hf_map.model_config_from_hf(family, scaled)
    weights = dict(hf_convert.read_hf_weights(tmp_path / "b"))
    del weights["lm_head.weight"], weights["model.embed_tokens.weight"]
    hf_convert.write_safetensors(iter(weights.items()), tmp_path / "b")
    with pytest.raises(ValueError, match=r"no tensor 'model.embed_tokens.weight' \(expected for OlmoeForCausalLM\)$"):
        hf_convert.import_hf(tmp_path / "b", tmp_path / "s" / "step0")


@pytest.mark.timeout(120)
def test_a_mistyped_flag_is_named_in_the_refusal_for_the_flag_it_meant(tmp_path: Path) -> None:
    """`export --chekpoint x --out y` was told only that one of --checkpoint and --run_dir is required: argparse
    checks required flags before it refuses unknown ones."""
    code, out, err = without_torch(tmp_path, "spes.hf", "export", "--chekpoint", "output/x", "--out", "y")
    assert (code, out, err[-1]) == (
        2,
        "",
        "python -m spes.hf export: error: one of the arguments --checkpoint --run_dir is required (--chekpoint is not "
        "a flag of this command; did you mean --checkpoint?)",
    )


def test_an_export_that_finds_the_disk_full_fails_in_one_line_and_keeps_the_last_export(
    tmp_path: Path, tokenizer: LoadedTokenizer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """safetensors reports a full disk as its own SafetensorError: the command ended in its traceback (exit 1). Now one
    line naming --out and the fix, exit 2, and an earlier export an --overwrite was replacing is kept whole."""
    step, _ = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0], step=3)
    out = tmp_path / "hf"
    assert hf.main(["export", "--checkpoint", str(step), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()

    def full_disk(*args: object, **kwargs: object) -> None:
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(hf_convert, "save_file", full_disk)
    assert hf.main(["export", "--checkpoint", str(step), "--out", str(out), "--overwrite"]) == 2
    assert capsys.readouterr().err == (
        f"error: --out {out}: cannot write the export: no space left on device; nothing half-written is left (what "
        "--out held before is untouched); free space on that disk or choose another --out\n"
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]
