import os
from pathlib import Path

import pytest

from spes.atomic import staging_dir, write_atomic


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
