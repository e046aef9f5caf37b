"""A server restarted on a --state_dir whose state.json is gone (run.json and a round file kept): the run's resuming
peers are told what is likely and what to do."""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_helpers import spec_overrides, start_server_process

from spes.sync.client import SyncError
from spes.sync.state import STATE_FILE
from sync_helpers import make_client, peer_upload, sync_all, tiny_spec

SPEC = tiny_spec()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_peer_resuming_on_a_server_whose_state_json_was_deleted_is_told_so(tmp_path: Path) -> None:
    """The restarted server starts the run again at its first round; the peer's next round was refused as if the
    peers used other sync_steps ('do all nodes use the run's spes_config.sync_steps and max_duration?')."""
    state = tmp_path / "state"
    args = [*spec_overrides(SPEC), "--state_dir", str(state)]
    server = start_server_process(tmp_path / "first.log", args)
    try:
        clients = [make_client(server.addr, SPEC, p, rpc_timeout_s=10, max_retries=2) for p in range(2)]
        for client in clients:
            client.join()
        sync_all(clients, 1, {p: peer_upload(SPEC, p, seed=1) for p in range(2)})
        for client in clients:
            client.close()
        assert server.stop() == 0
        (state / STATE_FILE).unlink()
        assert sorted(p.name for p in state.glob("r*")) == ["round-1.safetensors", "run.json"]
        server = start_server_process(tmp_path / "restarted.log", args)
        with make_client(server.addr, SPEC, 0, rpc_timeout_s=10, max_retries=2) as resumed:
            resumed.join()
            with pytest.raises(SyncError) as refused:
                resumed.sync(2, peer_upload(SPEC, 0, seed=2))
    finally:
        server.kill()
    assert (
        "peer 0 resumes at round 2, but this server holds no completed round of the run (its first round is 1): its "
        "state.json is gone, or it was started on another --state_dir; restart it on the --state_dir that holds the "
        "run's state.json, or start a new run (a fresh --state_dir, every node without --resume)"
    ) in str(refused.value)
