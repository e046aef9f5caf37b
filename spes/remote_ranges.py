"""Files at http(s) URLs read by byte ranges, as OLMo reads the token files its configs list by URL: a training
run starts at once and fetches only the windows its batches need (`data.url_reads: range`, the default), where a
download (`spes.remote_files`) would first copy every listed file whole to each node's disk.

Requests go through urllib3 (keep-alive connections, retries with backoff on a dropped connection or a 429/5xx
answer, redirects followed), one pool per process: a `RemoteFile` pickles as its URL and size, so a DataLoader
worker opens its own connections. A server that ignores ranges (answers 200 with the whole file) is refused.
"""

from __future__ import annotations

import os
import re
from pathlib import PurePosixPath
from urllib.parse import urlparse

import urllib3
from urllib3.util import Retry, Timeout

TIMEOUT_S = 60.0
"""Seconds a connection or a read may stall before a try fails."""
TRIES = 8
"""Tries of one request before it fails, waiting 0, 1, 2, 4, 8, 16 and 32 s between them (urllib3's backoff at a
factor of 0.5): a link or server gone for up to a minute costs the steps that wait on it, not the run."""
_RETRY_STATUS = (429, 500, 502, 503, 504)
_CONTENT_RANGE = re.compile(r"bytes (?:\d+-\d+|\*)/(\d+)")

_pools: dict[int, urllib3.PoolManager] = {}


def _pool() -> urllib3.PoolManager:
    """This process's connection pool (a forked worker makes its own: sockets are not shared across processes)."""
    pid = os.getpid()
    if pid not in _pools:
        _pools.clear()
        retries = Retry(total=TRIES - 1, backoff_factor=0.5, status_forcelist=_RETRY_STATUS, raise_on_status=False)
        _pools[pid] = urllib3.PoolManager(
            num_pools=32, maxsize=16, retries=retries, timeout=Timeout(connect=TIMEOUT_S, read=TIMEOUT_S)
        )
    return _pools[pid]


def checked_url(url: str) -> str:
    """`url`, or FileNotFoundError naming it unless it names a file on a host with no query or fragment (its
    sidecar is `<url>.json`, which a signed URL's query would not sign)."""
    parsed = urlparse(url)
    if not parsed.hostname or not PurePosixPath(parsed.path).name or parsed.query or parsed.fragment:
        raise FileNotFoundError(f"data path {url!r} is not a URL of a file (http(s)://host/path/name.npy)")
    return url


class RemoteFile:
    """A file at `url` of `size` bytes, read by byte ranges; `open` measures it."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size = url, size

    @classmethod
    def open(cls, url: str, head: int) -> tuple[RemoteFile, bytes]:
        """The file at `url` and its first `head` bytes (fewer if it is shorter), from one request whose
        Content-Range gives the size; OSError naming the URL when it cannot be read so."""
        response = _get(url, f"bytes=0-{head - 1}")
        if response.status == 416:  # an empty file has no byte 0
            return cls(url, _total(url, response)), b""
        _require_range(url, response)
        return cls(url, _total(url, response)), response.data

    def read(self, start: int, length: int) -> bytes:
        """Bytes [start, start + length) of the file."""
        response = _get(self.url, f"bytes={start}-{start + length - 1}")
        _require_range(self.url, response)
        if len(response.data) != length:
            raise OSError(
                f"data path {self.url!r}: asked for bytes {start:,}..{start + length - 1:,} and got "
                f"{len(response.data):,} bytes; the file changed on the server, or the server is misbehaving"
            )
        return response.data


def fetch_optional(url: str) -> bytes | None:
    """The whole (small) file at `url`, or None when the server has none (404)."""
    response = _get(url, None)
    if response.status == 404:
        return None
    if response.status != 200:
        raise OSError(f"data path {url!r} could not be read (HTTP {response.status}); check the URL and the server")
    return response.data


def _get(url: str, byte_range: str | None) -> urllib3.BaseHTTPResponse:
    try:
        return _pool().request("GET", url, headers={"Range": byte_range} if byte_range else None)
    except urllib3.exceptions.MaxRetryError as e:
        reason = e.reason or e
        raise OSError(
            f"data path {url!r} could not be read after {TRIES} tries ({type(reason).__name__}: {reason}); check "
            "the URL and the network, or set data.url_reads=download to read local copies"
        ) from None
    except urllib3.exceptions.HTTPError as e:  # not a network failure: a URL urllib3 cannot parse, say
        raise OSError(f"data path {url!r} could not be read ({type(e).__name__}: {e}); check the URL") from None


def _require_range(url: str, response: urllib3.BaseHTTPResponse) -> None:
    if response.status == 206:
        return
    if response.status == 200:
        raise OSError(
            f"data path {url!r}: the server sends the whole file for a range request; set data.url_reads=download "
            "to read a local copy of it"
        )
    raise OSError(f"data path {url!r} could not be read (HTTP {response.status}); check the URL and the server")


def _total(url: str, response: urllib3.BaseHTTPResponse) -> int:
    """The whole file's size from a range answer's Content-Range (`bytes 0-99/1234`, or `bytes */1234` for 416)."""
    match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", ""))
    if match is None:
        raise OSError(
            f"data path {url!r}: the server's range answer names no file size (Content-Range "
            f"{response.headers.get('Content-Range')!r}); set data.url_reads=download to read a local copy of it"
        )
    return int(match.group(1))
