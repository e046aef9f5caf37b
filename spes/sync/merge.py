"""The pure math of one SPES synchronization round (arXiv 2602.11543, Sec. 3).

Everything here is a function of tensors and numbers, with no I/O, so the round can be
tested without sockets and the server only moves bytes and calls `build_global`.

Naming (fixed by the model): experts of MoE layer `l` live in ownership blocks
`{prefix}.{kind}.{b}` with prefix `blocks.{l}.ffn.experts`, kind in `w1` (gate,
`(n_b, D, F)`), `v1` (up, `(n_b, D, F)`), `w2` (down, `(n_b, F, D)`); block `b` holds
experts `[b*k, min((b+1)*k, E))` and is owned (trained) by peer `spec.block_owners[b]` in SPES mode
(`spes.sync.spec.RunSpec.owner`; the paper's layout: peer b). Every other tensor is *shared*: trained by every
peer and averaged. The settings are the run's `server:` section (`spes.config.ServerSection`).

Shape legend: E experts in a layer, D d_model, F expert width, P peers, K top-k donors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import torch

from spes.config import ServerSection
from spes.moe import EXPERT_KINDS, parse_expert_block
from spes.sync.protocol import Mode, Shape, Tensors
from spes.sync.spec import RunSpec


def round_alpha(step: int, mode: Mode, server: ServerSection) -> float:
    """The expert-merging warm-up strength applied in round `step` (the paper's Sec. 3.3 schedule):

        alpha(step) = merge_alpha_start * (1 - min(step / merge_decay_steps, 1))

    on merge rounds (SPES mode, `merge_interval` > 0 and step % merge_interval == 0), else 0: in DiLoCo mode and
    from `merge_decay_steps` on. A round merges exactly when this is > 0.
    """
    if mode != "spes" or server.merge_interval <= 0 or step % server.merge_interval:
        return 0.0
    return server.merge_alpha_start * (1.0 - min(step / server.merge_decay_steps, 1.0))


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


def mean_over_peers(
    tensors: list[torch.Tensor], *, reuse_first: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
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


@dataclass(frozen=True)
class GlobalRound:
    """What `build_global` made of one round."""

    tensors: Tensors
    """The global model, in the order of the names it was built for."""
    momentum: Tensors
    """The DiLoCo outer momentum after the round (empty unless the outer optimizer is Nesterov)."""
    alpha: float
    """The merge strength applied (`round_alpha`; 0: no merge)."""


def build_global(
    uploads: Mapping[int, Mapping[str, torch.Tensor]],
    *,
    spec: RunSpec,
    step: int,
    names: list[str] | None = None,
    previous: Mapping[str, torch.Tensor] | None = None,
    momentum: Mapping[str, torch.Tensor] | None = None,
    consume: bool = False,
    empty: Callable[[Shape, torch.dtype], torch.Tensor] | None = None,
    mergeable: Collection[str] | None = None,
) -> GlobalRound:
    """Round `step`'s global model from the uploads of the peers that arrived (peer -> name -> tensor).

    SPES: expert block b is taken verbatim from its owner (`spec.owner`; the very tensor, in the dtype it was
    uploaded in: widening a bf16 upload would only be undone to send it back), or, when the owner did not arrive (a
    quorum round), from `previous`, the last global model; every shared tensor is the fp32 mean over the arrived
    peers, summed in peer order so the result is reproducible; on merge rounds (`round_alpha` > 0) each layer's
    experts are then merged with `merge_experts` (fp32 results). DiLoCo: every tensor is the mean, followed by
    the outer Nesterov step (`outer_nesterov_step`) when `server.outer_optimizer` asks for it and a previous
    global value of the tensor exists (its first round's mean is the starting point).

    `names` (default: every uploaded name, sorted) fixes the output order. With `consume`, `uploads` (then
    mutable) is emptied tensor by tensor and a mean is summed in place in the first peer's fp32 upload, so the
    server holds the remaining uploads, the previous global model and the growing new one, never more (one
    SPES layer's experts at a time, as the merge needs the whole layer); `empty(shape, dtype)` supplies the fp32
    tensor a mean of narrower (bf16) uploads is summed into (default: a new one). `mergeable` (default: all):
    the expert blocks a merge round may change (`spes.sync.fragments.Layout.merged_names`). Raises ValueError
    when an upload is missing or too large.
    """
    arrived = _arrived(uploads, spec)
    previous = previous or {}
    names = sorted({name for upload in uploads.values() for name in upload}) if names is None else names
    server, per_block = spec.server, spec.experts_per_block
    assert per_block is not None, "a round is built over a complete run spec"
    alpha = round_alpha(step, spec.mode, server)
    nesterov = spec.mode == "diloco" and server.outer_optimizer == "nesterov"

    def take(peer: int, name: str) -> torch.Tensor:
        return uploads[peer].pop(name) if consume else uploads[peer][name]  # type: ignore[attr-defined]

    new_global: Tensors = {}
    new_momentum: Tensors = {}
    layers: dict[str, dict[str, dict[int, str]]] = {}
    for name in names:
        owner = spec.owner(name)
        if owner is None:
            new_global[name] = _shared_mean(name, arrived, uploads, take, consume=consume, empty=empty)
            if nesterov and name in previous:  # NOTE: a tensor's first round (of its fragment) is its starting point
                new_global[name], new_momentum[name] = _outer_step(
                    name, new_global[name], previous[name], momentum, server
                )
        else:
            new_global[name] = _owner_block(name, owner, uploads, previous, per_block, take)
            if mergeable is None or name in mergeable:
                _add_to_layer(layers, name)
    if alpha > 0:
        for prefix, kinds in layers.items():
            _merge_layer(new_global, prefix, kinds, alpha, server.merge_topk)
    return GlobalRound({name: new_global[name] for name in names}, new_momentum, alpha)


def _arrived(uploads: Mapping[int, object], spec: RunSpec) -> list[int]:
    """The peers whose uploads arrived, in order: at least one, each a peer of the run."""
    arrived = sorted(uploads)
    if not arrived or not set(arrived) <= set(range(spec.num_peers)):
        raise ValueError(f"build_global needs uploads of peers in 0..{spec.num_peers - 1}, got peers {arrived}")
    return arrived


def _shared_mean(
    name: str,
    arrived: list[int],
    uploads: Mapping[int, Mapping[str, torch.Tensor]],
    take: Callable[[int, str], torch.Tensor],
    *,
    consume: bool,
    empty: Callable[[Shape, torch.dtype], torch.Tensor] | None,
) -> torch.Tensor:
    """Shared tensor `name` of the round: mean_{p in arrived} upload_p[name] in fp32, summed in peer order
    (`mean_over_peers`; with `consume` in the first peer's fp32 upload, a bf16 mean in `empty`'s buffer)."""
    missing = [p for p in arrived if name not in uploads[p]]
    if missing:
        raise ValueError(f"tensor {name!r} is averaged over the arrived peers but peers {missing} did not upload it")
    tensors = [take(p, name) for p in arrived]
    out = None
    if empty is not None and tensors[0].dtype != torch.float32:  # a bf16 mean is summed in fp32
        out = empty(tuple(tensors[0].shape), torch.float32)
    return mean_over_peers(tensors, reuse_first=consume, out=out)


def _outer_step(
    name: str,
    mean: torch.Tensor,
    previous: torch.Tensor,
    momentum: Mapping[str, torch.Tensor] | None,
    server: ServerSection,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DiLoCo's outer Nesterov step (`outer_nesterov_step`) of one tensor from its previous global value and its
    momentum (none before its second round): (new global value, new momentum)."""
    buf = {name: momentum[name]} if momentum and name in momentum else {}
    new_global, new_buf = outer_nesterov_step(
        {name: previous}, {name: mean}, buf, lr=server.outer_lr, momentum=server.outer_momentum
    )
    return new_global[name], new_buf[name]


def _add_to_layer(layers: dict[str, dict[str, dict[int, str]]], name: str) -> None:
    """Note expert block `name` under its layer and kind (layer prefix -> kind -> block -> name) for the merge."""
    parsed = parse_expert_block(name)
    assert parsed is not None
    layers.setdefault(parsed.prefix, {}).setdefault(parsed.kind, {})[parsed.block] = name


def _owner_block(
    name: str,
    owner: int,
    uploads: Mapping[int, Mapping[str, torch.Tensor]],
    previous: Mapping[str, torch.Tensor],
    experts_per_block: int,
    take: Callable[[int, str], torch.Tensor],
) -> torch.Tensor:
    """Expert block `name` as its owner uploaded it, or its last global value when the owner did not arrive."""
    if owner in uploads and name in uploads[owner]:
        block = take(owner, name)
    elif owner not in uploads and name in previous:
        return previous[name]
    else:
        raise ValueError(f"expert block {name!r} has no upload from its owner, peer {owner}")
    if block.shape[0] > experts_per_block:
        raise ValueError(
            f"expert block {name!r} from peer {owner} holds {block.shape[0]} experts, more than the run's "
            f"num_train_experts_per_node={experts_per_block}"
        )
    return block


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
    w1, v1, w2 = (torch.cat([global_model[kinds[kind][b]] for b in blocks]) for kind in EXPERT_KINDS)
    for kind, merged in zip(EXPERT_KINDS, merge_experts(w1, v1, w2, alpha=alpha, topk=topk), strict=True):
        for b, part in zip(blocks, torch.split(merged, sizes), strict=True):
            global_model[kinds[kind][b]] = part
