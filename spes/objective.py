"""What a node minimizes: next-token cross entropy (with OLMo's instance filter), the MoE's auxiliary losses and
the optional softmax z-loss, per micro-batch; and the validation loss. Pure functions of a model and a batch, so
the training loop (`spes.trainer`), the GPU check and the tests compute one objective."""

from __future__ import annotations

import torch
from torch import nn

from spes.config import InstanceFilterConfig, TrainConfig
from spes.data import repetitive_instances
from spes.head_loss import IGNORE_INDEX, logit_loss_sums
from spes.model import ModelOutput


def language_model_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy in fp32, summed over the kept labels and divided by all labels.

    NOTE: as in OLMo, ignored labels still count in the denominator, so a filtered window adds zero
    (and a micro-batch with every window filtered gives 0, not NaN).
    """
    total, _ = logit_loss_sums(logits_BSV.flatten(0, 1), labels_BS.flatten(), logit_z=False)
    return total / labels_BS.numel()


def validation_loss(model: nn.Module, batch_BS: torch.Tensor, fused_loss: bool | None) -> torch.Tensor:
    """`language_model_loss` of a validation batch; with `fused_loss` through the model's chunked head, so that a
    validation forward never holds the batch's logits either (8 sequences of the 1B config's 151,936-entry vocabulary:
    2.5 billion logits, in bf16 and upcast to fp32, more than a training micro-batch's peak with `fused_loss`)."""
    labels = batch_BS[:, 1:]
    _, ce_sum, _ = loss_sums(model, batch_BS, labels, fused_loss=fused_loss, logit_z_weight=None)
    return ce_sum / labels.numel()


def loss_sums(
    model: nn.Module,
    batch_BS: torch.Tensor,
    labels_BS: torch.Tensor,
    *,
    fused_loss: bool | None,
    logit_z_weight: float | None,
) -> tuple[torch.Tensor, torch.Tensor, ModelOutput]:
    """(CE sum + w * sum(logsumexp^2), CE sum, the model's output) over the kept labels, w the `logit_z_weight`
    (None: no z-loss); with `fused_loss` the model computes the sums itself, its head a chunk at a time."""
    if fused_loss:
        out = model(batch_BS[:, :-1], labels_BS, logit_z_weight=logit_z_weight)
        assert out.loss_sum is not None and out.ce_sum is not None
        return out.loss_sum, out.ce_sum, out
    out = model(batch_BS[:, :-1])
    assert out.logits is not None
    ce_sum, z_sum = logit_loss_sums(out.logits.flatten(0, 1), labels_BS.flatten(), logit_z=logit_z_weight is not None)
    return (ce_sum if logit_z_weight is None else ce_sum + logit_z_weight * z_sum), ce_sum, out


def next_token_labels(batch_BS: torch.Tensor, instance_filter: InstanceFilterConfig | None) -> torch.Tensor:
    """Next-token labels; windows caught by `data.instance_filter` are left out of the loss."""
    labels = batch_BS[:, 1:]
    if instance_filter is None:
        return labels
    drop_B = repetitive_instances(
        batch_BS,
        min_period=instance_filter.repetition_min_period,
        max_period=instance_filter.repetition_max_period,
        max_count=instance_filter.repetition_max_count,
    )
    return labels.masked_fill(drop_B.unsqueeze(1), IGNORE_INDEX)


def micro_batch_loss(
    model: nn.Module, batch_BS: torch.Tensor, cfg: TrainConfig
) -> tuple[torch.Tensor, torch.Tensor, ModelOutput]:
    """The loss to backpropagate (cross entropy, the MoE's auxiliary losses, the optional softmax z-loss), the
    cross entropy alone, and the model's output.

        loss = (CE sum + auxiliary_loss_multiplier * sum(logsumexp^2) [with the z-loss]) / labels + lb_loss + z_loss
    """
    labels = next_token_labels(batch_BS, cfg.data.instance_filter)
    logit_z_weight = cfg.auxiliary_loss_multiplier if cfg.softmax_auxiliary_loss else None
    loss_sum, ce_sum, out = loss_sums(model, batch_BS, labels, fused_loss=cfg.fused_loss, logit_z_weight=logit_z_weight)
    # NOTE: as in OLMo, the z-loss is summed over the kept labels' positions and divided by all positions
    loss = loss_sum / labels.numel() + out.lb_loss + out.z_loss
    return loss, ce_sum / labels.numel(), out
