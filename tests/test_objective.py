from __future__ import annotations

import torch

from spes.config import InstanceFilterConfig
from spes.head_loss import IGNORE_INDEX
from spes.objective import language_model_loss, next_token_labels


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
