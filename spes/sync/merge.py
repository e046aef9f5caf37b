"""The pure math of one SPES synchronization round (arXiv 2602.11543, Sec. 3).

Everything here is a function of tensors and numbers, with no I/O, so the round can be
tested without sockets and the server only moves bytes and calls `aggregate_round`.

Naming (fixed by the model): experts of MoE layer `l` live in ownership blocks
`{prefix}.{kind}.{b}` with prefix `blocks.{l}.ffn.experts`, kind in `w1` (gate,
`(n_b, D, F)`), `v1` (up, `(n_b, D, F)`), `w2` (down, `(n_b, F, D)`); block `b` holds
experts `[b*k, min((b+1)*k, E))` and is owned (trained) by peer `b` in SPES mode.
Every other tensor is *shared*: trained by every peer and averaged.

Shape legend: E experts in a layer, D d_model, F expert width, P peers, K top-k donors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from spes.moe import EXPERT_KINDS, parse_expert_block

Mode = Literal["spes", "diloco"]


def trainable_names(names: list[str], peer_id: int, mode: Mode) -> list[str]:
    """What a peer trains and uploads: SPES, shared tensors + its own blocks (b == peer_id); DiLoCo, everything."""
    if mode == "diloco":
        return list(names)
    return [n for n in names if (parsed := parse_expert_block(n)) is None or parsed.block == peer_id]


def download_names(names: list[str], peer_id: int, mode: Mode, merged: bool) -> list[str]:
    """What a peer needs back: SPES, shared tensors and others' blocks (its own too when the merge changed them)."""
    if mode == "diloco" or merged:
        return list(names)
    return [n for n in names if (parsed := parse_expert_block(n)) is None or parsed.block != peer_id]


@dataclass(frozen=True, kw_only=True)
class MergeConfig:
    """Expert-merging warm-up settings (the server's --merge_* flags)."""

    interval: int = 500
    """Merge on rounds whose step is a multiple of this; <= 0 disables merging."""
    alpha_start: float = 0.01
    """Merge strength at step 0, decayed linearly to 0 at `decay_steps`."""
    decay_steps: int = 10000
    """Step at which alpha reaches 0."""
    topk: int = 4
    """Number of most similar other experts each expert is pulled towards."""

    def __post_init__(self) -> None:
        if self.alpha_start < 0 or not math.isfinite(self.alpha_start):
            raise ValueError(f"merge alpha_start must be a finite number >= 0, got {self.alpha_start}")
        if self.decay_steps <= 0:
            raise ValueError(f"merge decay_steps must be > 0, got {self.decay_steps}")
        if self.topk < 1:
            raise ValueError(f"merge topk must be >= 1, got {self.topk}")


def merge_alpha(step: int, alpha_start: float, decay_steps: int) -> float:
    """alpha(step) = alpha_start * (1 - min(step / decay_steps, 1)): linear decay to 0."""
    return alpha_start * (1.0 - min(step / decay_steps, 1.0))


def is_merge_round(step: int, merge_interval: int, alpha_start: float, decay_steps: int) -> bool:
    """A merge round has step % merge_interval == 0 and alpha(step) > 0 (merge_interval <= 0: never)."""
    return merge_interval > 0 and step % merge_interval == 0 and merge_alpha(step, alpha_start, decay_steps) > 0


def round_alpha(step: int, merge: MergeConfig | None) -> float:
    """The alpha applied at `step`: alpha(step) on merge rounds, else 0."""
    if merge is None or not is_merge_round(step, merge.interval, merge.alpha_start, merge.decay_steps):
        return 0.0
    return merge_alpha(step, merge.alpha_start, merge.decay_steps)


def merge_experts(
    w1: torch.Tensor, v1: torch.Tensor, w2: torch.Tensor, alpha: float, topk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert-merging warm-up for one layer; experts stacked on dim 0 (w1/v1 `(E, D, F)`, w2 `(E, F, D)`).

    For each expert i, with sim(i, j) = cos(flat(w1_i), flat(w1_j)) over the others j != i
    and N_i its `topk` most similar others (topk clipped to E - 1, ties to the lower index):

        task_vector_i = mean_{j in N_i} (theta_j - theta_i)
        theta_i      <- theta_i + alpha * task_vector_i

    applied kind by kind (w1 with w1, v1 with v1, w2 with w2) and computed from the
    pre-merge values for every i. That is one mixing matrix per layer:
    theta_new = ((1 - alpha) I + alpha S) @ theta, with S_ij = 1/K for j in N_i.
    Returns new fp32 tensors; alpha == 0 (or E == 1) returns the inputs' values unchanged.
    """
    num_experts = w1.shape[0]
    if not (v1.shape[0] == w2.shape[0] == num_experts):
        raise ValueError(f"w1/v1/w2 disagree on the number of experts: {w1.shape[0]}, {v1.shape[0]}, {w2.shape[0]}")
    k = min(topk, num_experts - 1)
    if alpha == 0 or k < 1:
        f32 = torch.float32
        return w1.to(f32, copy=True), v1.to(f32, copy=True), w2.to(f32, copy=True)

    w1_flat_EX = w1.reshape(num_experts, -1).float()
    unit_EX = w1_flat_EX / w1_flat_EX.norm(dim=1, keepdim=True).clamp_min(1e-12)
    sim_EE = unit_EX @ unit_EX.T
    sim_EE.fill_diagonal_(-math.inf)  # an expert is never its own donor
    # NOTE: a stable sort makes the donor set deterministic when similarities tie.
    donors_EK = torch.sort(sim_EE, dim=1, descending=True, stable=True).indices[:, :k]

    mix_EE = torch.zeros(num_experts, num_experts)
    mix_EE.scatter_(1, donors_EK, alpha / k)
    mix_EE.diagonal().add_(1.0 - alpha)

    def apply(weight: torch.Tensor) -> torch.Tensor:
        return (mix_EE @ weight.reshape(num_experts, -1).float()).reshape(weight.shape)

    return apply(w1), apply(v1), apply(w2)


def mean_over_peers(tensors: list[torch.Tensor], *, reuse_first: bool = False,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Element-wise fp32 mean, summed in the given (fixed peer) order for reproducibility.

    With `reuse_first` the sum accumulates in `tensors[0]` when it is fp32 (a caller that owns it saves
    allocating and copying a whole tensor); otherwise in `out` when given (an fp32 tensor of the same shape,
    e.g. a buffer kept from an earlier round), else in a new tensor. The result is the same either way.
    """
    first = tensors[0]
    if reuse_first and first.dtype == torch.float32:
        total = first
    else:
        total = first.to(torch.float32, copy=True) if out is None else out.copy_(first)
    for tensor in tensors[1:]:
        if tensor.dtype == torch.float32:
            total.add_(tensor)
        else:
            _add_widened(total, tensor)
    return total.div_(len(tensors))


_WIDEN_ELEMS = 1 << 20


def _add_widened(total: torch.Tensor, tensor: torch.Tensor) -> None:
    """total += tensor for a narrower (bf16) `tensor`, widened exactly, 1M elements at a time.

    Why not `total.add_(tensor)`: torch's mixed-dtype add runs 5x slower than widening into a small
    scratch buffer (which stays in cache and needs no fresh memory) and adding fp32 to fp32; same result.
    """
    flat_total, flat = total.view(-1), tensor.reshape(-1)
    scratch = torch.empty(min(_WIDEN_ELEMS, flat.numel()), dtype=total.dtype)
    for start in range(0, flat.numel(), _WIDEN_ELEMS):
        part = flat[start : start + _WIDEN_ELEMS]
        flat_total[start : start + part.numel()].add_(scratch[: part.numel()].copy_(part))


def _check_uploads(uploads: Mapping[int, Mapping[str, torch.Tensor]], num_peers: int) -> None:
    if sorted(uploads) != list(range(num_peers)):
        raise ValueError(f"aggregate_round needs one upload per peer 0..{num_peers - 1}, got peers {sorted(uploads)}")


def _expert_layers(names: list[str]) -> dict[str, dict[str, dict[int, str]]]:
    """Group expert-block names as layers[prefix][kind][block] = name."""
    layers: dict[str, dict[str, dict[int, str]]] = {}
    for name in names:
        parsed = parse_expert_block(name)
        if parsed is not None:
            layers.setdefault(parsed.prefix, {}).setdefault(parsed.kind, {})[parsed.block] = name
    return layers


def _merge_layer(
    global_model: dict[str, torch.Tensor], prefix: str, kinds: dict[str, dict[int, str]], alpha: float, topk: int
) -> None:
    """Concatenate a layer's blocks into (E, ...), merge, and split back in place of the blocks."""
    if set(kinds) != set(EXPERT_KINDS):
        raise ValueError(f"merging {prefix!r} needs w1, v1 and w2 blocks, got kinds {sorted(kinds)}")
    blocks = sorted(kinds["w1"])
    for kind in EXPERT_KINDS:
        if sorted(kinds[kind]) != blocks:
            raise ValueError(f"{prefix!r}: kind {kind!r} has blocks {sorted(kinds[kind])} but w1 has {blocks}")
    sizes = [global_model[kinds["w1"][b]].shape[0] for b in blocks]
    stacked = [torch.cat([global_model[kinds[kind][b]] for b in blocks]) for kind in EXPERT_KINDS]
    for kind, merged in zip(EXPERT_KINDS, merge_experts(*stacked, alpha=alpha, topk=topk), strict=True):
        for b, part in zip(blocks, torch.split(merged, sizes), strict=True):
            global_model[kinds[kind][b]] = part


def aggregate_round(
    uploads: Mapping[int, Mapping[str, torch.Tensor]],
    *,
    num_peers: int,
    experts_per_peer: int,
    mode: Mode,
    step: int,
    merge: MergeConfig | None = None,
) -> dict[str, torch.Tensor]:
    """Build the global model of round `step` from every peer's upload.

    SPES: expert block b is taken verbatim from its owner, peer b (the very tensor, in the dtype it
    was uploaded in: widening a bf16 upload would only be undone to send it back); every shared tensor
    is the fp32 mean over peers; on merge rounds (see `round_alpha`) each layer's experts are then
    merged with `merge_experts` (fp32 results). DiLoCo/FedAvg: every tensor is the mean over peers.
    """
    _check_uploads(uploads, num_peers)
    names = sorted({name for upload in uploads.values() for name in upload})
    global_model: dict[str, torch.Tensor] = {}
    for name in names:
        parsed = parse_expert_block(name) if mode == "spes" else None
        if parsed is not None:
            if parsed.block >= num_peers or name not in uploads[parsed.block]:
                raise ValueError(f"expert block {name!r} has no upload from its owner, peer {parsed.block}")
            block = uploads[parsed.block][name]
            if block.shape[0] > experts_per_peer:
                raise ValueError(
                    f"expert block {name!r} holds {block.shape[0]} experts, "
                    f"more than experts_per_peer={experts_per_peer}"
                )
            global_model[name] = block
        else:
            missing = [p for p in range(num_peers) if name not in uploads[p]]
            if missing:
                raise ValueError(f"tensor {name!r} is averaged over all peers but peers {missing} did not upload it")
            global_model[name] = mean_over_peers([uploads[p][name] for p in range(num_peers)])

    alpha = round_alpha(step, merge) if mode == "spes" else 0.0
    if alpha > 0:
        assert merge is not None
        for prefix, kinds in _expert_layers(names).items():
            _merge_layer(global_model, prefix, kinds, alpha, merge.topk)
    return global_model


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    """DiLoCo outer optimizer (server --outer_* flags); `none` is plain averaging."""

    optimizer: Literal["none", "nesterov"] = "none"
    """`none`: the global model is the mean; `nesterov`: Nesterov momentum SGD on the outer gradient."""
    lr: float = 0.7
    """Outer learning rate (the DiLoCo paper uses 0.7)."""
    momentum: float = 0.9
    """Outer Nesterov momentum (the DiLoCo paper uses 0.9)."""

    def __post_init__(self) -> None:
        if self.optimizer not in ("none", "nesterov"):
            raise ValueError(f"outer optimizer must be 'none' or 'nesterov', got {self.optimizer!r}")
        if self.lr <= 0 or not 0 <= self.momentum < 1:
            raise ValueError(f"outer lr must be > 0 and momentum in [0, 1), got lr={self.lr} momentum={self.momentum}")


def outer_nesterov_step(
    prev_global: Mapping[str, torch.Tensor],
    mean: Mapping[str, torch.Tensor],
    momentum_buf: Mapping[str, torch.Tensor],
    *,
    lr: float,
    momentum: float,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One DiLoCo outer step (Douillard et al. 2023), Nesterov momentum SGD as in torch.optim.SGD.

        g = prev_global - mean(uploads)         (outer gradient)
        m <- momentum * m + g                    (m starts at 0)
        new_global = prev_global - lr * (g + momentum * m)

    Returns (new_global, new_momentum_buf); the inputs are not modified.
    """
    new_global: dict[str, torch.Tensor] = {}
    new_buf: dict[str, torch.Tensor] = {}
    for name, avg in mean.items():
        prev = prev_global[name].float()
        grad = prev - avg.float()
        buf = grad.clone() if name not in momentum_buf else momentum_buf[name].float() * momentum + grad
        new_buf[name] = buf
        new_global[name] = prev - lr * (grad + momentum * buf)
    return new_global, new_buf
