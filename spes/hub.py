"""Hugging Face Hub ids wherever spes takes a tokenizer or model directory.

`tokenizer.identifier`, `spes.upcycle --hf` and `spes.hf import --hf` accept either a local path or a
Hub id such as `Qwen/Qwen2.5-0.5B`, resolved the way `transformers` users expect:

1. a local file or directory of that name;
2. the local Hub cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`), laid out
   as `models--<org>--<name>/{refs/main, snapshots/<rev>/...}`, when its snapshot holds what is read (a model's
   config.json and safetensors weights, a tokenizer's tokenizer.json: another tool may have fetched only a part);
3. a download into that cache, unless `HF_HUB_OFFLINE=1` (or the Hub does not answer).

Only the files spes reads are fetched (JSON, safetensors, tokenizer files: never pickled weights).
The environment is read at call time, so a test or a launcher may set `HF_HOME` after import.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlparse

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)
MODEL_FILES = ("*.json", "*.safetensors", "*.txt", "*.jinja")
DEFAULT_ENDPOINT = "https://huggingface.co"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_TRUE = {"1", "true", "yes", "on"}


def hub_offline() -> bool:
    """Whether `HF_HUB_OFFLINE` forbids downloads (read now, not at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def endpoint_address(endpoint: str | None) -> tuple[str, int]:
    """The (host, port) a connection to the Hub endpoint `endpoint` (`HF_ENDPOINT`; None: huggingface.co) dials:
    the URL's port, else its scheme's (a mirror at `http://host` listens on 80)."""
    url = urlparse(endpoint or DEFAULT_ENDPOINT)
    return url.hostname or urlparse(DEFAULT_ENDPOINT).netloc, url.port or (80 if url.scheme == "http" else 443)


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hub endpoint (`HF_ENDPOINT`, default huggingface.co) accepts a TCP connection now.

    A quick probe, so that a machine without internet gets an immediate answer instead of minutes of
    retries inside `huggingface_hub` / `datasets`.
    """
    try:
        socket.create_connection(endpoint_address(os.environ.get("HF_ENDPOINT")), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def hub_cache_dir() -> Path:
    """The Hub cache `huggingface_hub` uses with the current environment."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def looks_like_repo_id(identifier: str) -> bool:
    """`org/name` (or a bare canonical name like `gpt2`), not a path."""
    return bool(_REPO_ID.match(identifier)) and not identifier.startswith((".", "~")) and ".." not in identifier


def mistyped_path(identifier: str) -> str:
    """A hint for an id whose first part is a local folder (`output/tiny_densX`): likelier a mistyped path than a Hub
    id, and told to download it from the Hub, the user looks in the wrong place."""
    folder, _, rest = identifier.partition("/")
    if not rest or not Path(folder).expanduser().is_dir():
        return ""
    return f" ({folder}/ is a local folder without {rest!r}: a mistyped path?)"


def missing_model_file(snapshot: Path) -> str | None:
    """The first file a model directory lacks for spes to read it (config.json, then its safetensors weights), or
    None: a cached snapshot that another tool filled only partly (a tokenizer, a config) is not the model."""
    if not (snapshot / "config.json").is_file():
        return "config.json"
    index = snapshot / "model.safetensors.index.json"
    if not index.is_file():
        return None if (snapshot / "model.safetensors").is_file() else "model.safetensors"
    try:
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # read_hf_weights names what is wrong with the index
    return next((shard for shard in shards if not (snapshot / shard).is_file()), None)


def missing_tokenizer_file(snapshot: Path) -> str | None:
    """tokenizer.json when a tokenizer directory lacks it (spes reads fast tokenizers only), else None."""
    return None if (snapshot / "tokenizer.json").is_file() else "tokenizer.json"


def resolve(
    identifier: str | os.PathLike[str],
    *,
    what: str,
    files: Sequence[str] = MODEL_FILES,
    missing: Callable[[Path], str | None] = missing_model_file,
) -> Path:
    """A local path for `identifier`: the path itself, its Hub cache snapshot, or a fresh download.

    `what` names the thing in errors (e.g. "tokenizer.identifier"); `files` are the glob patterns
    downloaded; a cached snapshot for which `missing` names a file is completed by a download (huggingface_hub
    returns a snapshot that holds any of the repository's files). FileNotFoundError naming the id and the cache
    when it is neither local, cached (whole) nor reachable.
    """
    path = Path(identifier).expanduser()
    if path.exists():
        return path
    name = str(identifier)
    if not looks_like_repo_id(name):
        where = "" if path.is_absolute() else f" under the working directory {Path.cwd()}"  # NOTE: started elsewhere
        raise FileNotFoundError(
            f"{what} {name!r} is not a local file or directory{where} (and not a Hugging Face Hub id like 'org/name')"
        )
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(
            f"{what} {name!r} is not a local path; reading it from the Hugging Face Hub needs "
            f"huggingface_hub (pip install -e '.[hf]')"
        ) from None
    cache = hub_cache_dir()
    try:
        cached: Path | None = Path(
            snapshot_download(name, cache_dir=cache, allow_patterns=list(files), local_files_only=True)
        )
    except Exception:  # noqa: BLE001  # LocalEntryNotFoundError, or an incomplete cache entry
        cached = None
    lacking = missing(cached) if cached is not None else None
    if cached is not None and lacking is None:
        return cached
    if hub_offline() or not hub_reachable():
        why = "HF_HUB_OFFLINE=1 forbids downloading it" if hub_offline() else "the Hub is not reachable from here"
        where = f"not in the Hugging Face cache {cache}" if cached is None else f"cached without {lacking} ({cached})"
        raise FileNotFoundError(
            f"{what} {name!r}{mistyped_path(name)} is not a local path and {where}, and {why}: run once "
            f"online (or `hf download {name}`), set HF_HOME to the cache that holds it, or pass a local directory"
        )
    try:
        return Path(snapshot_download(name, cache_dir=cache, allow_patterns=list(files)))
    except Exception as err:  # noqa: BLE001  # network, auth and not-found errors all mean the same to the user
        first_line = str(err).partition("\n")[0]
        raise FileNotFoundError(
            f"{what} {name!r}{mistyped_path(name)} is not a local path, not in the Hugging Face cache {cache}, and "
            f"could not be downloaded ({type(err).__name__}: {first_line}); check the id, your network and HF_TOKEN, "
            "or pass a local directory"
        ) from None


def resolve_tokenizer(identifier: str | os.PathLike[str], what: str = "tokenizer") -> Path:
    """`resolve` for a tokenizer: only its own files are downloaded, never the weights beside them in a model repo."""
    return resolve(identifier, what=what, files=TOKENIZER_FILES, missing=missing_tokenizer_file)
