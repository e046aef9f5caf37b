"""Token files at URLs read by byte ranges (spes.remote_ranges, `data.url_reads: range`), from an HTTP server on
loopback: the windows a batch needs and nothing else, the same batches as the files on disk give, retries, and the
one-line refusals."""

from __future__ import annotations

import pickle
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from urllib3.util import Retry

import spes.remote_ranges
from data_fixtures import write_token_shard
from http_fixtures import Served, http_server
from spes.data import BatchLoader, TokenSequenceDataset
from spes.remote_ranges import RemoteFile, fetch_optional
from spes.shards import RangeTokenArray, find_shard_info, open_token_array, resolve_paths


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    monkeypatch.setenv("SPES_DATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(spes.remote_ranges, "_pools", {})  # NOTE: a pool made now, with this test's settings
    with http_server() as served:
        yield served


def _serve_shard(served: Served, tmp_path: Path, name: str, tokens: np.ndarray, *, sidecar: bool = True) -> str:
    """`tokens` as a spes shard (numpy header, and a sidecar unless told otherwise) at `<url>/<name>`."""
    local = write_token_shard(tmp_path / name, tokens, with_sidecar=sidecar)
    served.files[f"/{name}"] = local.read_bytes()
    if sidecar:
        served.files[f"/{name}.json"] = (tmp_path / f"{name}.json").read_bytes()
    return f"{served.url}/{name}"


@pytest.mark.timeout(60)
def test_a_headerless_olmo_file_is_read_a_window_at_a_time_and_nothing_is_downloaded(
    served: Served, tmp_path: Path
) -> None:
    """OLMo's configs list bare uint16 files by URL: opening one asks for its size and first bytes, each window one
    range of exactly its bytes; the cache folder is never made."""
    tokens = (np.arange(1000) % 97).astype(np.uint16)
    served.files["/olmo/part-0.npy"] = tokens.tobytes()
    url = served.url + "/olmo/part-0.npy"
    assert resolve_paths([url], ranged=True) == [url]
    dataset = TokenSequenceDataset([url], seq_len=100, memmap_dtype="uint16")
    assert len(dataset) == 10 and dataset.fingerprint is None
    del served.asked[:]
    assert dataset[7].tolist() == tokens[700:800].tolist()
    assert served.asked == [("GET", "/olmo/part-0.npy", "bytes=1400-1599")]
    assert not (tmp_path / "cache").exists()
    served.files["/olmo/wide.npy"] = (np.arange(1000) % 97 + 1).astype(np.uint32).tobytes()
    with pytest.raises(ValueError, match=r"/olmo/wide.npy holds uint32 token ids .* set data.memmap_dtype=uint32$"):
        open_token_array(served.url + "/olmo/wide.npy")


@pytest.mark.timeout(60)
def test_a_spes_shard_at_a_url_gives_the_batches_its_local_copy_gives_in_worker_processes_too(
    served: Served, tmp_path: Path
) -> None:
    """A real `.npy` with its sidecar, over two shards and two DataLoader workers (each pickled dataset reads
    through its own connections, the shards' layout travelling with it)."""
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 60000, n).astype(np.uint16) for n in (6400, 3300)]
    urls = [_serve_shard(served, tmp_path, f"s{i}.npy", p) for i, p in enumerate(parts)]
    local = [tmp_path / f"s{i}.npy" for i in range(2)]
    remote_set = TokenSequenceDataset(resolve_paths(urls, ranged=True), seq_len=64)
    local_set = TokenSequenceDataset(local, seq_len=64)
    assert remote_set.shard_infos == local_set.shard_infos and remote_set.fingerprint == "0" * 64
    assert len(remote_set) == len(local_set) == 100 + 51
    copy = pickle.loads(pickle.dumps(remote_set))
    assert all(isinstance(a, RangeTokenArray) for a in copy._arrays)  # no reopening in a worker
    batches = {}
    for name, dataset, workers in (("local", local_set, 0), ("remote", remote_set, 2)):
        loader = BatchLoader(dataset, batch_size=8, seed=5, num_workers=workers)
        batches[name] = [next(loader) for _ in range(4)]
        loader.close()
    assert all(np.array_equal(a, b) for a, b in zip(batches["local"], batches["remote"], strict=True))


@pytest.mark.timeout(60)
def test_a_long_npy_header_is_read_whole(served: Served, tmp_path: Path) -> None:
    """A header past the first bytes read (a version 2.0 header, as numpy writes for large ones) is fetched whole."""
    tokens = np.arange(300, dtype=np.uint32)
    header = b"{'descr': '<u4', 'fortran_order': False, 'shape': (300,), }"
    header += b" " * (-(12 + len(header) + 1) % 64 + 6016) + b"\n"  # past the first 4 KiB, data 64-byte aligned
    served.files["/long.npy"] = b"\x93NUMPY\x02\x00" + len(header).to_bytes(4, "little") + header + tokens.tobytes()
    array = open_token_array(served.url + "/long.npy")
    assert isinstance(array, RangeTokenArray) and array.dtype == np.uint32 and array.shape == (300,)
    assert array[290:300].tolist() == list(range(290, 300))
    assert array[5:5].size == 0 and array[5:5].dtype == np.uint32 and array[7:3].size == 0
    with pytest.raises(IndexError) as err:
        array[::2]
    assert err.value.args == ("a token shard at a URL is read by contiguous slices",)


@pytest.mark.timeout(60)
def test_a_server_that_ignores_ranges_is_refused_with_what_to_set(served: Served) -> None:
    served.files["/w.npy"] = np.zeros(10, np.uint16).tobytes()
    served.whole.add("/w.npy")
    url = served.url + "/w.npy"
    with pytest.raises(OSError) as err:
        open_token_array(url)
    assert str(err.value) == (
        f"data path '{url}': the server sends the whole file for a range request; set data.url_reads=download to "
        "read a local copy of it"
    )
    served.files["/r.npy"] = np.zeros(10, np.uint16).tobytes()
    remote, head = RemoteFile.open(served.url + "/r.npy", 8)
    assert head == bytes(8) and remote.size == 20 and served.asked[-1] == ("GET", "/r.npy", "bytes=0-7")
    served.whole.add("/r.npy")  # the server changed its mind after the file was opened
    with pytest.raises(OSError, match=rf"^data path '{remote.url}': the server sends the whole file"):
        remote.read(2, 4)


@pytest.mark.timeout(60)
def test_a_server_briefly_down_or_a_dropped_answer_is_retried(served: Served, tmp_path: Path) -> None:
    url = _serve_shard(served, tmp_path, "r.npy", np.arange(50, dtype=np.uint16))
    array = open_token_array(url)
    served.failing["/r.npy"] = 2
    del served.asked[:]
    assert array[10:20].tolist() == list(range(10, 20))
    first = array.offset + 10 * 2
    assert [r for _, _, r in served.asked] == [f"bytes={first}-{first + 19}"] * 3 and not served.failing["/r.npy"]
    served.cut.add("/r.npy")  # the connection drops halfway through the answer
    del served.asked[:]
    assert array[10:20].tolist() == list(range(10, 20)) and len(served.asked) == 2


@pytest.mark.timeout(60)
def test_a_server_gone_is_named_with_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spes.remote_ranges, "_pools", {})
    monkeypatch.setattr(spes.remote_ranges, "TRIES", 2)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/gone.npy"
    with pytest.raises(OSError) as err:
        open_token_array(url)
    assert str(err.value).startswith(f"data path '{url}' could not be read after 2 tries (NewConnectionError: ")
    assert str(err.value).endswith(
        "); check the URL and the network, or set data.url_reads=download to read local copies"
    )
    with pytest.raises(OSError) as err:
        open_token_array("http://[::1/x.npy")
    assert str(err.value) == (
        "data path 'http://[::1/x.npy' could not be read (LocationParseError: Failed to parse: '[::1' is not a valid "
        "host or port); check the URL"
    )


@pytest.mark.timeout(60)
def test_missing_truncated_and_changed_files_are_refused_by_name(served: Served, tmp_path: Path) -> None:
    missing = served.url + "/absent.npy"
    with pytest.raises(OSError, match=rf"^data path '{missing}' could not be read \(HTTP 404\)"):
        open_token_array(missing)
    url = _serve_shard(served, tmp_path, "t.npy", np.arange(100, dtype=np.uint16), sidecar=False)
    served.files["/t.npy"] = served.files["/t.npy"][:-10]
    with pytest.raises(ValueError) as err:
        open_token_array(url)
    assert str(err.value) == (
        f"token shard {url} is not a whole array of token ids (uint16 (100,) in 318 bytes); rerun tokenize_data.py "
        "for it"
    )
    header = served.files["/t.npy"][:128]
    for name, body, what in (
        ("/h10.npy", header[:10], "its .npy header of 128 bytes in 10"),
        ("/h9.npy", header[:9], "9 bytes"),
        ("/v2.npy", b"\x93NUMPY\x02\x00\x00", "9 bytes"),
    ):
        served.files[name] = body
        with pytest.raises(ValueError) as err:
            open_token_array(served.url + name)
        assert str(err.value) == (
            f"token shard {served.url}{name} is not a whole array of token ids ({what}); rerun tokenize_data.py for it"
        )
    served.files["/v3.npy"] = b"\x93NUMPY\x03\x00" + header[8:]
    with pytest.raises(ValueError) as err:
        open_token_array(served.url + "/v3.npy")
    assert str(err.value) == (
        f"token shard {served.url}/v3.npy has a .npy header of a version spes does not read (1.0 and 2.0 only)"
    )
    served.files["/odd.npy"] = b"\x00" * 7
    with pytest.raises(ValueError, match=rf"^headerless token file {served.url}/odd.npy has 7 bytes, not a multiple"):
        open_token_array(served.url + "/odd.npy")
    served.files["/wide.npy"] = np.arange(6, dtype=np.uint32).tobytes()
    wide = open_token_array(served.url + "/wide.npy", "uint32")
    assert wide.dtype == np.uint32 and wide[:6].tolist() == list(range(6))
    served.files["/e.npy"] = b""
    assert len(open_token_array(served.url + "/e.npy")) == 0
    _serve_shard(served, tmp_path, "none.npy", np.zeros(0, dtype=np.uint16), sidecar=False)  # a header, no token
    assert open_token_array(served.url + "/none.npy").shape == (0,)
    remote = RemoteFile(served.url + "/absent.npy", 100)
    with pytest.raises(OSError, match=r"could not be read \(HTTP 404\)"):
        remote.read(0, 10)
    shrunk = RemoteFile(served.url + "/t.npy", 1000)
    with pytest.raises(OSError, match=r"asked for bytes 0..999 and got .* the file changed on the server"):
        shrunk.read(0, 1000)


@pytest.mark.timeout(60)
def test_a_sidecar_is_read_from_the_server_and_a_missing_one_is_none(served: Served, tmp_path: Path) -> None:
    with_sidecar = _serve_shard(served, tmp_path, "a.npy", np.arange(20, dtype=np.uint16))
    bare = _serve_shard(served, tmp_path, "b.npy", np.arange(20, dtype=np.uint16), sidecar=False)
    info = find_shard_info(with_sidecar)
    assert info is not None and info.num_tokens == 20
    assert find_shard_info(bare) is None
    served.files["/a.npy.json"] = b"{"
    with pytest.raises(ValueError, match=rf"^sidecar {with_sidecar}.json is malformed"):
        find_shard_info(with_sidecar)


@pytest.mark.timeout(60)
def test_a_range_answer_that_names_no_file_size_is_refused(served: Served) -> None:
    served.files["/n.npy"] = np.zeros(10, np.uint16).tobytes()
    served.files["/empty.npy"] = b""
    served.unsized_ranges |= {"/n.npy", "/empty.npy"}
    for name, header in (("/n.npy", "'bytes 0-15/*'"), ("/empty.npy", "None")):
        url = served.url + name
        with pytest.raises(OSError) as err:
            RemoteFile.open(url, 16)
        assert str(err.value) == (
            f"data path '{url}': the server's range answer names no file size (Content-Range {header}); set "
            "data.url_reads=download to read a local copy of it"
        )


@pytest.mark.timeout(60)
def test_an_empty_file_is_opened_from_its_416_answer(served: Served) -> None:
    served.files["/e.npy"] = b""
    remote, head = RemoteFile.open(served.url + "/e.npy", 16)
    assert (remote.url, remote.size, head) == (served.url + "/e.npy", 0, b"")


@pytest.mark.timeout(60)
def test_answers_still_failing_after_every_try_are_named_with_their_status(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spes.remote_ranges, "TRIES", 2)
    served.files["/f.npy"] = np.zeros(10, np.uint16).tobytes()
    served.files["/f.npy.json"] = b"{}"
    served.failing["/f.npy"] = served.failing["/f.npy.json"] = 10
    url = served.url + "/f.npy"
    with pytest.raises(OSError) as err:
        RemoteFile.open(url, 16)
    assert str(err.value) == f"data path '{url}' could not be read (HTTP 503); check the URL and the server"
    with pytest.raises(OSError) as err:
        fetch_optional(url + ".json")
    assert str(err.value) == f"data path '{url}.json' could not be read (HTTP 503); check the URL and the server"
    assert [p for _, p, _ in served.asked] == ["/f.npy"] * 2 + ["/f.npy.json"] * 2


def test_each_process_keeps_its_own_pool_with_the_documented_retries_and_timeouts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A forked DataLoader worker must not share its parent's sockets; the pool's settings are the docstring's."""
    monkeypatch.setattr(spes.remote_ranges, "_pools", {})
    pool = spes.remote_ranges._pool()
    assert spes.remote_ranges._pool() is pool
    retries, timeout = pool.connection_pool_kw["retries"], pool.connection_pool_kw["timeout"]
    assert (retries.total, retries.backoff_factor, retries.raise_on_status) == (7, 0.5, False)
    waits = [Retry(total=7, backoff_factor=0.5).increment()]  # one error so far
    for _ in range(6):
        waits.append(waits[-1].increment())
    assert [w.get_backoff_time() for w in waits] == [0, 1, 2, 4, 8, 16, 32]
    assert set(retries.status_forcelist) == {429, 500, 502, 503, 504}
    assert (timeout.connect_timeout, timeout.read_timeout, timeout.total) == (60.0, 60.0, None)
    assert pool.connection_pool_kw["maxsize"] == 16 and pool.pools._maxsize == 32
    monkeypatch.setattr(spes.remote_ranges.os, "getpid", lambda: -1)  # as a forked child sees itself
    child = spes.remote_ranges._pool()
    assert child is not pool and list(spes.remote_ranges._pools) == [-1]


def test_a_url_of_no_file_is_refused_as_it_is_listed(served: Served, tmp_path: Path) -> None:
    """A query or fragment (a signed URL) could not name the sidecar beside it; a list file's URLs stay URLs."""
    for bad in (served.url + "/x.npy?sig=1", served.url + "/x.npy#a", served.url + "/", "http:///x.npy"):
        with pytest.raises(FileNotFoundError) as err:
            resolve_paths([bad], ranged=True)
        assert str(err.value) == f"data path {bad!r} is not a URL of a file (http(s)://host/path/name.npy)"
    listed = tmp_path / "list.txt"
    listed.write_text(f"{served.url}/a.npy\n{served.url}/b.npy\n")
    assert resolve_paths([listed], ranged=True) == [f"{served.url}/a.npy", f"{served.url}/b.npy"]
    assert served.asked == [] and not (tmp_path / "cache").exists()
