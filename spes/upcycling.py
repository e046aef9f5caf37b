"""Sparse upcycling: a spes MoE's weights from a dense Hugging Face Llama- or Qwen3-style model's.

The dense MLP becomes the experts (copied into each, or partitioned across them) and the router and the down
projection's scale are chosen so that the MoE starts out computing the dense model: spes.upcycle's docstring (its
`--help`) has the derivation. `python -m spes.upcycle` is the command line.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from spes.atomic import staging_dir
from spes.config import ModelConfig, TrainConfig
from spes.hf_convert import (
    copy_tokenizer,
    hf_to_spes,
    read_hf_config,
    read_hf_weights,
    refuse_existing,
    write_step_dir,
)
from spes.hf_map import CONFIG_KEYS, FAMILIES, QK_NORM_KEYS, SHARED_KEYS, check_hf_config
from spes.hub import resolve
from spes.moe import init_truncated_normal_
from spes.tokenizer import LoadedTokenizer, check_vocab, load_tokenizer

log = logging.getLogger(__name__)
TIE_BREAKING_STD = 1e-4
DENSE_MLP_KEYS: dict[str, str] = {
    "blocks.{l}.mlp.gate": "model.layers.{l}.mlp.gate_proj.weight",
    "blocks.{l}.mlp.up": "model.layers.{l}.mlp.up_proj.weight",
    "blocks.{l}.mlp.down": "model.layers.{l}.mlp.down_proj.weight",
}


@dataclass(frozen=True)
class DenseFamily:
    """A dense HF decoder that spes can upcycle."""

    model_type: str
    architecture: str
    qk_norm: Literal["per_head", "none"]
    fixed: dict[str, Any]
    """HF config values spes requires."""

    def key_map(self) -> dict[str, str]:
        qk = QK_NORM_KEYS if self.qk_norm == "per_head" else {}
        return {**SHARED_KEYS, **qk, **DENSE_MLP_KEYS}


DENSE_FAMILIES: dict[str, DenseFamily] = {
    "llama": DenseFamily(
        "llama", "LlamaForCausalLM", "none", {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
    ),
    "qwen3": DenseFamily(
        "qwen3",
        "Qwen3ForCausalLM",
        "per_head",
        {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False},
    ),
}


@dataclass(frozen=True)
class ExpertPlan:
    """How the dense MLP becomes experts (spes.upcycle's docstring has the derivation)."""

    partition: bool
    router_std: float
    """std of the (truncated-normal) router init; 0 means an all-zero router"""
    down_scale: float
    exact: bool
    """whether the upcycled model computes exactly the dense model at step 0"""
    tied: bool
    """whether experts start with identical weights and identical router rows (they then stay tied)"""


def expert_plan(
    *,
    num_experts: int,
    top_k: int,
    normalize_p: float | None,
    partition: bool,
    init_std: float,
    router_std: float | None = None,
) -> ExpertPlan:
    """Router init and down-projection scale that make the upcycled MoE start as the dense model.

    `router_std` (None: automatic) overrides the router init std; 0 means all zeros.
    """
    uniform_weight = 1.0 / num_experts if normalize_p is None else top_k ** (-1.0 / normalize_p)
    if partition:
        every_expert = top_k == num_experts
        std = router_std if router_std is not None else (0.0 if every_expert else init_std)
        return ExpertPlan(
            partition=True,
            router_std=std,
            down_scale=1.0 / uniform_weight,
            exact=every_expert and std == 0.0,
            tied=False,
        )
    if normalize_p == 1.0:
        std = router_std if router_std is not None else init_std
        return ExpertPlan(partition=False, router_std=std, down_scale=1.0, exact=True, tied=std == 0.0)
    std = router_std if router_std is not None else TIE_BREAKING_STD
    return ExpertPlan(
        partition=False, router_std=std, down_scale=1.0 / (top_k * uniform_weight), exact=std == 0.0, tied=std == 0.0
    )


def check_dense_match(m: ModelConfig, hf: Any, family: DenseFamily, *, partition: bool) -> None:
    """Refuse a spes model config that does not have the dense model's shapes and options."""
    where = f"dense Hugging Face config ({family.model_type})"
    rope_theta = check_hf_config(hf, family.fixed, where)
    wanted: dict[str, Any] = {
        spes: getattr(hf, attr) for spes, attr in CONFIG_KEYS.items() if spes not in ("max_sequence_length", "init_std")
    }
    wanted.update(rope_theta=rope_theta, attention_layer_norm=family.qk_norm != "none", layer_norm_with_affine=True)
    if family.qk_norm != "none":
        wanted.update(attention_layer_norm_over_head=True, attention_layer_norm_with_affine=True)
    for key, value in wanted.items():
        if getattr(m, key) != value:
            raise ValueError(f"config key 'model.{key}' = {getattr(m, key)!r} must be {value!r} to match the {where}")
    dense_width, num_experts = hf.intermediate_size, m.moe_num_experts
    if partition:
        if dense_width % num_experts != 0:
            raise ValueError(
                f"--partition: the dense intermediate_size {dense_width} does not split into "
                f"model.moe_num_experts={num_experts} equal slices; choose a number of experts that divides it, "
                "or upcycle without --partition (every expert a full copy)"
            )
        width = dense_width // num_experts
        how = f"2 * intermediate_size / moe_num_experts = 2 * {dense_width} / {num_experts}: each expert is a slice"
    else:
        width, how = dense_width, f"2 * intermediate_size = 2 * {dense_width}: each expert is a full copy"
    if m.expert_hidden_size != width:
        raise ValueError(
            f"config key 'model.mlp_hidden_size' = {m.mlp_hidden_size} must be {2 * width} = {how} of the dense "
            f"{family.model_type} model's MLP, mlp_hidden_size / 2 wide; set model.mlp_hidden_size={2 * width} "
            "(or model.mlp_ratio)"
        )


def upcycle_state(
    dense: Mapping[str, torch.Tensor], m: ModelConfig, plan: ExpertPlan, *, seed: int
) -> dict[str, torch.Tensor]:
    """Fused spes MoE state from a dense spes-named state (`blocks.{l}.mlp.{gate,up,down}` in HF layout)."""
    num_experts = m.moe_num_experts
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        out = {k: v for k, v in dense.items() if ".mlp." not in k}
        for layer in range(m.n_layers):
            gate_DI = dense[f"blocks.{layer}.mlp.gate"].T
            up_DI = dense[f"blocks.{layer}.mlp.up"].T
            down_ID = dense[f"blocks.{layer}.mlp.down"].T * plan.down_scale
            prefix = f"blocks.{layer}.ffn"
            if plan.partition:
                d, width = gate_DI.shape[0], m.expert_hidden_size
                out[f"{prefix}.experts.w1"] = gate_DI.reshape(d, num_experts, width).permute(1, 0, 2).contiguous()
                out[f"{prefix}.experts.v1"] = up_DI.reshape(d, num_experts, width).permute(1, 0, 2).contiguous()
                out[f"{prefix}.experts.w2"] = down_ID.reshape(num_experts, width, d).contiguous()
            else:
                for kind, weight in (("w1", gate_DI), ("v1", up_DI), ("w2", down_ID)):
                    out[f"{prefix}.experts.{kind}"] = weight.unsqueeze(0).repeat(num_experts, 1, 1)
            router = torch.zeros(num_experts, m.d_model)
            if plan.router_std > 0:
                init_truncated_normal_(router, plan.router_std, m.init_cutoff_factor)
            out[f"{prefix}.router.weight"] = router
    finally:
        torch.random.set_rng_state(generator_state)
    return out


def make_random_dense(
    m: ModelConfig,
    out: str | Path,
    *,
    model_type: str = "qwen3",
    partition: bool = False,
    tokenizer: Path | None = None,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Write a randomly initialized dense HF model that `m` can upcycle (demos and tests; no download needed); `out`
    is --hf, elsewhere the model read, so a directory holding one is replaced only when asked."""
    import transformers  # optional dependency (pip install -e .[hf])

    family = DENSE_FAMILIES[model_type]
    width = m.expert_hidden_size * (m.moe_num_experts if partition else 1)
    config_class = getattr(transformers, family.architecture.replace("ForCausalLM", "Config"))
    config = config_class(
        **{attr: getattr(m, spes) for spes, attr in CONFIG_KEYS.items()},
        **family.fixed,
        intermediate_size=width,
        head_dim=m.head_dim,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rope_theta)},
        eos_token_id=m.eos_token_id,
        pad_token_id=m.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, family.architecture)(config)
    path = Path(out)
    refuse_existing(path, overwrite, "config.json")
    with staging_dir(path) as tmp, _no_progress_bars():
        model.save_pretrained(str(tmp))
        if tokenizer is not None:
            copy_tokenizer(tokenizer, tmp, vocab_size=m.vocab_size)
    return path


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off while it writes a model (its `Writing model shards` bar of a tiny model on
    stderr reads like output of spes's), as they were after."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def check_dense_tokenizer(tokenizer: LoadedTokenizer, m: ModelConfig) -> None:
    """Refuse a dense tokenizer of another vocabulary; warn of another EOS than `model.eos_token_id`, which training
    refuses in the shards tokenized with it (a post-trained model's tokenizer may name its end of turn)."""
    check_vocab(tokenizer.vocab_size, m.vocab_size, m.embedding_size)
    if tokenizer.eos_token_id != m.eos_token_id:
        theirs, ours = (tokenizer.tokenizer.id_to_token(i) for i in (tokenizer.eos_token_id, m.eos_token_id))
        log.warning(
            f"note: the dense model's tokenizer ends documents with {theirs!r} (id {tokenizer.eos_token_id}) but "
            f"model.eos_token_id is {m.eos_token_id} ({ours!r}), and training refuses shards of another EOS: "
            f"tokenize with eos_token {ours!r} in the tokenizer's tokenizer_config.json, or set "
            f"model.eos_token_id={tokenizer.eos_token_id}"
        )


def upcycle(
    hf_dir: str | Path,
    cfg: TrainConfig,
    out: str | Path,
    *,
    partition: bool = False,
    router_std: float | None = None,
    overwrite: bool = False,
) -> tuple[Path, ExpertPlan]:
    """Dense HF directory (or Hub id) + spes run config -> spes checkpoint step directory `out`."""
    src = resolve(hf_dir, what="--hf")
    moe = "it is an MoE already: start a run from it with python -m spes.hf import --hf {hf} --out <dir>/step0"
    hf_config, family = read_hf_config(src, DENSE_FAMILIES, elsewhere=dict.fromkeys(FAMILIES, moe))
    m = cfg.model
    check_dense_match(m, hf_config, family, partition=partition)
    has_tokenizer = (src / "tokenizer.json").is_file()
    if has_tokenizer:
        check_dense_tokenizer(load_tokenizer(src), m)
    dense = hf_to_spes(read_hf_weights(src), family.key_map(), m, architecture=family.architecture)
    plan = expert_plan(
        num_experts=m.moe_num_experts,
        top_k=m.moe_top_k,
        normalize_p=m.normalize_expert_weights_p,
        partition=partition,
        init_std=m.init_std,
        router_std=router_std,
    )
    state = upcycle_state(dense, m, plan, seed=cfg.seed)
    step = write_step_dir(out, state, cfg, tokenizer=src if has_tokenizer else None, overwrite=overwrite)
    return step, plan
