"""Test-only instrumentation: the bytes of gradients a DDP or FSDP2 model hands to its reduction.

How the freezing of SPES experts is checked for real: a frozen expert must add nothing to the gradient
traffic. It routes FSDP2's reduce-scatter through a private FSDP class, which is why it lives in tests/.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class GradCommMeter:
    """Counts the bytes of gradients handed to the all-reduce (DDP) or reduce-scatter (FSDP2) per call."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0

    def record(self, t: torch.Tensor) -> None:
        self.bytes += t.numel() * t.element_size()
        self.calls += 1

    def reset(self) -> None:
        self.bytes = self.calls = 0


def attach_grad_comm_meter(model: nn.Module) -> GradCommMeter:
    """Route the model's gradient reduction through a `GradCommMeter` (before the first forward).

    DDP: a comm hook sees each gradient bucket and then all-reduces it as DDP would. FSDP2: a custom
    reduce-scatter sees the flat gradient input of each sharded unit and then reduce-scatters it.
    """
    meter = GradCommMeter()
    if hasattr(model, "register_comm_hook"):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(_state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            meter.record(bucket.buffer())
            return allreduce_hook(None, bucket)  # type: ignore[arg-type]

        # NOTE: DDP compares these annotations with the real classes; this module's are strings.
        hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
        model.register_comm_hook(None, hook)
        return meter
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class MeteredReduceScatter(ReduceScatter):
        def allocate(self, size: list[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            op: object,
            async_op: bool = False,
        ) -> dist.Work | None:
            meter.record(input_tensor)
            return dist.reduce_scatter_tensor(
                output_tensor,
                input_tensor,
                op=op,
                group=group,  # type: ignore[arg-type]
                async_op=async_op,
            )

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(MeteredReduceScatter())
    return meter
