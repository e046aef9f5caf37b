"""Token files named by URL (`data.paths: [https://olmo-data.org/.../part-000-00000.npy]`, as OLMo's configs list
them) under `data.url_reads: download`: downloaded once into a local cache and read from there like any local shard
(the default, `range`, reads them in place: `spes.remote_ranges`).

The cache is `$SPES_DATA_CACHE`, else `$XDG_CACHE_HOME/spes/data`, else `~/.cache/spes/data`; a URL's file is kept
at `<cache>/<host>/<path>`. A download lands as `<file>.partial` and is renamed only once it holds every byte
the server announced, so a cached file is always whole; a download cut short resumes from where it stopped
(HTTP range request) the next time. Processes sharing the cache (the ranks of a node) take a lock per file: one
downloads, the others wait and then read its file. A sidecar (`<url>.json`, spes's own shards) is fetched with
its shard when the server has one.
"""

from __future__ import annotations

import fcntl
import http.client
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path, PurePosixPath
from typing import BinaryIO
from urllib.parse import urlparse

from spes.atomic import fsync_dir

SCHEMES = ("http://", "https://")
TIMEOUT_S = 60.0
"""Seconds a connection or a read may stall before the download fails."""
PROGRESS_EVERY_S = 30.0
"""Seconds between a download's progress lines (a token file may take minutes)."""
_CHUNK = 1 << 20


def is_url(entry: str) -> bool:
    return entry.startswith(SCHEMES)


def data_cache_dir() -> Path:
    """Where downloaded token files are kept (read now, so a test or launcher may set the environment later)."""
    if os.environ.get("SPES_DATA_CACHE"):
        return Path(os.environ["SPES_DATA_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "spes" / "data"


def cache_path(url: str, cache: Path) -> Path:
    """`<cache>/<host>/<path>` for `url`; a URL whose path could leave that folder, or names no file, is refused."""
    parsed = urlparse(url)
    parts = PurePosixPath(parsed.path).parts[1:]
    if not parsed.hostname or not parts or ".." in parts or parsed.query or parsed.fragment:
        raise FileNotFoundError(f"data path {url!r} is not a URL of a file (http(s)://host/path/name.npy)")
    host = parsed.hostname + (f"_{parsed.port}" if parsed.port else "")
    return cache.joinpath(host, *parts)


def fetched(url: str) -> Path:
    """The local copy of the token file at `url` (and of its sidecar, if the server has one): downloaded now
    unless the cache holds it. FileNotFoundError naming the URL when it cannot be downloaded."""
    path = cache_path(url, data_cache_dir())
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # NOTE: released when the file closes, also when this process dies
        if not path.exists():  # NOTE: the sidecar first: a shard in the cache always has the sidecar it was served with
            sidecar = path.with_name(path.name + ".json")
            _download(url + ".json", sidecar, f"data path {url!r} (its sidecar {url}.json)", optional=True)
            _download(url, path, f"data path {url!r}")
    return path


def _download(url: str, path: Path, label: str, *, optional: bool = False) -> None:
    """`url` into `path` through `<path>.partial` (resumed if a download was cut short), renamed when whole;
    nothing when `optional` and the server has no such file. `label` names it in errors."""
    partial = path.with_name(path.name + ".partial")
    started = time.monotonic()
    try:
        try:
            total = _fetch_into(url, partial)
        except urllib.error.HTTPError as e:
            if e.code != 416:
                raise
            partial.unlink()  # NOTE: the leftover was whole already (cut off before its rename): fetch it again
            total = _fetch_into(url, partial)
    except urllib.error.HTTPError as e:
        if optional and e.code == 404:
            return
        raise _unreadable(label, e) from None
    except _NoSpace as e:
        raise FileNotFoundError(
            f"{label} needs {e.needed:,} bytes more and the cache {partial.parent} has {e.free:,} free: free some, or "
            "set SPES_DATA_CACHE to a larger disk"
        ) from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        raise _unreadable(label, e) from None
    size = partial.stat().st_size
    if total is not None and size != total:
        raise FileNotFoundError(f"{label}: the download ended at {size:,} of {total:,} bytes; run again to resume it")
    partial.rename(path)
    fsync_dir(path.parent)  # NOTE: so the rename survives a power cut, as spes.atomic's writes do
    seconds = time.monotonic() - started
    print(f"downloaded {url} -> {path} ({size / 2**20:,.1f} MiB in {seconds:.1f} s)", file=sys.stderr, flush=True)


def _fetch_into(url: str, partial: Path) -> int | None:
    """Append the bytes of `url` past what `partial` holds (all of them if the server ignores the range); the whole
    file's size the server announced, if it did."""
    have = partial.stat().st_size if partial.exists() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:  # noqa: S310 (http(s) URLs only)
        resumed = response.status == 206
        length = response.headers.get("Content-Length")
        free = shutil.disk_usage(partial.parent).free
        if length is not None and int(length) > free:
            raise _NoSpace(int(length), free)
        total = (have if resumed else 0) + int(length) if length is not None else None
        with open(partial, "ab" if resumed else "wb") as out:
            _copy(response, out, url, total)
    return total


def _copy(response: http.client.HTTPResponse, out: BinaryIO, url: str, total: int | None) -> None:
    """The response's body into `out`, synced to disk; a progress line every `PROGRESS_EVERY_S` seconds."""
    due = time.monotonic() + PROGRESS_EVERY_S
    while chunk := response.read(_CHUNK):
        out.write(chunk)
        if time.monotonic() >= due:
            of = f" of {total / 2**20:,.1f}" if total is not None else ""
            print(f"downloading {url}: {out.tell() / 2**20:,.1f}{of} MiB", file=sys.stderr, flush=True)
            due = time.monotonic() + PROGRESS_EVERY_S
    out.flush()
    os.fsync(out.fileno())


class _NoSpace(Exception):
    """The cache's disk cannot hold what the server is about to send (checked before a byte is written)."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(needed, free)
        self.needed, self.free = needed, free


def _unreadable(label: str, error: Exception) -> FileNotFoundError:
    return FileNotFoundError(
        f"{label} could not be downloaded ({type(error).__name__}: {error}); check the URL and the network (run "
        "again to resume a download cut short), or download it yourself and list the local file in data.paths"
    )
