"""The LM head's loss: next-token cross entropy and the output z-loss of logits, whole or (`fused_loss`) with the head
applied a chunk of tokens at a time, its gradient computed in the same pass.

Why chunks: the whole batch's logits, upcast to fp32 for the loss, with what autograd keeps of them for backward,
are most of a node's activation memory at a large vocabulary (the 1B config's 151,936 entries: ~7 fp32 copies,
4.3 MB per token); chunked, only one chunk's exist at a time. Why the gradient in the forward: the loss is the last
thing a step computes, so each chunk's gradient can be taken while its logits exist, and no backward has to compute
the head's logits a second time (2 D V FLOPs a token).

Shape legend: N tokens, T a chunk's tokens, D d_model, V embedding rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion

IGNORE_INDEX = -100  # a label left out of the loss (a window dropped by data.instance_filter)
LOSS_CHUNK_ELEMENTS = 1 << 26
"""Logits computed at once by `head_loss_sums`: 256 MiB per fp32 copy, whatever the vocabulary."""

ChunkSums = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float | None], tuple[torch.Tensor, torch.Tensor]]
ChunkGrads = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]


def logit_loss_sums(
    logits_NV: torch.Tensor, labels_N: torch.Tensor, *, logit_z: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """In fp32, sums over the kept labels of the next-token cross entropy and (with `logit_z`, else 0) of
    logsumexp(logits)^2, the output z-loss; callers divide by all labels, kept or not (OLMo's normalization)."""
    logits = logits_NV.float()
    ce = F.cross_entropy(logits, labels_N, ignore_index=IGNORE_INDEX, reduction="sum")
    if not logit_z:
        return ce, ce.new_zeros(())
    return ce, (torch.logsumexp(logits, dim=-1).square() * (labels_N != IGNORE_INDEX)).sum()


def chunk_loss_sums(
    h_TD: torch.Tensor, weight_VD: torch.Tensor, labels_T: torch.Tensor, logit_z_weight: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logit_loss_sums` of one chunk of tokens, the LM head applied here (the z-loss sum with a `logit_z_weight`)."""
    return logit_loss_sums(F.linear(h_TD, weight_VD), labels_T, logit_z=logit_z_weight is not None)


def chunk_loss_grads(
    h_TD: torch.Tensor, weight_VD: torch.Tensor, labels_T: torch.Tensor, logit_z_weight: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunk_loss_sums` and, in the logits' dtype, the gradient of ce + w z (w: `logit_z_weight`, None for no z-loss)
    with respect to the chunk's logits:

        lse = logsumexp(logits),  p = softmax(logits) = exp(logits - lse)
        ce = sum_kept (lse - logits[label]),  z = sum_kept lse^2
        d(ce + w z) / d logits = kept * (p (1 + 2 w lse) - onehot(label))

    computed in fp32, as autograd computes the gradient of `logit_loss_sums`' fp32 upcast.
    """
    logits = F.linear(h_TD, weight_VD)
    x_TV = logits.float()
    lse_T1 = torch.logsumexp(x_TV, dim=-1, keepdim=True)
    kept_T1 = (labels_T != IGNORE_INDEX).unsqueeze(1)
    label_T1 = labels_T.clamp_min(0).unsqueeze(1)  # an ignored label points anywhere: `kept` zeroes its terms
    target_T1 = x_TV.gather(1, label_T1)
    ce = ((lse_T1 - target_T1) * kept_T1).sum()
    z = (lse_T1.square() * kept_T1).sum() if logit_z_weight is not None else ce.new_zeros(())
    scale_T1 = kept_T1 * (1 + 2 * logit_z_weight * lse_T1) if logit_z_weight else kept_T1.float()
    grad_TV = (x_TV - lse_T1).exp_().mul_(scale_T1).to(logits.dtype)
    # NOTE: the label's entry written after the cast, from its fp32 value (rounded once, as the rest): compiled, the
    # pass over the logits then writes the low-precision gradient directly, and only T entries are written again
    at_label_T1 = (target_T1 - lse_T1).exp_().mul_(scale_T1).sub_(kept_T1.float())
    return ce, z, grad_TV.scatter_(1, label_T1, at_label_T1.to(grad_TV.dtype))


@dataclass(frozen=True)
class ChunkFns:
    """A chunk's math for `head_loss_sums`: the sums alone (no gradient wanted) or with the logits' gradient; under
    `compile` each is compiled (one or two passes over the chunk's bf16 logits, no fp32 copy of them in memory)."""

    sums: ChunkSums = chunk_loss_sums
    grads: ChunkGrads = chunk_loss_grads

    def compiled(self, **kwargs: Any) -> ChunkFns:
        return ChunkFns(torch.compile(self.sums, **kwargs), torch.compile(self.grads, **kwargs))


def head_loss_sums(
    h_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_N: torch.Tensor,
    *,
    logit_z_weight: float | None,
    chunk_fns: ChunkFns | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ce + w z, ce, z): over the kept labels, the sums of the cross entropy and (given a weight w, `logit_z_weight`)
    of logsumexp(logits)^2, the LM head applied `LOSS_CHUNK_ELEMENTS` logits' worth of tokens at a time (`fused_loss`).

    Only the first is differentiable: when a gradient is wanted, each chunk's gradient with respect to `h_ND` and
    `weight_VD` is computed with its loss, and backward scales them. Equal to the whole logits' loss up to the order
    of the sums; the weight's gradient is summed over the chunks in fp32 (`_add_product`).
    """
    chunk_fns = chunk_fns or ChunkFns()
    wanted = torch.is_grad_enabled() and (h_ND.requires_grad or weight_VD.requires_grad)
    if wanted:
        return _HeadLoss.apply(h_ND, weight_VD, labels_N, logit_z_weight, chunk_fns.grads)
    ce = z = h_ND.new_zeros((), dtype=torch.float32)
    weight = _compute_weight(weight_VD)
    for h, labels in _chunks(h_ND, labels_N, weight_VD.shape[0]):
        ce_c, z_c = chunk_fns.sums(h, weight, labels, logit_z_weight)
        ce, z = ce + ce_c, z + z_c
    return ce + (logit_z_weight or 0.0) * z, ce, z


class _HeadLoss(torch.autograd.Function):
    """`head_loss_sums` when a gradient is wanted: the gradients are computed in the forward, a chunk at a time, with
    the weight cast to the autocast dtype once (not in every chunk: the 1B head's 151,936 x 768 weight cast per chunk
    was a tenth of a GPU step); the backward only scales them by the loss's gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        h_ND: torch.Tensor,
        weight_VD: torch.Tensor,
        labels_N: torch.Tensor,
        logit_z_weight: float | None,
        fn: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        weight = _compute_weight(weight_VD)
        grad_h = torch.empty_like(h_ND) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight_VD, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        ce = z = h_ND.new_zeros((), dtype=torch.float32)
        start = 0
        for h, labels in _chunks(h_ND, labels_N, weight_VD.shape[0]):
            ce_c, z_c, g_TV = fn(h, weight, labels, logit_z_weight)
            with torch.autocast(h_ND.device.type, enabled=False):  # NOTE: in the dtype the logits were computed in
                if grad_h is not None:
                    grad_h[start : start + len(h)] = g_TV @ weight
                if grad_w is not None:
                    _add_product(grad_w, g_TV.T, h.to(g_TV.dtype))
            ce, z, start = ce + ce_c, z + z_c, start + len(h)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight_VD.dtype
        ctx.mark_non_differentiable(ce, z)
        return ce + (logit_z_weight or 0.0) * z, ce, z

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        grad_h, grad_w = ctx.saved_tensors
        # NOTE: in place: the step's largest activation is alive now; a second backward through this graph is refused
        # by autograd (a saved tensor changed), not given scaled gradients twice
        grad_h = None if grad_h is None else grad_h.mul_(grad_loss)
        grad_w = None if grad_w is None else grad_w.mul_(grad_loss).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None


def _add_product(out_VD: torch.Tensor, a_VT: torch.Tensor, b_TD: torch.Tensor) -> None:
    """out += a @ b, the sum over the chunks of the weight's gradient. One GEMM accumulating into `out` when it has
    the operands' dtype, or on a CUDA GPU (sm80+) an fp32 `out` of bf16/fp16 operands (addmm's `out_dtype`, as
    liger-kernel accumulates its head's weight gradient): no weight-sized temporary and add per chunk, and each
    chunk's product is not rounded to bf16. Elsewhere through the product, rounded as autograd rounds the weight's
    gradient under autocast."""
    if a_VT.dtype == out_VD.dtype:
        out_VD.addmm_(a_VT, b_TD)
    elif _gemm_accumulates_fp32(out_VD, a_VT):
        torch.addmm(out_VD, a_VT, b_TD, out_dtype=torch.float32, out=out_VD)
    else:
        out_VD += a_VT @ b_TD


ADDMM_OUT_DTYPE = TorchVersion(torch.__version__) >= "2.8"
"""Whether this torch's `addmm` takes `out_dtype` (2.8 and later)."""


def _gemm_accumulates_fp32(out: torch.Tensor, operand: torch.Tensor) -> bool:
    """Whether cuBLAS can add a low-precision product into fp32 `out` itself (`torch.addmm(..., out_dtype=)`,
    torch 2.8 and later, CUDA compute capability 8.0 and later)."""
    return (
        ADDMM_OUT_DTYPE
        and out.is_cuda
        and out.dtype == torch.float32
        and operand.dtype in (torch.bfloat16, torch.float16)
        and torch.cuda.get_device_capability(out.device) >= (8, 0)
    )


def _compute_weight(weight_VD: torch.Tensor) -> torch.Tensor:
    """The head's weight in the dtype autocast computes the head in (itself when autocast is off)."""
    device = weight_VD.device.type
    return weight_VD.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else weight_VD


def _chunks(h_ND: torch.Tensor, labels_N: torch.Tensor, vocab: int) -> zip:
    """The tokens' hidden states and labels, `LOSS_CHUNK_ELEMENTS` logits' worth of tokens at a time."""
    chunk = max(1, LOSS_CHUNK_ELEMENTS // vocab)
    return zip(h_ND.split(chunk), labels_N.split(chunk))
