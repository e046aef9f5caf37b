"""The OLMoE-style decoder: pre-norm blocks of RoPE attention (optional QK-norm, GQA) and a dropless MoE.

The model is plain PyTorch: data/tensor parallelism is applied from outside (`spes.distributed`),
and its Hugging Face mapping lives in `spes.hf_map`. Build it on the meta device and materialize with
`init_weights`, so a large config costs nothing until it is placed:

    with torch.device("meta"):
        model = Transformer(cfg.model, block_size=..., trainable_block=...)
    model.to_empty(device="cpu"); model.init_weights(seed)

Shape legend: B batch, S sequence, D d_model, H heads, G kv heads, Hd head size, V embedding rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spes.config import ModelConfig, TrainConfig
from spes.distributed import is_dtensor
from spes.head_loss import ChunkFns, head_loss_sums
from spes.moe import ExpertBlocks, MoE, init_truncated_normal_


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (bf16 mean-of-squares loses too much), cast back to the input dtype."""

    def __init__(self, size: int, eps: float, affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.float()
        return y.to(x.dtype)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)


def rope_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (S, Hd) for rotate-half RoPE (the layout of Llama/OLMo/HF)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x_BHSd: torch.Tensor, cos_SHd: torch.Tensor, sin_SHd: torch.Tensor) -> torch.Tensor:
    half = x_BHSd.shape[-1] // 2
    rotated = torch.cat([-x_BHSd[..., half:], x_BHSd[..., :half]], dim=-1)
    return (x_BHSd.float() * cos_SHd + rotated.float() * sin_SHd).to(x_BHSd.dtype)


class Attention(nn.Module):
    """Causal multi-head attention with RoPE, grouped KV heads and optional QK-norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.n_kv_heads is not None
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.dropout = cfg.attention_dropout
        d, hd = cfg.d_model, cfg.head_dim
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.per_head_norm = cfg.attention_layer_norm_over_head
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.attention_layer_norm:
            affine = cfg.attention_layer_norm_with_affine
            q_size, k_size = (hd, hd) if self.per_head_norm else (self.n_heads * hd, self.n_kv_heads * hd)
            self.q_norm = RMSNorm(q_size, cfg.layer_norm_eps, affine)
            self.k_norm = RMSNorm(k_size, cfg.layer_norm_eps, affine)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q, k, v = self.q_proj(x_BSD), self.k_proj(x_BSD), self.v_proj(x_BSD)
        if self.q_norm is not None and self.k_norm is not None and not self.per_head_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # OLMoE: one norm over all heads
        q = q.view(B, S, self.n_heads, self.head_dim)
        k = k.view(B, S, self.n_kv_heads, self.head_dim)
        v = v.view(B, S, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None and self.per_head_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # Qwen3: one norm per head
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos[:S], sin[:S]), apply_rope(k, cos[:S], sin[:S])
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        return self.o_proj(y.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + moe(norm(x))."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        block_size: int,
        trainable_block: int | None,
        frozen_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.layer_norm_eps, cfg.layer_norm_with_affine)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.layer_norm_eps, cfg.layer_norm_with_affine)
        self.ffn = MoE(
            d_model=cfg.d_model,
            hidden=cfg.expert_hidden_size,
            num_experts=cfg.moe_num_experts,
            top_k=cfg.moe_top_k,
            block_size=block_size,
            trainable_block=trainable_block,
            num_layers=cfg.n_layers,
            lb_weight=cfg.moe_loss_weight,
            z_weight=cfg.moe_zloss_weight,
            normalize_p=cfg.normalize_expert_weights_p,
            backend=cfg.moe_backend,
            frozen_dtype=frozen_dtype,
        )
        self.dropout = nn.Dropout(cfg.residual_dropout)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.ffn_sublayer(self.attn_sublayer(x, cos, sin))

    def attn_sublayer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x + attn(norm(x)): with `ffn_sublayer`, the unit `fine_grained` checkpointing recomputes and compiles,
        norm and residual add included, so no part of a block runs eager (an eager fp32 RMSNorm with its backward
        is a dozen passes over the residual stream)."""
        return x + self.dropout(self.attn(self.attn_norm(x), cos, sin))

    def ffn_sublayer(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x + moe(norm(x)), with the MoE's auxiliary losses and routing counts."""
        y, aux = self.ffn(self.ffn_norm(x))
        return x + self.dropout(y), aux.lb_loss, aux.z_loss, aux.tokens_per_expert


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # (B, S, V) in the compute dtype; None when the model was given the labels
    lb_loss: torch.Tensor  # summed over layers, weighted
    z_loss: torch.Tensor  # summed over layers, weighted
    tokens_per_expert: torch.Tensor  # (L, E)
    # given the labels (`head_loss_sums`): fp32 sums over the kept labels of the next-token cross entropy and of
    # logsumexp(logits)^2 (with a `logit_z_weight`), and ce_sum + logit_z_weight * logit_z_sum, the one of the three
    # a gradient flows through
    ce_sum: torch.Tensor | None = None
    logit_z_sum: torch.Tensor | None = None
    loss_sum: torch.Tensor | None = None


def resolve_moe_backends(model: nn.Module, device: torch.device) -> None:
    """Decide each MoE layer's `auto` backend for `device` now, outside any torch.compile trace."""
    for module in model.modules():
        if isinstance(module, ExpertBlocks):
            module.resolved_backend(device)


def assign_whole(param: torch.Tensor, whole: torch.Tensor) -> None:
    """Give `param` the values of the whole tensor `whole`: all of them, or this rank's shard of an FSDP2 DTensor."""
    if is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor

        whole = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param = param.to_local()
    param.copy_(whole)


class Transformer(nn.Module):
    """Embedding -> n_layers x Block -> RMSNorm -> untied LM head."""

    rope_cos: torch.Tensor  # (max_sequence_length, head_dim) buffers, recomputed rather than saved
    rope_sin: torch.Tensor

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        block_size: int | None = None,
        trainable_block: int | None = None,
        frozen_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        assert cfg.embedding_size is not None
        block_size = block_size or cfg.moe_num_experts
        self.embed = nn.Embedding(cfg.embedding_size, cfg.d_model)
        self.embed_dropout = nn.Dropout(cfg.embedding_dropout)
        self.blocks = nn.ModuleList(
            Block(cfg, block_size=block_size, trainable_block=trainable_block, frozen_dtype=frozen_dtype)
            for _ in range(cfg.n_layers)
        )
        self.norm = RMSNorm(cfg.d_model, cfg.layer_norm_eps, cfg.layer_norm_with_affine)
        self.lm_head = nn.Linear(cfg.d_model, cfg.embedding_size, bias=False)
        self.head_chunk_fns = ChunkFns()  # `fused_loss`'s chunk math; compiled under `compile`
        cos, sin = rope_tables(cfg.max_sequence_length, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @classmethod
    def for_run(cls, cfg: TrainConfig, *, training: bool = False) -> Transformer:
        """The model a node of this run builds: under SPES, expert blocks per peer and only its own trainable. For
        `training` under amp_bf16 the frozen blocks are held in bf16 (autocast computes them in bf16 anyway: the
        same values at half the memory); otherwise every weight is fp32, as read (an fp32 forward, an export)."""
        owned = cfg.owned_experts()
        trainable = None if owned is None else cfg.spes_config.peer_id
        frozen_dtype = torch.bfloat16 if training and cfg.precision == "amp_bf16" else None
        return cls(cfg.model, block_size=cfg.experts_per_block, trainable_block=trainable, frozen_dtype=frozen_dtype)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Truncated-normal init of every matrix (OLMo `init_fn: normal`), ones for norms; deterministic in `seed`.

        Each expert kind of a layer is drawn as one (E, ...) tensor and then split into blocks, so every
        block layout (SPES peers, DiLoCo, centralized) starts from the same weights. Each tensor is drawn
        whole, one at a time, so a model already sharded by FSDP2 (on meta, then `to_empty`) gets exactly the
        values an unsharded one would, while no rank ever holds more than one whole tensor.
        """
        cfg = self.cfg
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.reset_parameters()
            for module in self.modules():
                if isinstance(module, nn.ParameterList):
                    continue  # expert blocks, drawn whole below
                for p in module.parameters(recurse=False):
                    if p.ndim >= 2:
                        full = torch.empty(p.shape, dtype=p.dtype, device=p.device)
                        init_truncated_normal_(full, cfg.init_std, cfg.init_cutoff_factor)
                        assign_whole(p, full)
                if isinstance(module, ExpertBlocks):
                    for blocks in (module.w1, module.v1, module.w2):
                        full = torch.empty(cfg.moe_num_experts, *blocks[0].shape[1:], device=blocks[0].device)
                        init_truncated_normal_(full, cfg.init_std, cfg.init_cutoff_factor)
                        for (lo, hi), p in zip(module.bounds, blocks):
                            assign_whole(p, full[lo:hi])
        finally:
            torch.random.set_rng_state(gen_state)
        cos, sin = rope_tables(cfg.max_sequence_length, cfg.head_dim, cfg.rope_theta, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        resolve_moe_backends(self, self.rope_cos.device)

    def set_own_count_scale(self, factor: float) -> None:
        """Apply the SPES decayed load-balancing factor to every MoE layer."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.set_own_count_scale(factor)

    def forward(
        self, input_ids_BS: torch.Tensor, labels_BS: torch.Tensor | None = None, *, logit_z_weight: float | None = None
    ) -> ModelOutput:
        """The logits, or given `labels_BS` the loss sums of `head_loss_sums` instead (computed here, inside the
        forward, so FSDP has the head's weight gathered), with the MoE's auxiliary losses."""
        if input_ids_BS.shape[-1] > self.rope_cos.shape[0]:
            raise ValueError(
                f"a sequence of {input_ids_BS.shape[-1]} tokens is longer than "
                f"model.max_sequence_length={self.rope_cos.shape[0]}: raise it or feed shorter windows"
            )
        x = self.embed_dropout(self.embed(input_ids_BS))
        lb = z = x.new_zeros((), dtype=torch.float32)
        counts = []
        for block in self.blocks:
            x, lb_l, z_l, tpe = block(x, self.rope_cos, self.rope_sin)
            lb, z = lb + lb_l, z + z_l
            counts.append(tpe)
        h = self.norm(x)
        if labels_BS is None:
            return ModelOutput(logits=self.lm_head(h), lb_loss=lb, z_loss=z, tokens_per_expert=torch.stack(counts))
        loss_sum, ce_sum, logit_z_sum = head_loss_sums(
            h.flatten(0, 1),
            self.lm_head.weight,
            labels_BS.flatten(),
            logit_z_weight=logit_z_weight,
            chunk_fns=self.head_chunk_fns,
        )
        return ModelOutput(None, lb, z, torch.stack(counts), ce_sum, logit_z_sum, loss_sum)


# ---------------------------------------------------------------------------------------------------------------
# Parameter accounting


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active_per_token: int
    trainable: int

    def describe(self) -> str:
        return (
            f"parameters: total {self.total / 1e6:,.2f}M | active per token {self.active_per_token / 1e6:,.2f}M"
            f" | trainable on this node {self.trainable / 1e6:,.2f}M"
        )


def count_params(model: Transformer) -> ParamCounts:
    """Counts read off the model (works on the meta device)."""
    cfg = model.cfg
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - expert + expert * cfg.moe_top_k // cfg.moe_num_experts
    return ParamCounts(total=total, active_per_token=active, trainable=trainable)


def analytic_param_counts(cfg: ModelConfig, trained_experts: int | None = None) -> ParamCounts:
    """The same counts from the config alone (the test's independent check)."""
    assert cfg.embedding_size is not None and cfg.n_kv_heads is not None
    d, hd, f, e = cfg.d_model, cfg.head_dim, cfg.expert_hidden_size, cfg.moe_num_experts
    attn = d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    if cfg.attention_layer_norm and cfg.attention_layer_norm_with_affine:
        attn += 2 * hd if cfg.attention_layer_norm_over_head else (cfg.n_heads + cfg.n_kv_heads) * hd
    norms = 2 * d if cfg.layer_norm_with_affine else 0
    router, one_expert = e * d, 3 * d * f
    shared = cfg.n_layers * (attn + norms + router) + 2 * cfg.embedding_size * d
    shared += d if cfg.layer_norm_with_affine else 0
    trained = e if trained_experts is None else trained_experts
    return ParamCounts(
        total=shared + cfg.n_layers * e * one_expert,
        active_per_token=shared + cfg.n_layers * cfg.moe_top_k * one_expert,
        trainable=shared + cfg.n_layers * trained * one_expert,
    )


def tflops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token (6 x active matmul params + attention), for MFU."""
    return tflops_done_per_token(cfg, trained_expert_share=1.0)


def tflops_done_per_token(cfg: ModelConfig, trained_expert_share: float) -> float:
    """The training FLOPs per token a node actually does when only `trained_expert_share` of the routed token
    copies land on experts it trains: every matmul's forward (2 x params) and input gradient (2x), weight
    gradients (2x) for the shared matmuls and the trained experts only, plus attention. Recomputation
    (activation checkpointing) is not counted: this is model FLOPs, not hardware FLOPs.
    With `trained_expert_share` 1 (a full model) it is `tflops_per_token`."""
    counts = analytic_param_counts(cfg)
    assert cfg.embedding_size is not None
    matmul_active = counts.active_per_token - cfg.embedding_size * cfg.d_model
    expert_active = cfg.n_layers * cfg.moe_top_k * 3 * cfg.d_model * cfg.expert_hidden_size
    attn = 12 * cfg.n_layers * cfg.d_model * cfg.max_sequence_length / 2
    shared = 6 * (matmul_active - expert_active)
    return (shared + (4 + 2 * trained_expert_share) * expert_active + attn) / 1e12
