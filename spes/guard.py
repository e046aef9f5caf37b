"""The non-finite guard: a NaN or inf loss, gradient norm or weight stops the run before it spreads.

A non-finite step must never reach the optimizer (it would poison every weight), a checkpoint (rotation would
then delete the last good one) or the parameter server. Every check is agreed on by all ranks of the node with
one all-reduce, so under DDP/FSDP no rank goes on alone while the others stop (and none waits forever in a
collective the others left).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from spes.distributed import DistInfo, all_ranks_ok, all_reduce_mean, is_dtensor


class NonFiniteError(RuntimeError):
    """Training produced (or was given) NaN/inf values; the message names the step or checkpoint and what to do."""


def all_finite(values: torch.Tensor, info: DistInfo) -> tuple[bool, list[float]]:
    """Whether every rank's `values` are finite, and their mean over ranks (one collective).

    NOTE: the mean of a set holding a NaN or an inf is not finite, so the flag needs no second reduce.
    """
    mean = all_reduce_mean(values.float(), info).tolist()
    return all(math.isfinite(v) for v in mean), mean


def first_nonfinite_parameter(model: nn.Module) -> str | None:
    """The name of this rank's first parameter (or local shard) holding NaN/inf, or None."""
    for name, p in model.named_parameters():
        local = p.to_local() if is_dtensor(p) else p
        if not bool(torch.isfinite(local.detach()).all()):
            return name
    return None


def check_weights_finite(model: nn.Module, what: str, fix: str) -> None:
    """Raise NonFiniteError on every rank if any rank holds a non-finite weight; `what` names the weights (e.g.
    "the checkpoint of step 80"), `fix` says what to do."""
    bad = first_nonfinite_parameter(model)
    if not all_ranks_ok(bad is None):
        where = f" ({bad})" if bad is not None else " (on another rank)"
        raise NonFiniteError(f"{what}: the model weights hold NaN/inf{where}; {fix}")


@dataclass
class NonFiniteSkips:
    """Steps whose loss or gradient norm is NaN/inf have their update dropped; more than `allowed` of them in a
    row stop the run, before anything non-finite reaches weights or disk."""

    allowed: int
    save_folder: str
    in_a_row: int = 0

    def check(self, step: int, loss: float, grad_norm: float, finite: bool) -> str | None:
        """Count optimizer step `step`: the warning to log when its update is skipped, None when it is finite
        (NonFiniteError past the allowance, naming what to do)."""
        if finite:
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        what = f"step {step}: loss {loss} / grad_norm {grad_norm} is not finite"
        if self.in_a_row > self.allowed:
            in_a_row = f" ({self.in_a_row} steps in a row)" if self.allowed else ""
            raise NonFiniteError(
                f"{what}{in_a_row}; stopped without applying it or saving (the newest checkpoint in "
                f"{self.save_folder} is untouched). Resume from an earlier checkpoint with a lower "
                f"optimizer.learning_rate or a max_grad_norm, or set skip_nonfinite_steps=N to skip up to N bad "
                f"steps in a row"
            )
        return f"warning: {what}; its update is skipped ({self.in_a_row} of at most {self.allowed} in a row)"
