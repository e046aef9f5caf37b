from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from spes.config import InstanceFilterConfig, load_config
from spes.head_loss import IGNORE_INDEX
from spes.model import Transformer
from spes.objective import language_model_loss, next_token_labels, validation_loss

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


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
    cfg = load_config(CONFIGS / "tiny.yaml", [])[0]
    model = Transformer.for_run(cfg)
    model.init_weights(0)
    batch = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    given_labels = []

    class Recording(nn.Module):
        def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: object) -> object:
            given_labels.append(labels is not None)
            return model(ids, labels, **kwargs)

    with torch.no_grad():
        fused, whole = (validation_loss(Recording(), batch, fused_loss) for fused_loss in (True, False))
    assert given_labels == [True, False]
    torch.testing.assert_close(fused, whole)
