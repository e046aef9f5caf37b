"""A client's channel to the server (`spes.sync.connection`)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from spes.sync.protocol import SyncError
from sync_helpers import make_client, running_server, tiny_spec


@pytest.mark.timeout(60)
def test_a_new_client_of_a_server_restarted_on_the_same_port_connects_at_once() -> None:
    """An older client's channel to the stopped server is in its reconnect backoff; a new client of the server started
    again on that port joins on its first try. (In gRPC's process-wide subchannel pool the new channel took over the
    old one's failed connection and was refused at once: the error with which a CI run failed a test that joins
    with max_retries=0.)"""
    spec = tiny_spec()
    with running_server(spec) as (_, addr):
        old = make_client(addr, spec, 0, rpc_timeout_s=5, max_retries=0)
        old.join()
    with old:
        with pytest.raises(SyncError) as err:
            old.status_reply()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        port = int(addr.rsplit(":", 1)[1])
        with running_server(spec, port=port) as (_, again), make_client(again, spec, 1, max_retries=0) as new:
            assert new.join() == -1


def test_a_ca_file_that_is_no_pem_is_refused_naming_its_key_on_either_plane(tmp_path: Path) -> None:
    """Under data_plane grpc only gRPC read it: its core logged lines naming no file, and the join failed as
    UNAVAILABLE, retried as a server that is down. Now the key is named at once, whichever plane carries payloads."""
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate\n")
    for plane in ("grpc", "auto"):
        with pytest.raises(ValueError, match=r"^config key 'spes_config.tls_ca' '.*ca.pem': not a usable PEM"):
            make_client("127.0.0.1:1", tiny_spec(), 0, tls_ca=str(bad), data_plane=plane)
