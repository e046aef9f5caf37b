from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spes.config import InstanceFilterConfig, TrainConfig, load_config
from spes.head_loss import IGNORE_INDEX
from spes.model import Transformer
from spes.objective import language_model_loss, micro_batch_loss, next_token_labels, validation_loss

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def tiny_model_and_batch(*overrides: str) -> tuple[Transformer, torch.Tensor, TrainConfig]:
    """configs/tiny.yaml's model (with `overrides`) and three windows of it, the last one token repeated (the
    instance filter drops it)."""
    cfg = load_config(CONFIGS / "tiny.yaml", list(overrides))[0]
    model = Transformer.for_run(cfg)
    model.init_weights(0)
    batch = torch.randint(0, cfg.model.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
    batch[2] = 7
    return model, batch, cfg


def test_the_instance_filter_leaves_repetitive_windows_out_of_the_loss() -> None:
    batch = torch.stack([torch.arange(65) % 50 + 10, torch.full((65,), 7)])  # period 50 (kept), period 1 (dropped)
    labels = next_token_labels(batch, InstanceFilterConfig(repetition_max_count=32))
    assert torch.equal(labels[0], batch[0, 1:]) and bool((labels[1] == IGNORE_INDEX).all())
    assert torch.equal(next_token_labels(batch, None), batch[:, 1:])
    logits = torch.randn(2, 64, 4096)
    # OLMo's normalization: the dropped window still counts in the denominator
    want = torch.nn.functional.cross_entropy(logits[0], batch[0, 1:]) / 2
    torch.testing.assert_close(language_model_loss(logits, labels), want)
    assert language_model_loss(logits, torch.full((2, 64), IGNORE_INDEX)).item() == 0.0


def test_with_fused_loss_validation_asks_the_model_for_loss_sums_not_logits() -> None:
    """The same validation loss either way; with `fused_loss` the model gets the labels (its chunked head) and
    returns no logits."""
    model, batch, _ = tiny_model_and_batch()
    given_labels = []

    class Recording(nn.Module):
        def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: object) -> object:
            given_labels.append(labels is not None)
            return model(ids, labels, **kwargs)

    with torch.no_grad():
        fused, whole = (validation_loss(Recording(), batch, fused_loss) for fused_loss in (True, False))
    assert given_labels == [True, False]
    torch.testing.assert_close(fused, whole)


@pytest.mark.parametrize("fused_loss", [False, True])
def test_the_micro_batch_loss_is_olmos_sum_over_all_labels(fused_loss: bool) -> None:
    """loss = (CE sum + w * sum(logsumexp^2)) over the kept labels / all labels + the MoE's lb and router z-losses,
    with w = auxiliary_loss_multiplier under softmax_auxiliary_loss; the filtered window counts in the denominator
    only. Computed here by hand from the model's logits, the same with and without `fused_loss`."""
    w = 0.25
    model, batch, cfg = tiny_model_and_batch(
        f"--fused_loss={str(fused_loss).lower()}",
        "--softmax_auxiliary_loss=true",
        f"--auxiliary_loss_multiplier={w}",
        "--data.instance_filter.repetition_max_count=4",
    )
    with torch.no_grad():
        loss, ce, out = micro_batch_loss(model, batch, cfg)
        plain = model(batch[:, :-1])
    logits, labels = plain.logits.float(), batch[:2, 1:]  # the third window is filtered
    n = batch[:, 1:].numel()
    ce_sum = F.cross_entropy(logits[:2].flatten(0, 1), labels.flatten(), reduction="sum")
    z_sum = torch.logsumexp(logits[:2], dim=-1).square().sum()
    torch.testing.assert_close(ce, ce_sum / n)
    torch.testing.assert_close(loss, (ce_sum + w * z_sum) / n + plain.lb_loss + plain.z_loss)
    assert float(plain.lb_loss) > 0 and float(plain.z_loss) > 0 and float(z_sum) > 0
    assert (out.logits is None) == fused_loss


def test_without_the_softmax_z_loss_the_loss_is_the_cross_entropy_and_the_moe_losses() -> None:
    model, batch, cfg = tiny_model_and_batch("--softmax_auxiliary_loss=false", "--auxiliary_loss_multiplier=0.5")
    with torch.no_grad():
        loss, ce, out = micro_batch_loss(model, batch, cfg)
    torch.testing.assert_close(loss, ce + out.lb_loss + out.z_loss)
    want = F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten())  # type: ignore[union-attr]
    torch.testing.assert_close(ce, want)


@pytest.mark.parametrize("fused_loss", [False, True])
def test_the_validation_loss_is_the_mean_cross_entropy_of_every_label(fused_loss: bool) -> None:
    model, batch, _ = tiny_model_and_batch()
    with torch.no_grad():
        got = validation_loss(model, batch, fused_loss)
        logits = model(batch[:, :-1]).logits.float()
    torch.testing.assert_close(got, F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()))
