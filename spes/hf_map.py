"""The map between spes models and Hugging Face MoE models: tensor names, architectures and config attributes.

A spes model maps exactly onto one of three `transformers` MoE architectures, chosen by its
attention options (`choose_family`):

| spes model options                                   | Hugging Face architecture  |
|------------------------------------------------------|----------------------------|
| `attention_layer_norm`, over all heads (OLMoE)        | `OlmoeForCausalLM`         |
| `attention_layer_norm` + `attention_layer_norm_over_head` (Qwen3) | `Qwen3MoeForCausalLM` |
| no QK-norm, `moe_normalize_expert_weights: true`      | `MixtralForCausalLM`       |

Every other combination is refused with a message naming the setting. In particular a model
without QK-norm and without top-k renormalization has no exact HF equivalent: OLMoE and Qwen3-MoE
always apply an RMSNorm to queries and keys (a ones-weight RMSNorm still rescales, so it is not an
identity), and Mixtral always renormalizes the top-k weights. Renormalization by a p-norm other than
p=1 is refused too (HF divides by the sum). Norms without a learnable scale (`*_with_affine: false`)
are exported as ones, which is exact.

Names: the table `SHARED_KEYS` (+ `QK_NORM_KEYS` and each family's router/expert keys) maps spes
names to HF names, `{l}` standing for the layer and `{e}` for the expert. A spes expert tensor is
one fused `(E, ...)` tensor per kind (see `fuse_expert_blocks`); an HF template holding `{e}` takes
expert `e` of it, transposed (`w1[e]` is `(D, F)`, HF `gate_proj.weight` is `(F, D)`). HF
directories are written in the per-expert layout of the published checkpoints (what
`save_pretrained` writes); `transformers` fuses experts on load.

Declarative and torch-free: the command lines (`spes.hf`, `spes.upcycle`) name its families and dtypes in their
`--help` without importing torch; the tensors and files are converted by `spes.hf_convert`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from spes.config import ModelConfig

EXPORT_DTYPES = ("bfloat16", "float32")
"""The weight dtypes an export writes (torch's names)."""


# spes name -> HF name, common to every decoder family here (the dense Llama/Qwen3 ones of spes.upcycle too).
SHARED_KEYS: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "blocks.{l}.attn_norm.weight": "model.layers.{l}.input_layernorm.weight",
    "blocks.{l}.attn.q_proj.weight": "model.layers.{l}.self_attn.q_proj.weight",
    "blocks.{l}.attn.k_proj.weight": "model.layers.{l}.self_attn.k_proj.weight",
    "blocks.{l}.attn.v_proj.weight": "model.layers.{l}.self_attn.v_proj.weight",
    "blocks.{l}.attn.o_proj.weight": "model.layers.{l}.self_attn.o_proj.weight",
    "blocks.{l}.ffn_norm.weight": "model.layers.{l}.post_attention_layernorm.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
QK_NORM_KEYS: dict[str, str] = {
    "blocks.{l}.attn.q_norm.weight": "model.layers.{l}.self_attn.q_norm.weight",
    "blocks.{l}.attn.k_norm.weight": "model.layers.{l}.self_attn.k_norm.weight",
}
_QWEN_STYLE_MOE_KEYS: dict[str, str] = {
    "blocks.{l}.ffn.router.weight": "model.layers.{l}.mlp.gate.weight",
    "blocks.{l}.ffn.experts.w1": "model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
    "blocks.{l}.ffn.experts.v1": "model.layers.{l}.mlp.experts.{e}.up_proj.weight",
    "blocks.{l}.ffn.experts.w2": "model.layers.{l}.mlp.experts.{e}.down_proj.weight",
}
_MIXTRAL_MOE_KEYS: dict[str, str] = {
    "blocks.{l}.ffn.router.weight": "model.layers.{l}.block_sparse_moe.gate.weight",
    "blocks.{l}.ffn.experts.w1": "model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight",
    "blocks.{l}.ffn.experts.v1": "model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight",
    "blocks.{l}.ffn.experts.w2": "model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight",
}

# spes ModelConfig field <-> HF config attribute, for every family.
CONFIG_KEYS: dict[str, str] = {
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "max_sequence_length": "max_position_embeddings",
    "layer_norm_eps": "rms_norm_eps",
    "embedding_size": "vocab_size",
    "init_std": "initializer_range",
}
_MOE_CONFIG_KEYS: dict[str, str] = {"moe_top_k": "num_experts_per_tok", "moe_loss_weight": "router_aux_loss_coef"}


@dataclass(frozen=True)
class HFFamily:
    """One Hugging Face MoE architecture and how a spes model is written in it."""

    model_type: str
    architecture: str
    config_class: str
    qk_norm: Literal["full", "per_head", "none"]
    keys: dict[str, str]
    """router and expert keys (spes -> HF), added to SHARED_KEYS (and QK_NORM_KEYS)."""
    num_experts_attr: str
    expert_width_attr: str
    renormalizes: Literal["config", "always"]
    """'config': `norm_topk_prob` chooses; 'always': the architecture always renormalizes."""
    fixed: dict[str, Any] = field(default_factory=dict)
    """HF config values spes requires: written on export, checked on import."""
    extra: dict[str, str] = field(default_factory=dict)
    """Further HF attributes that hold a spes value: HF attribute -> 'expert_width' | 'head_dim'."""

    def key_map(self) -> dict[str, str]:
        qk = QK_NORM_KEYS if self.qk_norm != "none" else {}
        return {**SHARED_KEYS, **qk, **self.keys}

    def config_attr(self, spes_key: str | None) -> str | None:
        """The HF config attribute a `model.` key is imported from, if it is read from one."""
        attrs = {
            **CONFIG_KEYS,
            **_MOE_CONFIG_KEYS,
            "mlp_hidden_size": self.expert_width_attr,
            "moe_num_experts": self.num_experts_attr,
            "rope_theta": "rope_parameters.rope_theta",
            "eos_token_id": "eos_token_id",
            "pad_token_id": "pad_token_id",
        }
        return attrs.get((spes_key or "").removeprefix("model."))


OLMOE = HFFamily(
    model_type="olmoe",
    architecture="OlmoeForCausalLM",
    config_class="OlmoeConfig",
    qk_norm="full",
    keys=_QWEN_STYLE_MOE_KEYS,
    num_experts_attr="num_experts",
    expert_width_attr="intermediate_size",
    renormalizes="config",
    fixed={"hidden_act": "silu", "attention_bias": False, "clip_qkv": None},
)
QWEN3_MOE = HFFamily(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    config_class="Qwen3MoeConfig",
    qk_norm="per_head",
    keys=_QWEN_STYLE_MOE_KEYS,
    num_experts_attr="num_experts",
    expert_width_attr="moe_intermediate_size",
    renormalizes="config",
    fixed={
        "hidden_act": "silu",
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
    },
    extra={"intermediate_size": "expert_width", "head_dim": "head_dim"},
)
MIXTRAL = HFFamily(
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    config_class="MixtralConfig",
    qk_norm="none",
    keys=_MIXTRAL_MOE_KEYS,
    num_experts_attr="num_local_experts",
    expert_width_attr="intermediate_size",
    renormalizes="always",
    fixed={"hidden_act": "silu", "sliding_window": None},
    extra={"head_dim": "head_dim"},
)
FAMILIES: dict[str, HFFamily] = {f.model_type: f for f in (OLMOE, QWEN3_MOE, MIXTRAL)}
DENSE_MODEL_TYPES = ("llama", "qwen3")
"""The dense families spes.upcycle takes (spes.upcycling's DENSE_FAMILIES): an import given one names that command
instead. Named here because spes.upcycling builds on this module (and spes.upcycle's --help names them, torch-free)."""


def choose_family(m: ModelConfig) -> HFFamily:
    """The HF architecture that computes exactly what this spes model computes, or a ValueError naming why none."""
    p = m.normalize_expert_weights_p
    if p is not None and p != 1.0:
        raise ValueError(
            f"config key 'model.moe_normalize_expert_weights' = {m.moe_normalize_expert_weights!r}: a p-norm with "
            f"p != 1 has no Hugging Face equivalent (HF MoE models divide the top-k weights by their sum, p=1, "
            f"or do not renormalize)"
        )
    if m.attention_layer_norm:
        return QWEN3_MOE if m.attention_layer_norm_over_head else OLMOE
    if p == 1.0:
        return MIXTRAL
    raise ValueError(
        "config key 'model.attention_layer_norm' = False with 'model.moe_normalize_expert_weights' unset has no "
        "exact Hugging Face architecture: OLMoE and Qwen3-MoE always RMS-normalize queries and keys, Mixtral always "
        "renormalizes the top-k weights. Train with attention_layer_norm: true (OLMoE) or "
        "moe_normalize_expert_weights: true (Mixtral) to export"
    )


def hf_config_dict(family: HFFamily, m: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """Keyword arguments of the family's `transformers` config class for this spes model."""
    values: dict[str, Any] = {hf: getattr(m, spes) for spes, hf in {**CONFIG_KEYS, **_MOE_CONFIG_KEYS}.items()}
    derived = {"expert_width": m.expert_hidden_size, "head_dim": m.head_dim}
    values.update(
        {
            family.num_experts_attr: m.moe_num_experts,
            family.expert_width_attr: m.expert_hidden_size,
            **{attr: derived[what] for attr, what in family.extra.items()},
            **family.fixed,
            "rope_parameters": {"rope_type": "default", "rope_theta": float(m.rope_theta)},
            "eos_token_id": m.eos_token_id,
            "pad_token_id": m.pad_token_id,
            "bos_token_id": None,
            "tie_word_embeddings": False,
            "architectures": [family.architecture],
            "dtype": dtype,
        }
    )
    if family.renormalizes == "config":
        values["norm_topk_prob"] = m.normalize_expert_weights_p == 1.0
    return values


def check_hf_config(hf: Any, fixed: Mapping[str, Any], where: str) -> float:
    """Refuse HF config settings spes cannot compute; returns the RoPE theta."""
    for attr, want in fixed.items():
        have = getattr(hf, attr, want)
        if have != want:
            raise ValueError(f"{where}: '{attr}' = {have!r} is not supported by spes (needs {want!r})")
    rope = getattr(hf, "rope_parameters", None) or {"rope_type": "default", "rope_theta": hf.rope_theta}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"{where}: 'rope_parameters.rope_type' = {rope['rope_type']!r} is not supported by spes (plain RoPE only)"
        )
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if head_dim * hf.num_attention_heads != hf.hidden_size:
        raise ValueError(
            f"{where}: 'head_dim' = {head_dim} with {hf.num_attention_heads} heads != hidden_size "
            f"{hf.hidden_size}; spes needs head_dim = hidden_size / num_attention_heads"
        )
    return float(rope["rope_theta"])


def model_config_from_hf(family: HFFamily, hf: Any, *, vocab_size: int | None = None) -> dict[str, Any]:
    """spes `model:` settings of an HF config object (attribute access), refusing what spes cannot compute."""
    rope_theta = check_hf_config(hf, family.fixed, f"Hugging Face config ({family.model_type})")
    cfg: dict[str, Any] = {spes: getattr(hf, attr) for spes, attr in {**CONFIG_KEYS, **_MOE_CONFIG_KEYS}.items()}
    width = getattr(hf, family.expert_width_attr)
    normalized = family.renormalizes == "always" or bool(getattr(hf, "norm_topk_prob", False))
    cfg.update(
        mlp_hidden_size=2 * width,
        moe_num_experts=getattr(hf, family.num_experts_attr),
        moe_normalize_expert_weights=True if normalized else None,
        rope_theta=rope_theta,
        attention_layer_norm=family.qk_norm != "none",
        attention_layer_norm_over_head=family.qk_norm == "per_head",
        vocab_size=vocab_size if vocab_size is not None else hf.vocab_size,
    )
    cfg["eos_token_id"] = _single_id(getattr(hf, "eos_token_id", None), default=0)
    cfg["pad_token_id"] = _single_id(getattr(hf, "pad_token_id", None), default=cfg["eos_token_id"])
    return cfg


def _single_id(value: Any, *, default: int) -> int:
    if isinstance(value, list):
        value = value[0] if value else None
    return default if value is None else int(value)


def implicit_norm_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """spes norm keys that do not exist because the norm has no learnable scale (exported as ones)."""
    assert m.n_kv_heads is not None
    shapes: dict[str, tuple[int, ...]] = {}
    if not m.layer_norm_with_affine:
        shapes["norm.weight"] = (m.d_model,)
        for i in range(m.n_layers):
            shapes[f"blocks.{i}.attn_norm.weight"] = shapes[f"blocks.{i}.ffn_norm.weight"] = (m.d_model,)
    if m.attention_layer_norm and not m.attention_layer_norm_with_affine:
        per_head = m.attention_layer_norm_over_head
        for i in range(m.n_layers):
            shapes[f"blocks.{i}.attn.q_norm.weight"] = (m.head_dim if per_head else m.n_heads * m.head_dim,)
            shapes[f"blocks.{i}.attn.k_norm.weight"] = (m.head_dim if per_head else m.n_kv_heads * m.head_dim,)
    return shapes
