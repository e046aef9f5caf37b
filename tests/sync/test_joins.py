"""Admission of a Join (spes.sync.joins): protocol, spec and manifest against the run's, root causes first."""

from __future__ import annotations

import math
from dataclasses import replace

import grpc
import pytest

from spes.sync.joins import check_join, check_manifest, check_run, describe_names, manifest_differences
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import PROTOCOL_VERSION, Refused
from spes.sync.spec import RunSpec
from sync_helpers import tiny_manifest, tiny_spec

SPEC = tiny_spec()
MANIFEST = SPEC.manifest or {}


def join(peer: int, run: RunSpec = SPEC, **overrides: object) -> pb.JoinRequest:
    """Peer `peer`'s Join of the run `run`; `overrides`: JoinRequest fields."""
    fields: dict = {
        "peer_id": peer,
        "manifest": [pb.TensorSpec(name=n, shape=s) for n, s in (run.manifest or {}).items()],
        "protocol": PROTOCOL_VERSION,
        "spec": run.to_proto(),
    }
    fields.update(overrides)
    return pb.JoinRequest(**fields)


def test_a_join_of_the_runs_spec_is_admitted_with_its_manifest() -> None:
    theirs = check_join(join(1), SPEC)
    assert theirs == SPEC and theirs.manifest == MANIFEST and theirs.origin == "peer 1's config"
    assert "blocks.0.ffn.experts.w1.1" in theirs.trainable(1)


def test_a_server_without_the_runs_yaml_takes_the_manifest_and_sync_steps_of_the_first_join() -> None:
    open_spec = replace(SPEC, manifest=None, sync_steps=None)
    theirs = check_join(join(0, replace(SPEC, sync_steps=20)), open_spec)
    complete = open_spec.completed_by(theirs)
    assert complete.manifest == MANIFEST and complete.sync_steps == 20 and complete.complete
    with pytest.raises(Refused, match=r"manifest declares a model of .* GB in fp32, more than --max_model_gb=1e-09"):
        check_join(join(0), open_spec, max_model_gb=1e-9)


@pytest.mark.parametrize(
    "request_of, match, code",
    [
        (lambda: join(2), r"peer_id 2 is outside \[0, 2\)", grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: join(0, protocol=0), "speaks wire protocol v0 but this server speaks v6", None),
        (lambda: join(0, protocol=5), "speaks wire protocol v5 but this server speaks v6", None),  # no run spec
        (
            lambda: join(0, tiny_spec(mode="diloco")),
            r"peer 0 has mode = 'diloco' but the run has mode = 'spes'.*using_spes / using_dilico",
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        (
            lambda: join(0, tiny_spec(num_peers=3)),
            r"peer 0 has num_peers = 3 but the run has num_peers = 2: set spes_config.num_peers",
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        (
            lambda: join(0, tiny_spec(sync_steps=20)),
            "peer 0 has sync_steps = 20 but the run has sync_steps = 1",
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        (
            lambda: join(0, tiny_spec(codec="int8")),
            "peer 0 has codec = 'int8' but the run has codec = 'fp32': set spes_config.codec",
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        (
            lambda: join(0, manifest=[pb.TensorSpec(name="a", shape=[1])] * 2),
            "names a tensor twice",
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            lambda: join(
                0, spec=pb.RunSpec(mode="spes", num_peers=2, experts_per_block=2, overlap_fragments=1, codec="fp8")
            ),
            "peer 0's run spec is not valid: config key 'spes_config.codec' = 'fp8' is not a codec",
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ],
)
def test_a_join_that_differs_is_refused_naming_the_root_difference(
    request_of: object, match: str, code: grpc.StatusCode | None
) -> None:
    with pytest.raises(Refused, match=match) as err:
        check_join(request_of(), SPEC)  # type: ignore[operator]
    assert code is None or err.value.code == code


def test_the_mode_is_named_before_the_layout_it_implies() -> None:
    """A DiLoCo node against a SPES server differs in experts per block too; the mode is what the user set."""
    diloco = tiny_spec(mode="diloco", k=4)
    with pytest.raises(Refused, match="has mode = 'diloco'"):
        check_join(join(0, diloco), SPEC)


def test_a_model_that_differs_from_the_runs_is_refused_naming_the_tensors() -> None:
    other = tiny_spec(d=16)
    with pytest.raises(
        Refused,
        match=r"model differs from the run's: 'blocks.0.attn.qkv.weight' has shape \[48, 16\], the run's is \[24, 8\]",
    ):
        check_join(join(0, other), SPEC)


def test_manifest_checks() -> None:
    with pytest.raises(ValueError, match="has no owner: the run has 2 blocks"):
        check_manifest(tiny_manifest(num_blocks=3), SPEC)
    with pytest.raises(ValueError, match="<= num_train_experts_per_node=1"):
        check_manifest(MANIFEST, replace(SPEC, experts_per_block=1))
    check_manifest(tiny_manifest(num_blocks=1, k=4), tiny_spec(mode="diloco", num_peers=3, k=4))
    assert manifest_differences(MANIFEST, MANIFEST) == ""
    assert "missing 'lm_head.weight'" in manifest_differences(
        MANIFEST, {n: s for n, s in MANIFEST.items() if n != "lm_head.weight"}
    )


def test_a_manifest_is_bounded_in_tensors_before_anything_else_and_in_size_when_the_run_has_no_model() -> None:
    count = len(MANIFEST)
    check_join(join(1), SPEC, max_tensors=count)  # exactly the bound
    with pytest.raises(Refused) as err:
        check_join(join(1, protocol=0), SPEC, max_tensors=count - 1)  # before its protocol is even read
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(err.value) == f"peer 1's manifest names {count} tensors, more than --max_tensors={count - 1}"
    open_spec = replace(SPEC, manifest=None)
    size_gb = 4 * sum(math.prod(shape) for shape in MANIFEST.values()) / 1e9  # fp32
    check_join(join(0), open_spec, max_model_gb=size_gb)  # exactly the bound
    with pytest.raises(Refused) as err:
        check_join(join(0), open_spec, max_model_gb=size_gb * 0.999)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(err.value).startswith(f"peer 0's manifest declares a model of {size_gb:.4g} GB in fp32, more than ")


def sized(values: int) -> pb.JoinRequest:
    """Peer 0's Join with tensors added so that its manifest holds `values` values in all: the remainder past the
    run's own tensors in base-2^62 digits, one tensor each (a dim is an int64)."""
    request = join(0)
    rest = values - sum(math.prod(shape) for shape in MANIFEST.values())
    for power in range(rest.bit_length() // 62 + 1):
        digit = rest >> (62 * power) & (2**62 - 1)
        if digit:
            request.manifest.append(pb.TensorSpec(name=f"lm_head.pad{power}", shape=[digit] + [2**62] * power))
    return request


def test_the_size_bound_and_the_size_shown_hold_to_four_bytes_of_a_terabyte() -> None:
    """1000.5 GB and 4 bytes against --max_model_gb=1000.5: the bound is exact to the value (an int, no rounding),
    and the size shown is rounded from the exact GB (1000.5 would show as 1000)."""
    open_spec = replace(SPEC, manifest=None)
    request = sized(250_125_000_001)
    with pytest.raises(Refused) as err:
        check_join(request, open_spec, max_model_gb=1000.5)
    assert str(err.value) == (
        "peer 0's manifest declares a model of 1001 GB in fp32, more than --max_model_gb=1000.5 (start the server "
        "with the run's YAML, or raise the limit)"
    )
    check_join(request, open_spec, max_model_gb=1000.500000004)  # exactly its size: admitted


@pytest.mark.parametrize(
    "values, shown",
    [
        (2**998 - 1, "1.072e+292 GB"),  # 4 bytes short of 2^1000: still a float
        (2**998, "over 2^1000 bytes"),
        (2**1001 - 1, "over 2^1002 bytes"),
        (2**1054, "over 2^1056 bytes"),  # seventeen dims of 2^62: past a float's range
    ],
    ids=["2^1000 less 4 bytes", "2^1000 bytes", "2^1003 less 4 bytes", "2^1056 bytes"],
)
def test_a_model_too_large_for_a_float_is_shown_as_a_power_of_two(values: int, shown: str) -> None:
    with pytest.raises(Refused) as err:
        check_join(sized(values), replace(SPEC, manifest=None))
    assert str(err.value).startswith(f"peer 0's manifest declares a model of {shown} in fp32, more than ")


def test_refusals_name_the_peer_and_where_the_runs_model_came_from() -> None:
    with pytest.raises(Refused) as err:
        check_join(join(0, protocol=5), SPEC)
    assert str(err.value).startswith("peer 0 speaks wire protocol v5")
    negative = [*join(0).manifest, pb.TensorSpec(name="x", shape=[2, -1])]
    with pytest.raises(Refused) as err:
        check_join(join(0, manifest=negative), SPEC)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(err.value) == "peer 0: tensor 'x' has a negative dimension in shape [2, -1]"
    empty_dim = {**MANIFEST, "x": (0, 3)}  # an empty tensor is a tensor
    check_manifest(empty_dim, SPEC)
    with pytest.raises(Refused) as err:
        check_join(join(0, tiny_spec(d=16)), replace(SPEC, origin="configs/tiny.yaml"))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(err.value).startswith("peer 0's model differs from the run's (configs/tiny.yaml): ")
    with pytest.raises(ValueError, match="^the manifest is empty: send the name and shape of every tensor of the mod"):
        check_manifest({}, SPEC)


def test_how_a_model_differs_is_said_in_a_few_names_of_each_kind() -> None:
    known = {f"t{i}": (2,) for i in range(10)}
    given = {**{f"t{i}": (3,) for i in range(3, 10)}, "u0": (1,), "u1": (1,)}
    assert manifest_differences(known, given) == (
        "missing 't0', 't1', 't2'; unknown 'u0', 'u1'; "
        + "; ".join(f"'t{i}' has shape [3], the run's is [2]" for i in range(3, 8))  # five of the seven reshaped
    )
    assert describe_names([f"n{i}" for i in range(5)]) == "'n0', 'n1', 'n2', 'n3', 'n4'"
    assert describe_names([f"n{i}" for i in range(7)]) == "'n0', 'n1', 'n2', 'n3', 'n4' and 2 more"


def test_two_runs_are_never_mixed() -> None:
    check_run(0, "abc", "abc", 7)  # a node of this run
    check_run(0, "", "abc", None)  # a fresh node while the run has no round yet
    with pytest.raises(Refused) as err:
        check_run(1, "", "abc", 7)
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "other_run")
    assert str(err.value) == (
        "peer 1 starts a fresh run, but this server holds run abc at round 7: to continue that run resume the node "
        "from its checkpoint (--resume=auto), or join it afresh with spes_config.run_id=abc; for a new run start "
        "the server with a fresh --state_dir"
    )
    with pytest.raises(Refused) as err:
        check_run(2, "xyz", "abc", None)  # another run's node, even before this run's first round
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "other_run")
    assert str(err.value) == (
        "peer 2 belongs to run xyz (its checkpoint or spes_config.run_id), but this server holds run abc (no round "
        "yet): restart the server with that run's --state_dir, or start the node fresh (without --resume) for this one"
    )
