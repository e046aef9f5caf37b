"""Token files named by URL (spes.remote_files), served by an HTTP server on loopback: downloaded once into the cache
(`SPES_DATA_CACHE`), read as shards, resumed when cut short, waited for by a second process, refused in one line."""

from __future__ import annotations

import os
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import spes.remote_files
from data_fixtures import write_token_shard
from http_fixtures import Served, http_server
from spes.data import TokenSequenceDataset
from spes.remote_files import cache_path, data_cache_dir, fetched, is_url
from spes.shards import read_shard_info, resolve_paths


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    monkeypatch.setenv("SPES_DATA_CACHE", str(tmp_path / "cache"))
    with http_server() as served:
        yield served


def _olmo_file(tokens: np.ndarray) -> bytes:
    """A headerless token file as OLMo's are: the raw uint16 array."""
    return tokens.astype(np.uint16).tobytes()


@pytest.mark.timeout(60)
def test_a_url_in_data_paths_is_downloaded_once_and_read_as_a_shard(served: Served, tmp_path: Path) -> None:
    """OLMo's configs list their token files by URL: headerless files, read as data.memmap_dtype from the cache;
    a second resolve reads the cache without asking again."""
    tokens = np.arange(100) % 50
    served.files["/preprocessed/part-0.npy"] = _olmo_file(tokens)
    url = served.url + "/preprocessed/part-0.npy"
    (first,) = resolve_paths([url])
    port = served.url.rpartition(":")[2]
    assert first == tmp_path / "cache" / f"127.0.0.1_{port}" / "preprocessed" / "part-0.npy"
    assert resolve_paths([url]) == [first]
    assert [(m, p) for m, p, _ in served.asked] == [
        ("GET", "/preprocessed/part-0.npy.json"),
        ("GET", "/preprocessed/part-0.npy"),
    ]
    dataset = TokenSequenceDataset([first], seq_len=10, memmap_dtype="uint16")
    assert len(dataset) == 10 and dataset[3].tolist() == tokens[30:40].tolist()
    assert sorted(p.name for p in first.parent.iterdir()) == ["part-0.npy", "part-0.npy.lock"]  # no partial left


@pytest.mark.timeout(60)
def test_a_shard_of_spes_comes_with_its_sidecar(served: Served, tmp_path: Path) -> None:
    shard = write_token_shard(tmp_path / "local.npy", np.arange(20, dtype=np.uint16), fingerprint="f" * 64)
    served.files["/a/local.npy"] = shard.read_bytes()
    served.files["/a/local.npy.json"] = (tmp_path / "local.npy.json").read_bytes()
    (cached,) = resolve_paths([served.url + "/a/local.npy"])
    assert read_shard_info(cached) == read_shard_info(shard)
    assert np.array_equal(np.load(cached), np.arange(20))


@pytest.mark.timeout(60)
def test_a_download_cut_short_is_refused_and_resumed_where_it_stopped(served: Served) -> None:
    body = bytes(range(256)) * 40
    served.files["/x.npy"] = body
    served.cut.add("/x.npy")
    url = served.url + "/x.npy"
    with pytest.raises(FileNotFoundError) as err:
        fetched(url)
    path = cache_path(url, Path(os.environ["SPES_DATA_CACHE"]))
    assert str(err.value) == f"data path {url!r}: the download ended at 5,120 of 10,240 bytes; run again to resume it"
    assert not path.exists() and path.with_name("x.npy.partial").stat().st_size == len(body) // 2
    assert fetched(url) == path and path.read_bytes() == body
    assert served.asked[-1] == ("GET", "/x.npy", f"bytes={len(body) // 2}-")  # only the missing half asked for


@pytest.mark.timeout(60)
def test_a_whole_leftover_partial_is_fetched_again(served: Served) -> None:
    """A process killed between its download's last byte and the rename leaves a whole `.partial`: the server
    refuses a range past its end (416), and the file is fetched again."""
    served.files["/y.npy"] = b"\x01\x00" * 8
    url = served.url + "/y.npy"
    path = cache_path(url, Path(os.environ["SPES_DATA_CACHE"]))
    path.parent.mkdir(parents=True)
    path.with_name("y.npy.partial").write_bytes(b"\x01\x00" * 8)
    assert fetched(url).read_bytes() == b"\x01\x00" * 8
    assert [r for _, p, r in served.asked if p == "/y.npy"] == ["bytes=16-", None]


@pytest.mark.timeout(60)
def test_processes_sharing_the_cache_download_a_file_once(served: Served) -> None:
    served.files["/z.npy"] = b"\x02\x00" * 50_000
    url = served.url + "/z.npy"
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(fetched(url))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(got) == 4 and len(set(got)) == 1
    assert [p for _, p, _ in served.asked] == ["/z.npy.json", "/z.npy"]


@pytest.mark.timeout(60)
def test_a_url_the_server_does_not_have_is_named_with_what_to_do(served: Served) -> None:
    url = served.url + "/absent.npy"
    with pytest.raises(FileNotFoundError) as err:
        resolve_paths([url])
    assert str(err.value) == (
        f"data path {url!r} could not be downloaded (HTTPError: HTTP Error 404: Not Found); check the URL and the "
        "network (run again to resume a download cut short), or download it yourself and list the local file in "
        "data.paths"
    )
    assert not cache_path(url, Path(os.environ["SPES_DATA_CACHE"])).exists()


@pytest.mark.timeout(60)
def test_a_url_of_a_half_written_or_other_file_is_refused_by_name_before_a_byte_is_fetched(served: Served) -> None:
    """The download mode fetched such a file whole (and its sidecar) before the dataset refused it, naming the cache
    path instead of the URL."""
    served.files["/part_00000.npy.partial"] = served.files["/tokens.bin"] = bytes(1000)
    for name, why in (("part_00000.npy.partial", "is half-written"), ("tokens.bin", "is not a .npy file")):
        url = f"{served.url}/{name}"
        with pytest.raises(ValueError) as err:
            resolve_paths([url])
        assert str(err.value).startswith(f"token shard {url} {why} (tokenize_data.py ")
    assert served.asked == [] and not Path(os.environ["SPES_DATA_CACHE"]).exists()


@pytest.mark.parametrize(
    "url",
    [
        "http://host/",
        "http://host/a/../../etc/passwd",
        "http://host/a.npy?x=1",
        "http://host/a.npy#f",
        "https:///a.npy",
    ],
)
def test_a_url_that_names_no_file_inside_the_cache_is_refused(url: str) -> None:
    with pytest.raises(FileNotFoundError, match=r"is not a URL of a file \(http\(s\)://host/path/name.npy\)"):
        cache_path(url, Path("/cache"))


def test_urls_and_their_cache_paths() -> None:
    assert is_url("https://olmo-data.org/a.npy") and is_url("http://h/a.npy") and not is_url("data/a.npy")
    assert cache_path("https://olmo-data.org/p/v1/part-1.npy", Path("/c")) == Path("/c/olmo-data.org/p/v1/part-1.npy")
    assert cache_path("http://mirror:8080/a.npy", Path("/c")) == Path("/c/mirror_8080/a.npy")


@pytest.mark.timeout(60)
def test_a_file_larger_than_the_caches_free_space_is_refused_before_a_byte_is_written(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    served.files["/big.npy"] = b"\x00" * 4096
    url = served.url + "/big.npy"
    monkeypatch.setattr(spes.remote_files.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1, 1, 4095))
    with pytest.raises(FileNotFoundError) as err:
        fetched(url)
    folder = cache_path(url, Path(os.environ["SPES_DATA_CACHE"])).parent
    assert str(err.value) == (
        f"data path {url!r} needs 4,096 bytes more and the cache {folder} has 4,095 free: free some, or set "
        "SPES_DATA_CACHE to a larger disk"
    )
    assert sorted(p.name for p in folder.iterdir()) == ["big.npy.lock"]
    monkeypatch.setattr(spes.remote_files.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1, 1, 4096))
    assert fetched(url).stat().st_size == 4096  # exactly the room it needs


@pytest.mark.timeout(60)
def test_a_download_tells_its_progress(
    served: Served, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    served.files["/p.npy"] = b"\x00" * (3 << 20)
    url = served.url + "/p.npy"
    monkeypatch.setattr(spes.remote_files, "PROGRESS_EVERY_S", 0.0)
    path = fetched(url)
    lines = capsys.readouterr().err.splitlines()
    assert lines[:3] == [f"downloading {url}: {n:,.1f} of 3.0 MiB" for n in (1, 2, 3)]
    assert lines[3].startswith(f"downloaded {url} -> {path} (3.0 MiB in ") and len(lines) == 4


def test_a_server_without_ranges_or_sizes_still_gives_the_whole_file(served: Served) -> None:
    """A leftover `.partial` met by a server that answers every request whole (200, no range) is replaced, not
    appended to; a body of no announced size is taken as it comes."""
    served.files["/w.npy"] = served.files["/u.npy"] = bytes(range(200))
    served.whole.add("/w.npy")
    served.unsized.add("/u.npy")
    cache = Path(os.environ["SPES_DATA_CACHE"])
    leftover = cache_path(served.url + "/w.npy", cache).with_name("w.npy.partial")
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"stale bytes")
    assert fetched(served.url + "/w.npy").read_bytes() == bytes(range(200))
    assert served.asked[-1] == ("GET", "/w.npy", "bytes=11-")
    assert fetched(served.url + "/u.npy").read_bytes() == bytes(range(200))


@pytest.mark.timeout(60)
def test_progress_lines_come_every_progress_interval_by_the_clock(
    served: Served, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A clock that moves 10 s at each reading, a line every 20 s: after the second, fourth and sixth MiB (the
    reading of chunk 2 meets the interval exactly), and the whole download's seconds by the same clock."""
    ticks = iter(range(10, 10_000, 10))
    monkeypatch.setattr(spes.remote_files, "time", SimpleNamespace(monotonic=lambda: float(next(ticks))))
    monkeypatch.setattr(spes.remote_files, "PROGRESS_EVERY_S", 20.0)
    served.files["/q.npy"] = served.files["/r.npy"] = b"\x00" * (6 << 20)
    served.unsized.add("/r.npy")
    path = fetched(served.url + "/q.npy")
    unsized = fetched(served.url + "/r.npy")
    assert capsys.readouterr().err.splitlines() == [
        *(f"downloading {served.url}/q.npy: {n}.0 of 6.0 MiB" for n in (2, 4, 6)),
        f"downloaded {served.url}/q.npy -> {path} (6.0 MiB in 110.0 s)",
        *(f"downloading {served.url}/r.npy: {n}.0 MiB" for n in (2, 4, 6)),
        f"downloaded {served.url}/r.npy -> {unsized} (6.0 MiB in 110.0 s)",
    ]


@pytest.mark.timeout(30)
def test_a_server_that_accepts_and_never_answers_fails_the_download_at_the_timeout(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spes.remote_files, "TIMEOUT_S", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/s.npy"
        with pytest.raises(FileNotFoundError) as err:
            fetched(url)
    assert str(err.value).startswith(
        f"data path {url!r} (its sidecar {url}.json) could not be downloaded (TimeoutError"
    )


def test_a_refused_connection_names_the_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPES_DATA_CACHE", str(tmp_path / "cache"))
    url = "http://127.0.0.1:9/x.npy"  # the discard port: nothing listens
    with pytest.raises(FileNotFoundError) as err:
        fetched(url)
    assert str(err.value).startswith(f"data path {url!r} (its sidecar {url}.json) could not be downloaded (URLError: ")


def test_the_cache_is_spes_data_cache_else_under_the_xdg_cache_else_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPES_DATA_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("SPES_DATA_CACHE")
    assert data_cache_dir() == tmp_path / "xdg" / "spes" / "data"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert data_cache_dir() == tmp_path / "home" / ".cache" / "spes" / "data"
