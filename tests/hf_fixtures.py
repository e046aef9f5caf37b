"""Hugging Face test fixtures shared by test modules: spes checkpoints of each exported family, and a Hub cache laid
out on disk as huggingface_hub lays it out (so Hub ids resolve with no network)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import transformers

from spes import hf_convert
from spes.model import Transformer
from spes.moe import fuse_expert_blocks
from spes.tokenizer import LoadedTokenizer

BASE: dict[str, Any] = dict(
    d_model=32,
    n_heads=4,
    n_layers=2,
    mlp_hidden_size=48,
    moe_num_experts=4,
    moe_top_k=2,
    max_sequence_length=64,
    rope_theta=5e5,
    layer_norm_eps=1e-6,
)
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "olmoe": (dict(attention_layer_norm=True), "OlmoeForCausalLM"),
    "olmoe_gqa_no_affine_normalized": (
        dict(
            attention_layer_norm=True,
            n_kv_heads=2,
            layer_norm_with_affine=False,
            attention_layer_norm_with_affine=False,
            moe_normalize_expert_weights=True,
        ),
        "OlmoeForCausalLM",
    ),
    "qwen3_per_head_gqa": (
        dict(
            attention_layer_norm=True,
            attention_layer_norm_over_head=True,
            n_kv_heads=2,
            moe_normalize_expert_weights=True,
        ),
        "Qwen3MoeForCausalLM",
    ),
    "mixtral_no_qk_norm": (dict(n_kv_heads=2, moe_normalize_expert_weights=True), "MixtralForCausalLM"),
}


def save_tiny_olmoe(path: Path, **options: Any) -> Path:
    """A one-layer, two-expert OLMoE as transformers saves it, with `options` set on its config."""
    settings: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_experts=2,
        num_experts_per_tok=1,
        eos_token_id=0,
    )
    config = transformers.OlmoeConfig(**{**settings, **options})
    transformers.OlmoeForCausalLM(config).save_pretrained(str(path))
    return path


def perturb_norms(model: torch.nn.Module) -> None:
    """Move every 1-D parameter (the norms' weights, all ones at init) off its init, so its mapping is tested."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))


def make_checkpoint(
    root: Path, tokenizer: LoadedTokenizer, options: dict[str, Any], *, block_size: int = 2, step: int = 5
) -> tuple[Path, Transformer]:
    """A spes step directory of a random model whose norms are not all ones (so their mapping is tested)."""
    model_cfg = {**BASE, **options, "vocab_size": tokenizer.vocab_size, "embedding_size": tokenizer.vocab_size + 20}
    cfg = hf_convert.run_config_for(model_cfg, num_train_experts_per_node=block_size, run_name="t")
    model = Transformer.for_run(cfg)
    model.init_weights(0)
    perturb_norms(model)
    step_dir = hf_convert.write_step_dir(
        root / f"step{step}", fuse_expert_blocks(model.state_dict()), cfg, tokenizer=tokenizer.path.parent
    )
    return step_dir, model.eval()


UPCYCLE_TINY = str(Path(__file__).resolve().parents[1] / "configs" / "upcycle_tiny.yaml")


def tokenizer_overrides(tokenizer: LoadedTokenizer) -> list[str]:
    """Overrides that fit a shipped config (configs/upcycle_tiny.yaml) to the test tokenizer."""
    return [
        f"--tokenizer.identifier={tokenizer.path.parent}",
        f"--model.vocab_size={tokenizer.vocab_size}",
        f"--model.embedding_size={tokenizer.vocab_size}",
    ]


REVISION = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(hf_home: Path, repo_id: str, files_from: Path) -> Path:
    """Lay out `repo_id` in the Hub cache under `hf_home` as huggingface_hub does: refs/main names a snapshot."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(files_from, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot
