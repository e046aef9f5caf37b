"""Dropless top-k Mixture-of-Experts feed-forward with experts stored as SPES ownership blocks.

A SPES node trains only the experts it owns. To make that a real memory saving, the experts of a
layer are stored as *blocks* of `block_size` experts (one block per peer under SPES), each block its
own parameters. The owned block has `requires_grad=True`; the others are frozen, so they get no
`.grad`, no optimizer state and no weight-gradient work, and under amp_bf16 they are held in bf16.

Backends: `torch` sorts the routed copies by expert and loops over experts, `megablocks` runs its grouped
GEMM per block; both need the per-expert counts on the host (one host-device sync per layer). `grouped_mm`
(the `auto` choice on CUDA) keeps the counts on the device: the trained block's experts go first, all
experts run in one grouped GEMM per weight, and its backward computes the trained experts' weight
gradients only (`_TrainedFirstGroupedMM`), so a micro-batch's forward and backward never wait for the host.

Shape legend (as in torchtitan): T tokens, D d_model, F expert width, E experts, K top-k,
N experts in one block, A = T*K routed token copies.
    x_TD, logits_TE, probs_TE, topw_TK, topi_TK, w1_NDF (gate), v1_NDF (up), w2_NFD (down).

State-dict names: `experts.w1.{b}`, `experts.v1.{b}`, `experts.w2.{b}` for block b, and
`router.weight` (E, D). The sync layer relies on these names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

MoEBackend = Literal["auto", "torch", "grouped_mm", "megablocks"]
EXPERT_KINDS = ("w1", "v1", "w2")
_EXPERT_BLOCK_RE = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<kind>w1|v1|w2)\.(?P<block>0|[1-9][0-9]*)$")
_FUSED_EXPERTS_RE = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<kind>w1|v1|w2)$")


class ExpertBlock(NamedTuple):
    """A parsed expert-block name: `{prefix}.{kind}.{block}`."""

    prefix: str
    kind: str
    block: int


def parse_expert_block(name: str) -> ExpertBlock | None:
    """Parse `blocks.3.ffn.experts.w1.2` into (`blocks.3.ffn.experts`, `w1`, 2); None for any other tensor."""
    match = _EXPERT_BLOCK_RE.match(name)
    if match is None:
        return None
    return ExpertBlock(match["prefix"], match["kind"], int(match["block"]))


def fuse_expert_blocks(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`...experts.w1.{b}` blocks -> one `...experts.w1` tensor of all E experts (blocks concatenated on dim 0)."""
    out: dict[str, torch.Tensor] = {}
    blocks: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in state.items():
        parsed = parse_expert_block(key)
        if parsed is None:
            out[key] = value
        else:
            blocks.setdefault(f"{parsed.prefix}.{parsed.kind}", {})[parsed.block] = value
    for key, parts in blocks.items():
        if sorted(parts) != list(range(len(parts))):
            raise ValueError(f"expert blocks of '{key}' are not numbered 0..{len(parts) - 1}: found {sorted(parts)}")
        out[key] = torch.cat([parts[b] for b in range(len(parts))], dim=0)
    return out


def split_expert_blocks(state: Mapping[str, torch.Tensor], block_size: int) -> dict[str, torch.Tensor]:
    """Inverse of `fuse_expert_blocks`: `...experts.w1` (E, ...) -> blocks `...experts.w1.{b}` of `block_size`."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if _FUSED_EXPERTS_RE.match(key) is None:
            out[key] = value
            continue
        for b, part in enumerate(torch.split(value, block_size, dim=0)):
            out[f"{key}.{b}"] = part.clone()
    return out


@dataclass
class MoEAux:
    """Per-layer auxiliary terms, summed over layers by the model."""

    lb_loss: torch.Tensor  # scalar, already weighted and divided by the number of layers
    z_loss: torch.Tensor  # scalar, already weighted (summed over layers as is, as in the reference)
    tokens_per_expert: torch.Tensor  # (E,) int64


def decayed_lb_factor(step: int, max_steps: int, update_steps: int) -> float:
    """SPES decayed load-balancing factor for the node's own experts.

    As in the reference: 1.0 until the first step that is a positive multiple of `update_steps`; from
    then on it is set at those steps only (constant in between), rising linearly from 0.7 to 1.0 over
    the first 20% of `max_steps` and staying at 1.0 after:
        s = update_steps * floor(step / update_steps)
        factor = 1.0 if s == 0 else 0.7 + 0.3 * min(s / (0.2 * max_steps), 1)
    """
    refreshed = (step // update_steps) * update_steps
    if refreshed == 0:
        return 1.0
    ramp = max(0.2 * max_steps, 1e-12)
    return 0.7 + 0.3 * min(refreshed / ramp, 1.0)


def load_balancing_loss(
    probs_TE: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    *,
    top_k: int,
    weight: float,
    num_layers: int,
    count_scale_E: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch/MegaBlocks load-balancing loss of one layer.

        E * w / (L * T * K) * sum_e tokens_per_expert_e * mean_t(probs_te)

    `count_scale_E` multiplies the token counts (the SPES decayed factor on the node's own experts).
    """
    num_tokens, num_experts = probs_TE.shape
    counts = tokens_per_expert_E.to(probs_TE.dtype)
    if count_scale_E is not None:
        counts = counts * count_scale_E
    scale = num_experts * weight / (num_layers * num_tokens * top_k)
    return scale * torch.dot(counts, probs_TE.mean(dim=0))


def router_z_loss(logits_TE: torch.Tensor, *, weight: float) -> torch.Tensor:
    """ST-MoE router z-loss of one layer: w * mean_t(logsumexp(logits_t)^2).

    NOTE: not divided by the number of layers: the reference (MegaBlocks) returns this per layer and its
    trainer sums the layers' terms, so the model-level z-loss is L times one layer's.
    """
    return weight * torch.logsumexp(logits_TE, dim=-1).square().mean()


class ExpertBlocks(nn.Module):
    """E SwiGLU experts stored as ceil(E / N) blocks; only `trainable_block` (or all, if None) is trained.

    `frozen_dtype` holds the frozen blocks in that dtype (bf16 under amp_bf16: the dtype autocast computes them
    in, so the same values at half the memory and no cast per micro-batch of weights that never change).
    """

    def __init__(
        self,
        *,
        num_experts: int,
        block_size: int,
        d_model: int,
        hidden: int,
        trainable_block: int | None,
        backend: MoEBackend = "auto",
        frozen_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.block_size, self.backend = num_experts, block_size, backend
        self.bounds = [(lo, min(lo + block_size, num_experts)) for lo in range(0, num_experts, block_size)]
        self.trainable_block = trainable_block
        self._resolved: MoEBackend | None = None

        def block(shape: tuple[int, int], b: int, n: int) -> nn.Parameter:
            trainable = trainable_block is None or trainable_block == b
            dtype = None if trainable else frozen_dtype
            return nn.Parameter(torch.empty(n, *shape, dtype=dtype), requires_grad=trainable)

        sizes = [hi - lo for lo, hi in self.bounds]
        self.w1 = nn.ParameterList([block((d_model, hidden), b, n) for b, n in enumerate(sizes)])
        self.v1 = nn.ParameterList([block((d_model, hidden), b, n) for b, n in enumerate(sizes)])
        self.w2 = nn.ParameterList([block((hidden, d_model), b, n) for b, n in enumerate(sizes)])
        if backend == "megablocks":
            _require_grouped_gemm()

    @property
    def own_bounds(self) -> tuple[int, int]:
        """Experts [lo, hi) of the trained block (all for a full model, none for a peer past the last block)."""
        if self.trainable_block is None:
            return 0, self.num_experts
        if self.trainable_block >= len(self.bounds):
            return 0, 0
        return self.bounds[self.trainable_block]

    def resolved_backend(self, device: torch.device) -> MoEBackend:
        """The backend this module computes with on `device` (`auto`: grouped_mm on a CUDA GPU of compute
        capability 8.0 or newer, the per-expert loop elsewhere); decided once."""
        if self._resolved is None:
            self._resolved = resolve_backend(self.backend, device)
        return self._resolved

    def dispatch_keys(self, expert_A: torch.Tensor, backend: MoEBackend) -> torch.Tensor:
        """Sort keys that put routed copies in the order `forward` takes them: by expert, and for grouped_mm the
        trained block's experts first (its rows then start at row 0, which its weight gradient needs)."""
        lo, hi = self.own_bounds
        if backend != "grouped_mm" or lo == 0:
            return expert_A
        # NOTE: python ints, not a lookup tensor, so no host-to-device copy per call
        return torch.where(expert_A >= hi, expert_A, torch.where(expert_A >= lo, expert_A - lo, expert_A + hi - lo))

    def forward(self, x_AD: torch.Tensor, tokens_per_expert_E: torch.Tensor, backend: MoEBackend) -> torch.Tensor:
        """x_AD holds the routed token copies sorted by `dispatch_keys`; tokens_per_expert_E[e] go to expert e."""
        dtype = _compute_dtype(x_AD)
        if backend == "grouped_mm":
            return self._grouped_forward(x_AD.to(dtype), tokens_per_expert_E, dtype)
        counts = tokens_per_expert_E.tolist()  # NOTE: a host-device sync; the loop and gmm need host sizes
        outs = []
        start = 0
        for b, (lo, hi) in enumerate(self.bounds):
            n_tokens = sum(counts[lo:hi])
            if n_tokens == 0:
                if torch.is_grad_enabled() and self.w1[b].requires_grad:
                    outs.append(self._touch(b, x_AD))
                continue
            x_block = x_AD[start : start + n_tokens].to(dtype)
            outs.append(self._block_forward(b, x_block, counts[lo:hi], backend, dtype))
            start += n_tokens
        return torch.cat(outs) if outs else x_AD.new_zeros(x_AD.shape)

    def _touch(self, b: int, x_AD: torch.Tensor) -> torch.Tensor:
        """An empty (0, D) output that still depends on trainable block `b` (which got no tokens).

        NOTE: DDP requires every trainable parameter to take part in each backward; an empty matmul gives
        the block an all-zero gradient at no cost, instead of a DDP error on the next step.
        """
        x0 = x_AD[:0]
        return (F.silu(x0 @ self.w1[b][0].to(x0.dtype)) * (x0 @ self.v1[b][0].to(x0.dtype))) @ self.w2[b][0].to(
            x0.dtype
        )

    def _block_forward(
        self, b: int, x: torch.Tensor, counts: list[int], backend: MoEBackend, dtype: torch.dtype
    ) -> torch.Tensor:
        w1, v1, w2 = self.w1[b].to(dtype), self.v1[b].to(dtype), self.w2[b].to(dtype)
        if backend == "torch":
            outs, start = [], 0
            for i, n in enumerate(counts):
                if n:
                    xi = x[start : start + n]
                    outs.append((F.silu(xi @ w1[i]) * (xi @ v1[i])) @ w2[i])
                    start += n
            return torch.cat(outs)
        from grouped_gemm import ops  # megablocks' grouped GEMM kernel; checked at construction

        sizes = torch.tensor(counts, dtype=torch.long)
        h = F.silu(ops.gmm(x, w1, sizes)) * ops.gmm(x, v1, sizes)
        return ops.gmm(h, w2, sizes)

    def _grouped_forward(
        self, x_AD: torch.Tensor, tokens_per_expert_E: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """All experts in three grouped GEMMs over every routed copy, with group sizes kept on the device (no
        host-device sync); the trained block's experts come first, and only they get weight gradients."""
        lo, hi = self.own_bounds
        counts_G = torch.cat([tokens_per_expert_E[lo:hi], tokens_per_expert_E[:lo], tokens_per_expert_E[hi:]])
        offs_G = counts_G.cumsum(0).to(torch.int32)
        h = F.silu(self._grouped(x_AD, self.w1, offs_G, dtype)) * self._grouped(x_AD, self.v1, offs_G, dtype)
        return self._grouped(h, self.w2, offs_G, dtype)

    def _grouped(
        self, x_AD: torch.Tensor, blocks: nn.ParameterList, offs_G: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """x_AD @ each expert's weights over its rows, the trained block's experts first (see `dispatch_keys`)."""
        lo, hi = self.own_bounds
        trained = [p.to(dtype) for (b_lo, _), p in zip(self.bounds, blocks) if lo <= b_lo < hi]
        frozen = [p.detach().to(dtype) for (b_lo, _), p in zip(self.bounds, blocks) if not lo <= b_lo < hi]
        if not trained:
            return F.grouped_mm(x_AD, torch.cat(frozen), offs=offs_G)
        w_trained = torch.cat(trained) if len(trained) > 1 else trained[0]
        return _TrainedFirstGroupedMM.apply(x_AD, w_trained, frozen, offs_G)


class _TrainedFirstGroupedMM(torch.autograd.Function):
    """grouped_mm(x, cat(w_trained, *frozen)) whose backward computes weight gradients for `w_trained` only.

    torch's own grouped_mm backward would compute the gradient of every expert's weight, the frozen ones
    included, and throw it away: the work a SPES node is meant to skip. The trained experts' rows come first
    (`ExpertBlocks.dispatch_keys`), so their weight gradient is one grouped GEMM over the first groups of `offs`.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x_AD: torch.Tensor,
        w_trained_NDF: torch.Tensor,
        frozen: list[torch.Tensor],
        offs_G: torch.Tensor,
    ) -> torch.Tensor:
        # NOTE: the frozen blocks come as a list, concatenated here once with the trained ones (not first among
        # themselves: a copy of every frozen weight less per call)
        w_GDF = torch.cat([w_trained_NDF, *frozen]) if frozen else w_trained_NDF
        ctx.save_for_backward(x_AD, w_GDF, offs_G)
        ctx.num_trained = w_trained_NDF.shape[0]
        return F.grouped_mm(x_AD, w_GDF, offs=offs_G)

    @staticmethod
    def backward(ctx: Any, dy_AF: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_AD, w_GDF, offs_G = ctx.saved_tensors
        dy_AF = dy_AF.contiguous()  # NOTE: grouped_mm refuses stride-0 gradients (those of a .sum())
        dx = F.grouped_mm(dy_AF, w_GDF.transpose(-2, -1), offs=offs_G) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:  # rows past the trained experts' last offset are left out
            dw = F.grouped_mm(x_AD.transpose(0, 1), dy_AF, offs=offs_G[: ctx.num_trained])
        return dx, dw, None, None


def resolve_backend(backend: MoEBackend, device: torch.device) -> MoEBackend:
    """`auto`: grouped_mm on a CUDA GPU of compute capability 8.0 or newer (1.25-2.2x the per-expert loop on an
    H200, docs/benchmarks.md), the per-expert loop elsewhere (no faster on a CPU); any other backend as named."""
    if backend != "auto":
        return backend
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
        return "grouped_mm"
    return "torch"


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast computes in here, else x's own.

    NOTE: autocast does not cover grouped_mm / gmm, which take bf16 on CUDA: the experts cast to it themselves.
    """
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


def _require_grouped_gemm() -> None:
    try:
        import grouped_gemm  # noqa: F401
        import megablocks  # noqa: F401
    except ImportError:
        raise ValueError(
            "config key 'model.moe_backend' = 'megablocks' needs the megablocks and grouped_gemm packages, which "
            "build only on CUDA machines (`pip install megablocks`); use moe_backend: torch or grouped_mm here"
        ) from None


class MoE(nn.Module):
    """Router + dropless top-k dispatch over `ExpertBlocks`."""

    def __init__(
        self,
        *,
        d_model: int,
        hidden: int,
        num_experts: int,
        top_k: int,
        block_size: int,
        trainable_block: int | None,
        num_layers: int,
        lb_weight: float,
        z_weight: float,
        normalize_p: float | None,
        backend: MoEBackend = "auto",
        frozen_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.num_layers = num_experts, top_k, num_layers
        self.lb_weight, self.z_weight, self.normalize_p = lb_weight, z_weight, normalize_p
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = ExpertBlocks(
            num_experts=num_experts,
            block_size=block_size,
            d_model=d_model,
            hidden=hidden,
            trainable_block=trainable_block,
            backend=backend,
            frozen_dtype=frozen_dtype,
        )
        # NOTE: a plain attribute, not a buffer: it is a schedule value set by the trainer, not model state.
        self.own_count_scale: torch.Tensor | None = None

    def set_own_count_scale(self, factor: float) -> None:
        """Scale the load-balancing token counts of the trainable block's experts (SPES decayed aux loss)."""
        b = self.experts.trainable_block
        if b is None or b >= len(self.experts.bounds):
            return  # trains every expert, or (a peer past the last block) none
        lo, hi = self.experts.bounds[b]
        scale = torch.ones(self.num_experts, device=self.router.weight.device)
        scale[lo:hi] = factor
        self.own_count_scale = scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEAux]:
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        logits_TE = self.router(x_TD).float()
        probs_TE = logits_TE.softmax(dim=-1)
        topw_TK, topi_TK = probs_TE.topk(self.top_k, dim=-1)
        if self.normalize_p is not None:
            topw_TK = topw_TK / topw_TK.norm(p=self.normalize_p, dim=-1, keepdim=True)

        backend = self.experts.resolved_backend(x.device)
        flat_expert_A = topi_TK.reshape(-1)
        # NOTE: counted by comparison, not bincount, whose CUDA kernel reads the largest id back to the host
        experts_E = torch.arange(self.num_experts, device=x.device)
        tokens_per_expert_E = (flat_expert_A.unsqueeze(1) == experts_E).sum(0)
        order_A = torch.argsort(self.experts.dispatch_keys(flat_expert_A, backend), stable=True)
        token_A = order_A // self.top_k
        y_AD = self.experts(x_TD[token_A], tokens_per_expert_E, backend)
        y_AD = y_AD * topw_TK.reshape(-1)[order_A].unsqueeze(-1).to(y_AD.dtype)
        y_TD = torch.zeros_like(x_TD).index_add_(0, token_A, y_AD.to(x_TD.dtype))

        aux = MoEAux(
            lb_loss=load_balancing_loss(
                probs_TE,
                tokens_per_expert_E,
                top_k=self.top_k,
                weight=self.lb_weight,
                num_layers=self.num_layers,
                count_scale_E=self.own_count_scale,
            ),
            z_loss=router_z_loss(logits_TE, weight=self.z_weight),
            tokens_per_expert=tokens_per_expert_E,
        )
        return y_TD.reshape(shape), aux


def init_truncated_normal_(t: torch.Tensor, std: float, cutoff: float | None) -> None:
    """OLMo `init_fn: normal`: N(0, std^2), truncated at +-cutoff*std when a cutoff is given."""
    if cutoff is None:
        nn.init.normal_(t, mean=0.0, std=std)
    else:
        nn.init.trunc_normal_(t, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std)
