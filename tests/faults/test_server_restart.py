"""The parameter server killed and restarted under two live nodes with the default settings (a data plane on a free
port, so another one after the restart): the nodes find it again and finish with every round of a fault-free run."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from conftest import Corpus, wait_until
from node_runs import reaped, start_node, start_server


def _rounds(node: Path) -> list[dict]:
    records = [json.loads(line) for line in (node / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "sync_round" in r or "caught_up_to" in r]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_nodes_find_a_restarted_server_on_its_new_data_port_and_finish_with_every_round(
    tiny_corpus: Corpus, tmp_path: Path
) -> None:
    server, port = start_server(tiny_corpus, tmp_path)
    with reaped(server) as procs:
        procs += [start_node(tiny_corpus, tmp_path, peer, port) for peer in (0, 1)]
        log = tmp_path / "server.log"
        wait_until(lambda: "round 4 complete" in log.read_text(), "the first round", timeout_s=180)
        server.send_signal(signal.SIGKILL)
        server.wait()
        server, again = start_server(tiny_corpus, tmp_path, port=port)
        procs.append(server)
        assert again == port
        codes = [p.wait(timeout=240) for p in procs[1:3]]
        assert codes == [0, 0], [(tmp_path / f"node{p}.log").read_text()[-2000:] for p in (0, 1)]
    text = log.read_text()
    assert "resumed from" in text
    for peer in (0, 1):
        assert [r.get("sync_round") for r in _rounds(tmp_path / f"node{peer}")] == [4, 8, 12]


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_finished_run_trains_on_when_its_server_and_nodes_resume_with_a_longer_max_duration(
    tiny_corpus: Corpus, tmp_path: Path
) -> None:
    server, port = start_server(tiny_corpus, tmp_path)
    with reaped(server) as procs:
        first = [start_node(tiny_corpus, tmp_path, peer, port) for peer in (0, 1)]
        procs += first
        assert [p.wait(timeout=240) for p in first] == [0, 0]
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        server, port = start_server(tiny_corpus, tmp_path, 0, "--max_duration=16st", "--server.merge_topk=3")
        procs.append(server)
        log = (tmp_path / "server.log").read_text()
        assert "max_duration changed: the run now ends at step 16 (it was to end at step 12)" in log, log[-2000:]
        assert "the next rounds use this server's: server.merge_topk: 4 -> 3" in log, log[-2000:]
        longer = [start_node(tiny_corpus, tmp_path, peer, port, "--resume", "--max_duration=16st") for peer in (0, 1)]
        procs += longer
        codes = [p.wait(timeout=240) for p in longer]
        assert codes == [0, 0], [(tmp_path / f"node{p}.log").read_text()[-2000:] for p in (0, 1)]
    for peer in (0, 1):
        assert [r["step"] for r in _rounds(tmp_path / f"node{peer}")] == [4, 8, 12, 16]
        assert (tmp_path / f"node{peer}" / "latest").read_text().strip() == "step16"
