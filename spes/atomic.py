"""Files and directories that appear whole or not at all.

A reader (a resuming trainer, a restarted server, the next pipeline stage) must never see half a file, whatever
kills the writer: each file is written to a temporary name in the same directory, fsynced, renamed over the
target (atomic on POSIX) and the directory is fsynced so the rename itself survives a power cut. A directory
(a checkpoint, an export) is filled under a temporary sibling name and published the same way (`staging_dir`,
`publish_dir`).
The file gets the mode a plain `open()` would give it (0666 less the process umask, 0644 typically), so the
other users of a shared cluster can read checkpoints, exports and logs (spes writes no secrets: the token,
key and certificate files are the user's own).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

ASIDE = ".old-"  # `.<name>.old-<pid>`: a published directory's previous copy while it is being replaced
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""A write refused for want of room: a full disk, a full quota, a file-size limit (`ulimit -f`)."""
_LIBRARY_ERRNO = re.compile(r"\(os error (\d+)\)")  # how Rust libraries (safetensors) name the errno of an I/O error


def os_errno(error: BaseException) -> int | None:
    """The errno behind `error`: an OSError's, or the one a library's own I/O error names only in its text
    (safetensors: `I/O error: No space left on device (os error 28)`); None when it names none."""
    if isinstance(error, OSError):
        return error.errno
    found = _LIBRARY_ERRNO.search(str(error))
    return int(found[1]) if found else None


def library_os_error(error: BaseException, path: str | os.PathLike[str]) -> OSError | None:
    """The OSError of `path` that a library's own I/O error stands for (its errno kept), so that a caller handling
    OSError handles it too; None when `error` is an OSError already or names no errno."""
    code = os_errno(error)
    if isinstance(error, OSError) or code is None:
        return None
    return OSError(code, os.strerror(code), str(path))


class OutOfRoom(OSError):
    """A write that found no room (NO_ROOM); its message names what was being written, where, and what to do."""

    def __str__(self) -> str:
        return str(self.strerror)


@contextlib.contextmanager
def room_for(what: str, fix: str | Callable[[], str]) -> Iterator[None]:
    """Turn running out of room in the block (any of NO_ROOM, raised by Python or by a library) into one OutOfRoom
    saying `<what>: <the errno's text>; <fix>`: the one line a user needs, where the errno alone names no file. A
    callable `fix` is asked only then (what it says may need reading the disk)."""
    try:
        yield
    except OutOfRoom:
        raise
    except Exception as e:
        code = os_errno(e)
        if code not in NO_ROOM:
            raise
        raise OutOfRoom(code, f"{what}: {os.strerror(code).lower()}; {fix() if callable(fix) else fix}") from e


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make the renames and creations inside `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def umask_mode() -> int:
    """The mode `open()` gives a new file under the current umask."""
    umask = os.umask(0o022)  # NOTE: reading the umask means setting it; put it straight back
    os.umask(umask)
    return 0o666 & ~umask


def follow_umask(directory: str | os.PathLike[str]) -> None:
    """Give every file under `directory` the umask's mode (safetensors' `save_file` creates 0600 files)."""
    mode = umask_mode()
    for p in Path(directory).rglob("*"):
        if p.is_file():
            os.chmod(p, mode)


def leftover_temps(folder: Path, name_glob: str) -> list[Path]:
    """The temp files `write_atomic` leaves in `folder` for targets whose names match `name_glob` when its process is
    killed mid-write (hidden, so a listing of the targets never shows them)."""
    return sorted(folder.glob(f".{name_glob}.*.tmp"))


def write_atomic(path: str | os.PathLike[str], data: bytes | str | Callable[[str], None]) -> None:
    """Give `path` the contents `data` (bytes, UTF-8 text, or a function that writes the temp path it is given)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if not callable(data):
                f.write(data.encode() if isinstance(data, str) else data)
        if callable(data):
            try:
                data(tmp)
            except Exception as e:
                if (os_error := library_os_error(e, path)) is None:
                    raise
                raise os_error from e
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, umask_mode())  # NOTE: mkstemp creates 0600 files, hidden from the cluster's other users
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def publish_dir(staged: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Rename the complete directory `staged` to its sibling `target`, durably, replacing what is there.

    Every file gets the umask's mode and is fsynced first. An existing `target` is moved aside to
    `.<name>.old-<pid>` and deleted only once the new copy is in place, so a kill at any moment leaves one
    complete copy under one of the two names (`spes.checkpoint` knows where to look).
    """
    staged, target = Path(staged), Path(target)
    follow_umask(staged)
    for p in staged.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    if target.exists():
        aside = target.parent / f".{target.name}{ASIDE}{os.getpid()}"
        os.replace(target, aside)
        os.replace(staged, target)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(staged, target)
    fsync_dir(target.parent)


@contextlib.contextmanager
def staging_dir(target: str | os.PathLike[str]) -> Iterator[Path]:
    """A fresh temporary sibling of `target` to fill: published as `target` when the block succeeds, deleted
    when it raises (then `target` is untouched)."""
    target = Path(target)
    staged = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    try:
        yield staged
        publish_dir(staged, target)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise


HOLDER_BYTES = 128
"""The most of a lock file a refusal reads: "pid <pid> on <host>" with a host name of up to 64 bytes fits."""


def lock_holder() -> str:
    """What `hold_lock` writes in its file: this process as a refusal names it."""
    return f"pid {os.getpid()} on {socket.gethostname()}"


class LockHeld(Exception):
    """Another live process holds a `hold_lock` lock; `holder` is what it wrote there ("pid <pid> on <host>"; ''
    when unknown)."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


def hold_lock(path: str | os.PathLike[str]) -> int:
    """An exclusive `flock` on the file `path` (created as needed) for one process that must be alone in a directory,
    held on the returned descriptor until it is closed or the process ends (SIGKILL included: a dead holder never
    blocks a restart); this process's pid and host are written in it for a refusal to name (on a shared filesystem
    the holder may be another machine). LockHeld when another process holds it; OSError when the file cannot be
    opened or the filesystem cannot lock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, HOLDER_BYTES, 0).decode(errors="replace").strip()
        os.close(fd)
        raise LockHeld(holder) from None
    except OSError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{lock_holder()}\n".encode()[:HOLDER_BYTES], 0)
    return fd
