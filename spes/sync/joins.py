"""Admission of a Join: the peer's protocol, run spec and model manifest against the run's, before anything is kept.

The manifest's tensor count is checked before anything else is read and its size (fp32) against `max_model_gb`
(None: unbounded, when the server knows the run's model), so no buffer is ever sized by a peer's numbers past
those bounds. Refusals name what differs, root causes first: the protocol, the spec's fields in the order of
`spes.sync.spec.FIELD_KEYS` (the mode, then the layout, the schedule, the codec), then the manifest. `check_run`
then keeps two runs apart: a node of another run (its checkpoint's run id) is refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import grpc

from spes.moe import parse_expert_block
from spes.sync.admission import MAX_MODEL_GB, MAX_TENSORS
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import PROTOCOL_VERSION, Manifest, Reason, Refused, Shape, version_refusal
from spes.sync.spec import RunSpec


def check_run(peer: int, theirs: str, run_id: str, completed_round: int | None) -> None:
    """A node of the run `run_id`, or a fresh node (`theirs` empty) while the run has no completed round; refuses any
    other (reason other_run), saying what to do: two runs are never mixed."""
    if theirs == run_id:
        return
    if not theirs and completed_round is None:
        return
    held = f"run {run_id}" + (f" at round {completed_round}" if completed_round is not None else " (no round yet)")
    if not theirs:
        raise Refused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"peer {peer} starts a fresh run, but this server holds {held}: to continue that run resume the node "
            f"from its checkpoint (--resume=auto), or join it afresh with spes_config.run_id={run_id}; for a "
            "new run start the server with a fresh --state_dir",
            Reason.OTHER_RUN,
        )
    raise Refused(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"peer {peer} belongs to run {theirs} (its checkpoint or spes_config.run_id), but this server holds "
        f"{held}: restart the server with that run's --state_dir, or start the node fresh (without --resume) "
        "for this one",
        Reason.OTHER_RUN,
    )


def check_join(
    request: pb.JoinRequest, run: RunSpec, *, max_tensors: int = MAX_TENSORS, max_model_gb: float = MAX_MODEL_GB
) -> RunSpec:
    """The peer's run spec (with its manifest) when the Join fits the run `run`; raises Refused saying what differs."""
    peer = request.peer_id
    if len(request.manifest) > max_tensors:
        raise Refused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"peer {peer}'s manifest names {len(request.manifest)} tensors, more than --max_tensors={max_tensors}",
        )
    if request.protocol != PROTOCOL_VERSION:
        raise version_refusal(f"peer {peer}", request.protocol)
    if not 0 <= peer < run.num_peers:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"peer_id {peer} is outside [0, {run.num_peers}) for this run")
    shapes = {spec.name: tuple(int(d) for d in spec.shape) for spec in request.manifest}
    if len(shapes) != len(request.manifest):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"peer {peer}: the manifest names a tensor twice")
    try:
        theirs = RunSpec.from_proto(request.spec, shapes, origin=f"peer {peer}'s config")
    except ValueError as exc:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"peer {peer}'s run spec is not valid: {exc}") from None
    difference = run.differences(theirs, f"peer {peer}")
    if difference:
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, difference)
    try:
        check_manifest(shapes, theirs)
        theirs.layout  # noqa: B018 (cuts the model into its fragments: ValueError when it cannot be)
    except ValueError as exc:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"peer {peer}: {exc}") from None
    # NOTE: an int, compared exactly: a float of the dims a peer may send (17 of 2^62) overflows
    num_bytes = 4 * sum(math.prod(shape) for shape in shapes.values())
    if run.manifest is None and num_bytes > max_model_gb * 1e9:
        shown = f"{num_bytes / 1e9:.4g} GB" if num_bytes < 1 << 1000 else f"over 2^{num_bytes.bit_length() - 1} bytes"
        raise Refused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"peer {peer}'s manifest declares a model of {shown} in fp32, more than "
            f"--max_model_gb={max_model_gb:g} (start the server with the run's YAML, or raise the limit)",
        )
    if run.manifest is not None:
        diff = manifest_differences(run.manifest, shapes)
        if diff:
            where = f" ({run.origin})" if run.origin else ""
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT, f"peer {peer}'s model differs from the run's{where}: {diff}"
            )
    return theirs


def check_manifest(shapes: Mapping[str, Shape], spec: RunSpec) -> None:
    """Validate a model manifest's expert blocks against the run's ownership (ValueError)."""
    if not shapes:
        raise ValueError("the manifest is empty: send the name and shape of every tensor of the model")
    assert spec.experts_per_block is not None, "a peer's spec is complete"
    for name, shape in shapes.items():
        if any(d < 0 for d in shape):
            raise ValueError(f"tensor {name!r} has a negative dimension in shape {list(shape)}")
        if parse_expert_block(name) is None:
            continue
        if not shape or shape[0] > spec.experts_per_block:
            raise ValueError(
                f"expert block {name!r} has shape {list(shape)}: dim 0 must hold "
                f"<= num_train_experts_per_node={spec.experts_per_block} experts"
            )
        spec.owner(name)  # ValueError for a block no peer owns


def manifest_differences(known: Manifest, given: Manifest) -> str:
    """A human-readable list of how `given` differs from `known` ('' when equal)."""
    problems = []
    missing = sorted(set(known) - set(given))
    extra = sorted(set(given) - set(known))
    reshaped = sorted(n for n in set(known) & set(given) if tuple(known[n]) != tuple(given[n]))
    if missing:
        problems.append(f"missing {describe_names(missing)}")
    if extra:
        problems.append(f"unknown {describe_names(extra)}")
    problems.extend(f"{n!r} has shape {list(given[n])}, the run's is {list(known[n])}" for n in reshaped[:5])
    return "; ".join(problems)


def describe_names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
