"""Hub ids through spes.hub: local path first, then a Hub cache the test lays out under HF_HOME; never the network."""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from hf_fixtures import CASES, UPCYCLE_TINY, cache_repo, make_checkpoint, tokenizer_overrides
from spes import hf_convert, hub, upcycle
from spes.checkpoint import load_model_state
from spes.tokenizer import LoadedTokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "hf_home"
    home.mkdir()
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return home


def test_tokenizer_identifier_from_the_hub_cache(hf_home: Path, tokenizer: LoadedTokenizer) -> None:
    snapshot = cache_repo(hf_home, "Qwen/Qwen2.5-0.5B", tokenizer.path.parent)
    loaded = load_tokenizer("Qwen/Qwen2.5-0.5B")
    assert loaded.path == snapshot / "tokenizer.json" and loaded.fingerprint == tokenizer.fingerprint


def test_local_path_comes_before_the_cache(
    hf_home: Path, tokenizer: LoadedTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_repo(hf_home, "org/tok", tokenizer.path.parent)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tokenizer.path.parent, tmp_path / "org" / "tok")
    assert load_tokenizer("org/tok").path == Path("org/tok/tokenizer.json")


def test_offline_and_not_cached_names_the_id(hf_home: Path) -> None:
    with pytest.raises(
        FileNotFoundError,
        match=r"^tokenizer 'Qwen/NotCached' is not a local path and not in the Hugging Face cache .*, and "
        r"HF_HUB_OFFLINE=1 forbids downloading it: run once online \(or `hf download Qwen/NotCached`\), set HF_HOME",
    ):
        load_tokenizer("Qwen/NotCached")
    with pytest.raises(FileNotFoundError, match=r"--hf 'org/missing-model'.*HF_HUB_OFFLINE=1"):
        hf_convert.import_hf("org/missing-model", hf_home / "out" / "step0")


def test_an_id_whose_first_part_is_a_local_folder_is_named_as_a_mistyped_path_too(
    hf_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`output/tiny_densX` is a mistyped `output/tiny_dense` likelier than a Hub id: told only to download it from
    the Hub, a user looked in the wrong place."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "output").mkdir()
    with pytest.raises(
        FileNotFoundError,
        match=r"^tokenizer 'output/tiny_densX' \(output/ is a local folder without 'tiny_densX': a mistyped path\?\) "
        r"is not a local path and not in the Hugging Face cache ",
    ):
        load_tokenizer("output/tiny_densX")
    assert hub.mistyped_path("Qwen/Qwen2.5") == "" and hub.mistyped_path("gpt2") == ""  # no folder `Qwen` here
    assert hub.mistyped_path("output/a/b") == " (output/ is a local folder without 'a/b': a mistyped path?)"


def test_a_cached_tokenizer_is_not_taken_for_the_model(
    hf_home: Path, tmp_path: Path, tokenizer: LoadedTokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    """A snapshot another tool filled partly (the tokenizer of Qwen/Qwen3-1.7B, as tokenizer.identifier fetches it,
    or transformers' AutoTokenizer) was returned as the model: `spes.upcycle --hf` then said the cache's snapshot
    "is not a Hugging Face model directory" and never downloaded the rest, online too."""
    snapshot = cache_repo(hf_home, "Qwen/Qwen3-1.7B", tokenizer.path.parent)
    assert hub.resolve_tokenizer("Qwen/Qwen3-1.7B") == snapshot
    argv = ["--hf", "Qwen/Qwen3-1.7B", "--config", UPCYCLE_TINY, "--out", str(tmp_path / "init" / "step0")]
    assert upcycle.main([*argv, *tokenizer_overrides(tokenizer)]) == 2
    assert capsys.readouterr().err == (
        f"error: --hf 'Qwen/Qwen3-1.7B' is not a local path and cached without config.json ({snapshot}), and "
        "HF_HUB_OFFLINE=1 forbids downloading it: run once online (or `hf download Qwen/Qwen3-1.7B`), set HF_HOME "
        "to the cache that holds it, or pass a local directory\n"
    )
    (snapshot / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"cached without model\.safetensors \("):
        hub.resolve("Qwen/Qwen3-1.7B", what="--hf")  # a config without weights
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")
    cache_repo(hf_home, "org/config-only", config_only)
    with pytest.raises(FileNotFoundError, match=r"^tokenizer 'org/config-only' .* cached without tokenizer\.json \("):
        hub.resolve_tokenizer("org/config-only")
    (snapshot / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    (snapshot / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"cached without model-00002-of-00002\.safetensors \("):
        hub.resolve("Qwen/Qwen3-1.7B", what="--hf")
    (snapshot / "model-00002-of-00002.safetensors").write_bytes(b"")
    assert hub.resolve("Qwen/Qwen3-1.7B", what="--hf") == snapshot
    assert hub.missing_model_file(tmp_path) == "config.json"


@pytest.mark.parametrize(
    ("endpoint", "address"),
    [
        (None, ("huggingface.co", 443)),
        ("", ("huggingface.co", 443)),
        ("https://hf-mirror.com", ("hf-mirror.com", 443)),
        ("http://mirror.lan", ("mirror.lan", 80)),
        ("http://127.0.0.1:8080/", ("127.0.0.1", 8080)),
        ("mirror.lan", ("huggingface.co", 443)),  # no scheme, so no host: not an endpoint huggingface_hub can use
    ],
)
def test_the_probe_dials_the_endpoints_host_and_port(endpoint: str | None, address: tuple[str, int]) -> None:
    assert hub.endpoint_address(endpoint) == address


def test_a_hub_endpoint_that_accepts_a_connection_is_reachable(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{listener.getsockname()[1]}")
        assert hub.hub_reachable()


def test_the_probe_waits_three_seconds_for_the_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """A blackholed address (a firewall dropping the SYN) answers nothing: the probe gives up after its timeout."""
    dialed = []

    def no_answer(address: tuple[str, int], timeout: float) -> socket.socket:
        dialed.append((address, timeout))
        raise TimeoutError("timed out")

    monkeypatch.setattr(hub.socket, "create_connection", no_answer)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    assert not hub.hub_reachable()
    assert dialed == [(("huggingface.co", 443), 3.0)]


def test_unreachable_hub_is_an_immediate_error(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    assert not hub.hub_reachable()
    with pytest.raises(
        FileNotFoundError, match="'org/tok' is not a local path.*, and the Hub is not reachable from here: "
    ):
        hub.resolve("org/tok", what="tokenizer")


def test_paths_that_are_not_ids_are_named(hf_home: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer './no/such/dir' is not a local file or directory"):
        load_tokenizer("./no/such/dir")
    assert hub.looks_like_repo_id("Qwen/Qwen3-1.7B") and hub.looks_like_repo_id("gpt2")
    assert not hub.looks_like_repo_id("../x/y") and not hub.looks_like_repo_id("/abs/path")
    assert not hub.looks_like_repo_id("org/a..b")  # the Hub allows no '..' in a name: a path, then


def test_a_relative_path_not_found_says_from_which_working_directory(
    hf_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started in another folder, configs/tiny.yaml's data/default/tokenizer "is not a local file or directory", not
    saying where it was looked for; an absolute path needs no word of it."""
    elsewhere = tmp_path / "else where ü"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(FileNotFoundError) as err:
        hub.resolve("data/default/tokenizer", what="tokenizer.identifier")
    assert str(err.value).startswith(
        f"tokenizer.identifier 'data/default/tokenizer' is not a local file or directory under the working directory "
        f"{elsewhere} (and not a Hugging Face Hub id"
    )
    with pytest.raises(FileNotFoundError, match=r"^tokenizer '/no/such/tok' is not a local file or directory \(and"):
        hub.resolve("/no/such/tok", what="tokenizer")


def test_an_id_without_huggingface_hub_installed_says_which_extra_to_install(
    hf_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # what `import huggingface_hub` meets without it
    with pytest.raises(FileNotFoundError) as err:
        hub.resolve("org/tok", what="--hf")
    assert str(err.value) == (
        "--hf 'org/tok' is not a local path; reading it from the Hugging Face Hub needs huggingface_hub "
        "(pip install -e '.[hf]')"
    )


def test_hf_import_from_a_hub_id(hf_home: Path, tmp_path: Path, tokenizer: LoadedTokenizer) -> None:

    step_dir, _ = make_checkpoint(tmp_path / "run", tokenizer, CASES["olmoe"][0])
    exported = hf_convert.export_checkpoint(step_dir, tmp_path / "exported")
    cache_repo(hf_home, "allenai/Tiny-OLMoE", exported)
    back = hf_convert.import_hf("allenai/Tiny-OLMoE", tmp_path / "back" / "step0", num_train_experts_per_node=2)
    before, after = load_model_state(step_dir), load_model_state(back)
    assert set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before)


def test_upcycle_from_a_hub_id(
    hf_home: Path, tmp_path: Path, tokenizer: LoadedTokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    config = UPCYCLE_TINY
    overrides = tokenizer_overrides(tokenizer)
    assert (
        upcycle.main(["--config", config, "--hf", str(tmp_path / "dense"), "--make_random_dense", "qwen3", *overrides])
        == 0
    )
    cache_repo(hf_home, "Qwen/Tiny-Dense", tmp_path / "dense")
    out = tmp_path / "init" / "step0"
    assert upcycle.main(["--config", config, "--hf", "Qwen/Tiny-Dense", "--out", str(out), *overrides]) == 0
    assert "equals the dense model at step 0" in capsys.readouterr().out
    assert (
        upcycle.main(["--config", config, "--hf", "Qwen/Not-There", "--out", str(tmp_path / "x" / "step0"), *overrides])
        == 2
    )
    assert "'Qwen/Not-There' is not a local path" in capsys.readouterr().err


def test_the_cache_dir_is_where_huggingface_hub_looks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub.hub_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", "~/hf")
    assert hub.hub_cache_dir() == tmp_path / "home" / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", "~/cache")
    assert hub.hub_cache_dir() == tmp_path / "home" / "cache"


@pytest.mark.parametrize(("value", "offline"), [("1", True), (" True ", True), ("on", True), ("0", False), ("", False)])
def test_hf_hub_offline_is_read_as_huggingface_hub_reads_it(
    value: str, offline: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    assert hub.hub_offline() is offline


class _NoSuchRepo(BaseHTTPRequestHandler):
    """A Hub endpoint on loopback that knows no repository (what huggingface.co answers for a mistyped id)."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        body = b'{"error": "Repository not found"}'
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def loopback_hub(
    handler: type[BaseHTTPRequestHandler], hf_home: Path
) -> Iterator[tuple[ThreadingHTTPServer, dict[str, str]]]:
    """A Hub endpoint on loopback answering as `handler` (the paths asked in `server.paths`), and the environment of
    a child process that asks it (HF_ENDPOINT) with its cache under `hf_home`."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.paths = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {
        "HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
        "HF_HOME": str(hf_home),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    try:
        yield server, env
    finally:
        server.shutdown()
        server.server_close()


def run_python(code: str, env: dict[str, str], *args: str, timeout: float = 100) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.timeout(120)
def test_an_id_the_hub_does_not_know_is_named_with_what_to_check(tmp_path: Path) -> None:
    """The online path, against a Hub endpoint on loopback (HF_ENDPOINT): reachable, the id unknown there."""
    code = (
        "from spes import hub\nprint(hub.hub_reachable())\n"
        "try:\n    hub.resolve('org/absent', what='tokenizer.identifier')\n"
        "except FileNotFoundError as err:\n    print(repr(str(err)))"
    )
    with loopback_hub(_NoSuchRepo, tmp_path / "hf_home") as (server, env):
        out = run_python(code, env)
    reachable, line = out.stdout.strip().splitlines()
    assert reachable == "True" and out.returncode == 0, out.stderr
    asked = server.paths  # type: ignore[attr-defined]
    assert len(asked) == 1 and "org/absent" in asked[0], asked  # the cache is looked up offline first, then one ask
    error = ast.literal_eval(line)
    assert "\n" not in error  # one line, the Hub's own first
    assert error.startswith(
        "tokenizer.identifier 'org/absent' is not a local path, not in the Hugging Face cache "
        f"{tmp_path / 'hf_home' / 'hub'}, and could not be downloaded (RepositoryNotFoundError: "
    ), error
    assert error.endswith("); check the id, your network and HF_TOKEN, or pass a local directory"), error
    assert "404" in error.partition("(RepositoryNotFoundError: ")[2], error  # the Hub's own first line


HUB_SHA = "0123456789abcdef0123456789abcdef01234567"
HUB_FILES = {"tokenizer.json": b'{"version": "1.0"}', "config.json": b"{}", "pytorch_model.bin": b"pickled weights"}


class _OneRepo(BaseHTTPRequestHandler):
    """A Hub endpoint on loopback holding one repository, `org/tiny` at commit HUB_SHA, with HUB_FILES: the calls
    huggingface_hub's snapshot_download makes (the revision's info, its file tree, each file's metadata and bytes)."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.paths.append(f"{self.command} {self.path}")  # type: ignore[attr-defined]
        path = self.path.partition("?")[0]
        if path == "/api/models/org/tiny/revision/main":
            body = json.dumps({"id": "org/tiny", "sha": HUB_SHA, "siblings": [{"rfilename": f} for f in HUB_FILES]})
            return self._send(body.encode(), "application/json")
        if path == f"/api/models/org/tiny/tree/{HUB_SHA}":
            tree = [{"type": "file", "oid": _digest(b), "size": len(b), "path": f} for f, b in HUB_FILES.items()]
            return self._send(json.dumps(tree).encode(), "application/json")
        name = path.removeprefix(f"/org/tiny/resolve/{HUB_SHA}/")
        if name in HUB_FILES:
            return self._send(HUB_FILES[name], "application/octet-stream", {"X-Repo-Commit": HUB_SHA})
        self.send_error(404)

    def do_HEAD(self) -> None:  # noqa: N802
        self.do_GET()

    def _send(self, body: bytes, kind: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", f'"{_digest(body)}"')
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _digest(body: bytes) -> str:
    return hashlib.sha1(body).hexdigest()  # noqa: S324 (git's blob id scheme, not security)


@pytest.mark.timeout(120)
def test_a_hub_id_is_downloaded_once_into_the_cache_with_only_the_files_spes_reads(tmp_path: Path) -> None:
    """The online path's success, against a Hub endpoint on loopback (HF_ENDPOINT): the tokenizer's files land in
    the Hugging Face cache under HF_HOME (never the pickled weights beside them); a second resolve reads the cache
    without asking the Hub again, and so does one offline (HF_HUB_OFFLINE=1); the cache is the one HF_HOME names when
    spes resolves, though huggingface_hub was imported before it was set. With huggingface_hub 2.x the cache
    lookup that named no files found the snapshot incomplete (the files spes does not read were never fetched),
    so every later resolve asked the Hub, and offline the id was refused as not cached."""
    code = (
        "import os, sys\nimport huggingface_hub.constants\nfrom spes import hub\n"
        f"os.environ['HF_HOME'] = {str(tmp_path / 'hf_home')!r}  # as a launcher sets it, after the import\n"
        "for _ in range(int(sys.argv[1])):\n"
        "    path = hub.resolve_tokenizer('org/tiny')\n"
        "    print(path, sorted(p.name for p in path.iterdir()))"
    )

    # NOTE: HF_HOME is read by huggingface_hub at its import, by spes when it resolves
    with loopback_hub(_OneRepo, tmp_path / "decoy") as (server, env):

        def resolved(times: int, **more: str) -> list[str]:
            out = run_python(code, env | more, str(times), timeout=50)
            assert out.returncode == 0, out.stderr
            return out.stdout.splitlines()

        online = resolved(2)
        asked = list(server.paths)  # type: ignore[attr-defined]
        offline = resolved(1, HF_HUB_OFFLINE="1")
    snapshot = tmp_path / "hf_home" / "hub" / "models--org--tiny" / "snapshots" / HUB_SHA
    assert online + offline == [f"{snapshot} ['tokenizer.json']"] * 3
    assert (snapshot / "tokenizer.json").read_bytes() == HUB_FILES["tokenizer.json"]
    assert [p.partition("?")[0] for p in asked] == [
        "GET /api/models/org/tiny/revision/main",
        f"GET /api/models/org/tiny/tree/{HUB_SHA}",
        f"HEAD /org/tiny/resolve/{HUB_SHA}/tokenizer.json",
        f"GET /org/tiny/resolve/{HUB_SHA}/tokenizer.json",
    ]
    assert server.paths == asked  # type: ignore[attr-defined]  # nothing asked offline
    assert not (tmp_path / "decoy").exists()


@pytest.mark.timeout(120)
def test_a_model_cached_in_part_is_completed_from_the_hub(hf_home: Path) -> None:
    """Online, a snapshot holding only the tokenizer (laid out by another tool, so huggingface_hub keeps no file
    list to find it incomplete) gets the model's files downloaded into it, instead of being returned without them."""
    snapshot = cache_repo(hf_home, "org/tiny", _tokenizer_only(hf_home.parent / "tok"))
    assert snapshot.name == HUB_SHA
    with loopback_hub(_OneRepo, hf_home) as (_, env):
        out = run_python("from spes import hub\nprint(hub.resolve('org/tiny', what='--hf'))", env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(snapshot)
    assert (snapshot / "config.json").read_bytes() == HUB_FILES["config.json"]
    assert not (snapshot / "pytorch_model.bin").exists()


def _tokenizer_only(folder: Path) -> Path:
    """A folder holding HUB_FILES' tokenizer.json alone."""
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(HUB_FILES["tokenizer.json"])
    return folder
