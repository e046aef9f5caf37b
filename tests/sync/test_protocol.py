"""The protocol's vocabulary (spes.sync.protocol): which refusals a client retries, reasons from another version,
and the one-line refusal of another protocol version."""

from __future__ import annotations

import grpc
import pytest

from spes.sync.protocol import (
    PROTOCOL_VERSION,
    RETRY_REASONS,
    Reason,
    Refused,
    SyncError,
    classify,
    reason_of,
    shutting_down,
    version_refusal,
)

CODE = grpc.StatusCode


@pytest.mark.parametrize(
    ("code", "reason", "retryable"),
    [
        (CODE.UNAVAILABLE, "", True),  # the server unreachable or restarting
        (CODE.DEADLINE_EXCEEDED, "", True),
        (CODE.DEADLINE_EXCEEDED, "round_timeout", False),  # the round itself timed out: the same call cannot help
        (CODE.RESOURCE_EXHAUSTED, "busy", True),
        (CODE.DATA_LOSS, "corrupt", True),
        (CODE.ALREADY_EXISTS, "duplicate_peer", True),
        (CODE.FAILED_PRECONDITION, "stale_round", False),
        (CODE.FAILED_PRECONDITION, "", False),
        (CODE.INVALID_ARGUMENT, "a_reason_of_a_later_version", False),
        (CODE.UNAUTHENTICATED, "unauthenticated", False),
    ],
)
def test_a_refusal_is_retryable_when_the_same_request_may_succeed(
    code: grpc.StatusCode, reason: str, retryable: bool
) -> None:
    error = classify("upload of round 3", code, "the details", reason)
    assert error.retryable is retryable and error.code is code
    assert str(error) == f"upload of round 3 failed ({code.name}): the details"
    assert error.reason == reason_of(reason)


def test_the_retried_reasons_are_damaged_bytes_a_busy_server_and_a_held_peer_id() -> None:
    assert RETRY_REASONS == {Reason.CORRUPT, Reason.BUSY, Reason.DUPLICATE_PEER}


def test_a_reason_this_version_does_not_know_counts_as_none() -> None:
    assert reason_of("busy") is Reason.BUSY and reason_of("") is Reason.NONE
    assert reason_of("later_reason") is Reason.NONE
    assert SyncError("x", reason="later_reason").reason is Reason.NONE
    assert SyncError("x", reason=Reason.OTHER_RUN).reason is Reason.OTHER_RUN


def test_a_sync_error_is_final_and_codeless_unless_told() -> None:
    error = SyncError("a client-side check failed")
    assert (error.code, error.reason, error.retryable) == (None, Reason.NONE, False)
    assert SyncError("x", CODE.UNAVAILABLE, retryable=True).retryable


def test_reasons_are_the_strings_that_travel() -> None:
    """A reason is sent as its value (gRPC trailing metadata, the data plane's error frame): str and format agree."""
    assert str(Reason.STALE_ROUND) == "stale_round" and f"{Reason.BASE_MISMATCH}" == "base_mismatch"
    assert Refused(CODE.RESOURCE_EXHAUSTED, "slots full", "busy").reason is Reason.BUSY
    refused = Refused(CODE.NOT_FOUND, "who?")
    assert (refused.code, refused.reason, str(refused)) == (CODE.NOT_FOUND, Reason.NONE, "who?")


def test_another_protocol_version_is_refused_naming_both() -> None:
    refused = version_refusal("peer 2", PROTOCOL_VERSION - 1)
    assert refused.code is CODE.FAILED_PRECONDITION and refused.reason is Reason.WRONG_PROTOCOL
    assert str(refused) == (
        f"peer 2 speaks wire protocol v{PROTOCOL_VERSION - 1} but this server speaks v{PROTOCOL_VERSION}: run the "
        "same spes version on the server and every node"
    )


def test_a_stopping_server_says_so_as_a_retryable_refusal_that_keeps_the_node_on_its_plane() -> None:
    refused = shutting_down()
    assert (refused.code, refused.reason, str(refused)) == (
        CODE.UNAVAILABLE,
        Reason.SHUTTING_DOWN,
        "the parameter server is shutting down: nodes retry until it is back",
    )
    assert classify("upload of round 2", refused.code, str(refused), refused.reason).retryable
