from pathlib import Path

import grpc
import pytest

from spes.sync.auth import check_peer_identity, read_token, token_matches
from spes.sync.protocol import Refused


def test_token_matches_only_the_exact_secret() -> None:
    assert token_matches("s3cret", "s3cret") and token_matches(None, None) and token_matches("anything", None)
    assert not token_matches("s3cre", "s3cret") and not token_matches(None, "s3cret")
    assert not token_matches(b"s3cret", "s3cret")  # not a str: refused, never decoded


def test_read_token_from_file_then_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPES_TOKEN", raising=False)
    assert read_token(None, "--token_file") is None
    monkeypatch.setenv("SPES_TOKEN", "from-env")
    assert read_token(None, "--token_file") == "from-env"
    secret = tmp_path / "token"
    secret.write_text("from-file\n")
    assert read_token(str(secret), "--token_file") == "from-file"
    secret.write_text("  \n")
    with pytest.raises(ValueError, match="config key 'spes_config.token_file' .* is empty"):
        read_token(str(secret), "config key 'spes_config.token_file'")
    with pytest.raises(FileNotFoundError, match="--token_file .*nope"):
        read_token(str(tmp_path / "nope"), "--token_file")


@pytest.mark.parametrize(
    ("claimed", "common_name", "ok"),
    [
        (0, "peer-0", True),
        (12, "peer-12", True),
        (1, "peer-0", False),
        (0, None, False),
        (0, "client", False),
        (0, "peer-0x", False),
        (0, "xpeer-0", False),
    ],
)
def test_a_peer_may_only_act_as_the_peer_its_certificate_names(claimed: int, common_name: str | None, ok: bool) -> None:
    if ok:
        check_peer_identity(claimed, common_name)
        return
    with pytest.raises(Refused) as err:
        check_peer_identity(claimed, common_name)
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and f"'peer-{claimed}'" in str(err.value)


def test_a_token_file_others_can_read_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    assert read_token(str(secret), "--token_file") == "s3cret" and "chmod" not in caplog.text
    secret.chmod(0o644)
    assert read_token(str(secret), "--token_file") == "s3cret"
    assert f"--token_file {secret} is readable by group or others: run `chmod 600 {secret}`" in caplog.text
