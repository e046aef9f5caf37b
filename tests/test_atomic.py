import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from disk_helpers import cap_file_size, print_failure, run_child
from spes.atomic import (
    LockHeld,
    OutOfRoom,
    hold_lock,
    leftover_temps,
    lock_holder,
    room_for,
    staging_dir,
    write_atomic,
)


def test_bytes_text_and_writer_functions_all_land_whole(tmp_path: Path) -> None:
    write_atomic(tmp_path / "a" / "b" / "c.bin", b"\x00\x01")
    write_atomic(tmp_path / "t.txt", "héllo\n")
    write_atomic(tmp_path / "f.txt", lambda tmp: Path(tmp).write_text("from a writer"))
    assert (tmp_path / "a" / "b" / "c.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "t.txt").read_text(encoding="utf-8") == "héllo\n"
    assert (tmp_path / "f.txt").read_text() == "from a writer"
    assert (tmp_path / "t.txt").stat().st_mode & 0o777 == 0o644


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    write_atomic(target, "old")

    def crash(tmp: str) -> None:
        Path(tmp).write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, crash)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]

    def gone(tmp: str) -> None:  # a writer that removed its temporary file itself: its own error is the one raised
        Path(tmp).unlink()
        raise OSError("writer failed")

    with pytest.raises(OSError, match="writer failed"):
        write_atomic(target, gone)


def test_the_temporary_file_is_hidden_beside_the_target(tmp_path: Path) -> None:
    """In the target's directory (so the rename is atomic: one file system), named after it."""
    seen: list[Path] = []
    write_atomic(tmp_path / "run" / "state.json", lambda tmp: seen.append(Path(tmp)))
    [tmp] = seen
    assert tmp.parent == tmp_path / "run" and tmp.name.startswith(".state.json.") and tmp.name.endswith(".tmp")


def test_a_write_killed_outright_leaves_its_temp_file_which_leftover_temps_finds(tmp_path: Path) -> None:
    """A process killed mid-write runs no cleanup: its temp file stays, found by the target's name pattern only."""
    target = tmp_path / "part_00001.json"
    killed = "import os, sys; from spes.atomic import write_atomic; write_atomic(sys.argv[1], lambda tmp: os._exit(9))"
    assert subprocess.run([sys.executable, "-c", killed, str(target)], timeout=60).returncode == 9  # as SIGKILL
    (left,) = tmp_path.iterdir()
    assert not target.exists() and leftover_temps(tmp_path, "part_0000[0-9].json") == [left]
    assert leftover_temps(tmp_path, "part_0000[0-9].npy") == [] == leftover_temps(tmp_path, "other")


def test_files_get_the_umask_mode_like_open(tmp_path: Path) -> None:
    """Checkpoints, exports and logs must be readable by whom the user's umask allows (not mkstemp's 0600)."""
    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "ckpt.json", "{}")
        (tmp_path / "plain.json").write_text("{}")
    finally:
        os.umask(old)
    assert (tmp_path / "ckpt.json").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "plain.json").stat().st_mode & 0o777 == 0o640


def test_a_staged_directory_replaces_the_old_one_whole_or_not_at_all(tmp_path: Path) -> None:
    target = tmp_path / "export"
    with staging_dir(target) as staged:
        (staged / "a.txt").write_text("first")
    with pytest.raises(OSError, match="disk full"), staging_dir(target) as staged:
        (staged / "a.txt").write_text("half")
        raise OSError("disk full")
    assert (target / "a.txt").read_text() == "first"
    with staging_dir(target) as staged:
        (staged / "b.txt").write_text("second")
        (staged / "sub").mkdir()
        (staged / "sub" / "c.bin").write_bytes(b"")
        (staged / "sub" / "c.bin").chmod(0o600)  # as safetensors' save_file makes its files
    assert sorted(p.name for p in target.iterdir()) == ["b.txt", "sub"]
    assert (target / "sub" / "c.bin").stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temporary or moved-aside copy left
    assert (target / "b.txt").stat().st_mode & 0o777 == 0o644


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_lock_is_one_holders_who_writes_its_pid_and_a_second_is_refused_naming_it(tmp_path: Path) -> None:
    """flock is per open file: a second `hold_lock` of the same file, in this process too, is refused while the
    first descriptor is open; closing it (or the holder's death) frees the lock."""
    lock = tmp_path / "server.lock"
    lock.write_text("x" * 200)  # a longer line of a holder long gone
    fd = hold_lock(lock)
    assert lock.read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n" == f"{lock_holder()}\n"
    os.pwrite(fd, b"\xff" + b"7" * 200, 0)  # what a refusal reads: 128 bytes at most, undecodable ones replaced
    before = _open_fds()
    with pytest.raises(LockHeld) as refused:
        hold_lock(lock)
    assert refused.value.holder == "\ufffd" + "7" * 127 and str(refused.value) == refused.value.holder
    assert _open_fds() == before  # the refused attempt's descriptor closed
    os.close(fd)
    os.close(hold_lock(lock))  # free again


def test_a_fresh_lock_file_is_created_and_a_filesystem_that_cannot_lock_raises_without_leaking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    umask = os.umask(0o022)  # the usual one, under which the mode asked for shows
    try:
        fd = hold_lock(tmp_path / "new.lock")
    finally:
        os.umask(umask)
    assert (tmp_path / "new.lock").read_text() == f"{lock_holder()}\n"
    assert (tmp_path / "new.lock").stat().st_mode & 0o777 == 0o644
    os.close(fd)

    def unlockable(_fd: int, _op: int) -> None:
        raise OSError(37, "No locks available")

    monkeypatch.setattr("spes.atomic.fcntl.flock", unlockable)
    before = _open_fds()
    with pytest.raises(OSError, match="No locks available"):
        hold_lock(tmp_path / "nfs.lock")
    assert _open_fds() == before


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_running_out_of_room_becomes_one_error_naming_what_and_the_fix(code: int) -> None:
    """Any errno of no room, raised by Python or named in a library's own error text (safetensors': a Rust I/O error),
    becomes one OutOfRoom whose message is the whole line a user needs; its errno is kept."""
    library = RuntimeError(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")
    for error in (OSError(code, os.strerror(code)), library):
        with pytest.raises(OutOfRoom) as caught, room_for("cannot write x in /d", "free space there"):
            raise error
        assert caught.value.errno == code and isinstance(caught.value, OSError)
        assert str(caught.value) == f"cannot write x in /d: {os.strerror(code).lower()}; free space there"
    for other in (PermissionError(errno.EACCES, "Permission denied"), RuntimeError("(os error 13)"), ValueError("x")):
        with pytest.raises(type(other)) as passed, room_for("cannot write x", "free space"):
            raise other
        assert passed.value is other


def _write_past_a_size_limit(target: str) -> None:
    """Child of the test below: safetensors writes a file past this process's file-size limit."""
    import numpy as np
    from safetensors.numpy import save_file

    cap_file_size(4096)
    try:
        write_atomic(target, lambda tmp: save_file({"x": np.zeros(4096)}, tmp))
    except BaseException as e:  # noqa: BLE001 -- the test judges it
        print_failure(e)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_library_writer_that_finds_no_room_fails_as_an_oserror_of_the_target(tmp_path: Path) -> None:
    """A writer function whose library reports a full disk in its own exception (safetensors' SafetensorError) fails
    `write_atomic` as the OSError it stands for, so callers that handle a full disk (the server's round) handle it."""
    target = tmp_path / "round-10.safetensors"
    proc, failure = run_child(f"import test_atomic; test_atomic._write_past_a_size_limit({str(target)!r})")
    assert failure == {
        "type": "OSError",
        "errno": errno.EFBIG,
        "message": f"[Errno {errno.EFBIG}] File too large: '{target}'",
    }, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_writer_functions_library_error_naming_an_errno_is_raised_as_the_targets_oserror(tmp_path: Path) -> None:
    """In process (the test above meets a real limit in a child): a library's error that names an errno in its text
    becomes the OSError of the target with that errno and its text, caused by the library's error; an OSError, or an
    error naming no errno, is raised as it was."""
    target = tmp_path / "round-10.safetensors"
    library = RuntimeError(f"I/O error: {os.strerror(errno.ENOSPC)} (os error {errno.ENOSPC})")

    def fails_with(error: BaseException):  # type: ignore[no-untyped-def]
        def writer(tmp: str) -> None:
            raise error

        return writer

    with pytest.raises(OSError) as caught:
        write_atomic(target, fails_with(library))
    assert type(caught.value) is OSError and caught.value.__cause__ is library
    assert (caught.value.errno, caught.value.strerror, caught.value.filename) == (
        errno.ENOSPC,
        os.strerror(errno.ENOSPC),
        str(target),
    )
    for other in (OSError(errno.ENOSPC, "No space left on device"), RuntimeError("safetensors: bad dtype")):
        with pytest.raises(type(other)) as passed:
            write_atomic(target, fails_with(other))
        assert passed.value is other
    assert list(tmp_path.iterdir()) == []
