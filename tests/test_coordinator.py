"""The round service without any transport: joins, uploads fed straight into its decoder, downloads."""

from __future__ import annotations

import grpc
import pytest
import torch

from spes.sync.coordinator import Coordinator
from spes.sync.merge import build_global, download_names
from spes.sync.protocol import Reason, Refused
from spes.sync.server import ServerConfig
from spes.sync.wire import TensorDecoder, encode_tensors
from sync_helpers import peer_upload, tiny_manifest
from test_client import NO_MERGE
from test_server import join_request

MANIFEST = tiny_manifest()


def feeding(tensors: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    def feed(decoder: TensorDecoder) -> None:
        for chunk in encode_tensors(tensors, "fp32"):
            decoder.feed(chunk)

    return feed


@pytest.mark.timeout(60)
def test_a_round_through_the_coordinator_alone() -> None:
    service = Coordinator(ServerConfig(num_peers=2, experts_per_peer=2, merge=NO_MERGE))
    try:
        with pytest.raises(Refused) as err:
            service.upload(0, 1, feeding({}))
        assert (err.value.code, err.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.NOT_JOINED)
        for peer in range(2):
            reply = service.join(join_request(peer), session=f"s{peer}", address="test", common_name=lambda: None)
            assert (reply.current_round, reply.open_round) == (-1, -1)
        uploads = {p: peer_upload(MANIFEST, p, "spes", seed=1) for p in range(2)}
        want = build_global(uploads, num_peers=2, experts_per_peer=2, mode="spes", step=1, merge=NO_MERGE).tensors
        assert list(service.upload(0, 1, feeding(uploads[0])).uploaded_peers) == [0]
        assert service.upload(0, 1, feeding(uploads[0])).duplicate
        assert list(service.upload(1, 1, feeding(uploads[1])).uploaded_peers) == [0, 1]
        with service.download(1, 1, False, lambda: True, 30.0) as outgoing:
            assert outgoing is not None
            assert sorted(outgoing.info.names) == sorted(download_names(list(MANIFEST), 1, "spes", merged=False))
            assert all(torch.equal(outgoing.tensors[n], want[n]) for n in outgoing.info.names)
            outgoing.sent = 123
        status = service.status()
        assert (status.current_round, status.num_peers, status.bytes_out) == (1, 2, 123)
        with service.download(0, 2, False, lambda: False, 30.0) as gone:  # the caller went away while waiting
            assert gone is None
    finally:
        service.shutdown(grace_s=1.0)
