"""The parameter server killed and restarted under two live nodes with the default settings (a data plane on a free
port, so another one after the restart): the nodes find it again and finish with every round of a fault-free run."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Corpus, wait_until
from node_runs import reaped, start_node, start_server


def _rounds(node: Path) -> list[dict]:
    records = [json.loads(line) for line in (node / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "sync_round" in r or "caught_up_to" in r]


def _nodes(corpus: Corpus, out: Path, port: int, *flags: str) -> list[subprocess.Popen]:
    """Nodes 0 and 1 of the run, on the server at `port`."""
    return [start_node(corpus, out, peer, port, *flags) for peer in (0, 1)]


@contextlib.contextmanager
def _a_run(corpus: Corpus, out: Path) -> Iterator[tuple[list[subprocess.Popen], int]]:
    """The run's server and its two nodes started, and the server's port: the list holds them (server first) and
    whatever the test starts later, each reaped on the way out."""
    server, port = start_server(corpus, out)
    with reaped(server) as procs:
        procs += _nodes(corpus, out, port)
        yield procs, port


def _finished(nodes: list[subprocess.Popen], out: Path) -> None:
    """Both nodes end with exit code 0 (a failure shows each one's log tail)."""
    codes = [p.wait(timeout=240) for p in nodes]
    assert codes == [0, 0], [(out / f"node{p}.log").read_text()[-2000:] for p in (0, 1)]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_nodes_find_a_restarted_server_on_its_new_data_port_and_finish_with_every_round(
    tiny_corpus: Corpus, tmp_path: Path
) -> None:
    with _a_run(tiny_corpus, tmp_path) as (procs, port):
        server = procs[0]
        log = tmp_path / "server.log"
        wait_until(lambda: "round 4 complete" in log.read_text(), "the first round", timeout_s=180)
        server.send_signal(signal.SIGKILL)
        server.wait()
        server, again = start_server(tiny_corpus, tmp_path, port=port)
        procs.append(server)
        assert again == port
        _finished(procs[1:3], tmp_path)
    text = log.read_text()
    assert "resumed from" in text
    for peer in (0, 1):
        assert [r.get("sync_round") for r in _rounds(tmp_path / f"node{peer}")] == [4, 8, 12]


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_finished_run_trains_on_when_its_server_and_nodes_resume_with_a_longer_max_duration(
    tiny_corpus: Corpus, tmp_path: Path
) -> None:
    with _a_run(tiny_corpus, tmp_path) as (procs, port):
        server = procs[0]
        _finished(procs[1:], tmp_path)
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        server, port = start_server(tiny_corpus, tmp_path, 0, "--max_duration=16st", "--server.merge_topk=3")
        procs.append(server)
        log = (tmp_path / "server.log").read_text()
        assert "max_duration changed: the run now ends at step 16 (it was to end at step 12)" in log, log[-2000:]
        assert "the next rounds use this server's: server.merge_topk: 4 -> 3" in log, log[-2000:]
        longer = _nodes(tiny_corpus, tmp_path, port, "--resume", "--max_duration=16st")
        procs += longer
        _finished(longer, tmp_path)
    for peer in (0, 1):
        assert [r["step"] for r in _rounds(tmp_path / f"node{peer}")] == [4, 8, 12, 16]
        assert (tmp_path / f"node{peer}" / "latest").read_text().strip() == "step16"
