"""The parameter server's settings and its command line: the run spec (`spes.sync.spec`) and the deployment's
(`DeployConfig`).

What the run is comes from the run's YAML through `run_spec`, like on every node. How this server process is
deployed (interface, ports, TLS, token, state directory, limits) are its command-line flags, generated from the
fields of `DeployConfig` (name, default, help): one place per setting.

Nothing here imports torch (tests/test_startup.py): `python -m spes.server --help`, a mistyped flag, a config key
the run does not have or a flag value that cannot serve answer at once, before `spes.sync.server` (torch, gRPC's
server, the round service) is imported for a command that holds (`command_from_args`).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import sys
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from spes.cli import ArgumentParser, DefaultsHelpFormatter
from spes.config import ServerSection, SpesConfig, TrainConfig, load_config, load_sync_sections
from spes.schema import config_help
from spes.sync.admission import MAX_MODEL_GB, MAX_TENSORS
from spes.sync.auth import TOKEN_ENV, read_token
from spes.sync.channel import check_key_pair
from spes.sync.protocol import Mode

if TYPE_CHECKING:
    from spes.sync.spec import RunSpec  # NOTE: a name only: spec imports torch, and this module must not

FILE_RESERVE = 64
"""Descriptors kept for the server's own use: listeners, gRPC's event fds, logs, the round files it writes (an
idle server with two joined peers holds 11)."""


def _flag(default: Any, group: str, doc: str, **extra: Any) -> Any:
    return field(default=default, metadata={"group": group, "doc": doc, **extra})


@dataclass(frozen=True, kw_only=True)
class DeployConfig:
    """How one server process serves its run; each field is the flag `--<name>` (`--help` shows them)."""

    host: str = _flag("0.0.0.0", "network", "interface to bind")
    port: int = _flag(50051, "network", "gRPC port (0: let the OS choose; the log says which)")
    data_port: int = _flag(
        -1,
        "network",
        "TCP port of the raw data plane for tensor payloads, several times faster than gRPC (0: let the OS choose, "
        "advertised to peers at Join; -1: disabled, tensors go over gRPC)",
    )
    max_message_mb: int = _flag(4, "network", "gRPC message size limit (MiB): chunks are 1 MiB")
    state_dir: str | None = _flag(None, "run", "persist every completed round here (atomically), resume from it")
    stream_idle_timeout: float = _flag(
        60.0,
        "limits",
        "seconds: close an upload/download stream (either plane) that sends nothing this long (DEADLINE_EXCEEDED); "
        "its partial upload is dropped",
    )
    min_stream_rate: float = _flag(
        64.0,
        "limits",
        "KiB/s a stream that moves bytes (an upload, a download, a link test) must average once "
        "--stream_idle_timeout has passed (slower: closed, an upload dropped)",
    )
    handshake_timeout: float = _flag(
        10.0,
        "limits",
        "seconds: a connection must complete its handshake within this long (TLS, then the HTTP/2 preface on the "
        "gRPC port, the hello on the data plane), or it is closed",
    )
    max_connections: int = _flag(
        256,
        "limits",
        "TCP connections the gRPC port holds at once (a node keeps one open); past it a new one is closed at once, "
        "and the connections already open keep working",
    )
    max_streams: int = _flag(
        64,
        "limits",
        "upload/download streams served at once per plane (the data plane also holds as many connections still "
        "in their handshake); more: RESOURCE_EXHAUSTED",
    )
    max_streams_per_peer: int = _flag(
        6, "limits", "streams one peer id may hold open at once; more: RESOURCE_EXHAUSTED"
    )
    max_model_gb: float = _flag(
        MAX_MODEL_GB,
        "limits",
        "without RUN.yaml: largest model (GB in fp32) a join may declare (the paper's 9B upcycled config is 37.7 GB)",
    )
    max_tensors: int = _flag(MAX_TENSORS, "limits", "most tensors a join's manifest may declare (the 9B has 591)")
    peer_liveness: float = _flag(
        10.0,
        "limits",
        "seconds: a second process joining with a live peer's peer_id is refused (ALREADY_EXISTS); a peer is live "
        "while its presence stream is open (spes clients keep one), or, a client without one, when heard from "
        "within this long",
    )
    token: str | None = field(
        default=None,
        repr=False,
        metadata={
            "group": "security",
            "flag": "--token_file",
            "doc": f"file holding the run's shared secret (default: env {TOKEN_ENV}; neither: no auth)",
        },
    )
    tls_cert: str | None = _flag(None, "security", "PEM certificate chain (enables TLS)")
    tls_key: str | None = _flag(None, "security", "PEM private key for --tls_cert")
    tls_client_ca: str | None = _flag(None, "security", "PEM CA that must have signed client certificates (mTLS)")
    tls_peer_ids: bool = _flag(
        False, "security", "with mTLS, a node may only act as the peer its certificate names (CN peer-<id>)"
    )
    insecure: bool = _flag(
        False,
        "security",
        "allow a non-loopback --host without a token, or with a token but without TLS (refused otherwise: anyone "
        "on the network could join, or read the token)",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not -1 <= self.data_port <= 65535:
            raise ValueError(f"--data_port must be -1 (disabled) or in [0, 65535], got {self.data_port}")
        if self.max_message_mb < 2:
            raise ValueError(f"--max_message_mb must be >= 2 (chunks are 1 MiB), got {self.max_message_mb}")
        check_key_pair(self.tls_cert, self.tls_key, ("--tls_cert", "--tls_key"))
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls_client_ca (mutual TLS) needs --tls_cert and --tls_key")
        if self.tls_peer_ids and self.tls_client_ca is None:
            raise ValueError(
                "--tls_peer_ids binds peer ids to client certificates: it needs mutual TLS "
                "(--tls_client_ca, --tls_cert, --tls_key)"
            )
        if self.token is not None and not self.token:
            raise ValueError("the auth token is empty: put a non-empty secret in SPES_TOKEN or --token_file")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata["group"] == "limits" and not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{f.name} must be a finite number > 0, got {value}")

    def open_files(self) -> int:
        """File descriptors this server may hold at once: `max_connections` on the gRPC port, twice `max_streams` on
        the data plane (connections in their handshake, and operating ones), and `FILE_RESERVE` of its own."""
        return self.max_connections + 2 * self.max_streams + FILE_RESERVE

    def check_exposure(self) -> None:
        """Refuse to serve off loopback without a token, or a token in clear text, unless `insecure` (ValueError)."""
        if self.insecure or _is_loopback(self.host):
            return
        if self.token is None:
            raise ValueError(
                f"--host {self.host} is reachable from other machines and no token is set: anyone could "
                "join the run. Set SPES_TOKEN or --token_file (with --tls_cert/--tls_key), bind "
                "--host 127.0.0.1, or pass --insecure on a trusted network"
            )
        if self.tls_cert is None:
            raise ValueError(
                f"--host {self.host} is reachable from other machines and the token would travel in "
                "clear text: add --tls_cert/--tls_key, or pass --insecure on a trusted network"
            )


@dataclass(frozen=True)
class ServerConfig:
    """Everything a parameter server needs: the run it serves and how it is deployed."""

    spec: RunSpec
    deploy: DeployConfig = field(default_factory=DeployConfig)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def add_deploy_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `DeployConfig` field, in groups, with its default and help."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields(DeployConfig):
        meta = f.metadata
        if meta["group"] not in groups:
            groups[meta["group"]] = parser.add_argument_group(meta["group"])
        group = groups[meta["group"]]
        flag = meta.get("flag", f"--{f.name}")
        default = None if f.default is MISSING else f.default
        if f.type in (bool, "bool"):
            group.add_argument(flag, dest=f.name, action="store_true", help=meta["doc"])
            continue
        kind = {"int": int, "float": float}.get(str(f.type), str)
        group.add_argument(flag, dest=f.name, type=kind, default=default, help=meta["doc"])


def deploy_from_args(args: argparse.Namespace) -> DeployConfig:
    """The `DeployConfig` of parsed flags; the token is read from `--token_file` or SPES_TOKEN (a file others can
    read is a warning in the server's log)."""
    values = {f.name: getattr(args, f.name) for f in fields(DeployConfig)}
    values["token"] = read_token(values["token"], "--token_file", logging.getLogger("spes.server").warning)
    return DeployConfig(**values)


FIRST_IMPLEMENTATION_FLAGS = {
    "--total_peers": "spes_config.num_peers",
    "--num_train_experts_per_node": "spes_config.num_train_experts_per_node",
    "--merge_interval": "server.merge_interval",
    "--merge_alpha_start": "server.merge_alpha_start",
    "--merge_decay_steps": "server.merge_decay_steps",
}
"""The first SPES implementation's server flags, each a spelling of the run-config override it names."""
CHECKED_FLAGS = {"--total_peers": "TOTAL_PEERS", "--num_train_experts_per_node": "NUM_TRAIN_EXPERTS_PER_NODE"}
"""Those of them that set the run's layout, with run_parameter_server.sh's variable for each. With the run's YAML they
are checked against it, not applied: a server given another layout than its nodes' YAML refused every node."""


class _ServerParser(ArgumentParser):
    """The deployment flags; every other `--key=value` word is an override of the run's config (`args.overrides`),
    and the first implementation's flags are spellings of such overrides (`FIRST_IMPLEMENTATION_FLAGS`), but its
    layout flags given with RUN.yaml, kept in `args.checked_flags` to be checked against it (`CHECKED_FLAGS`)."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[Any, list[str]]:
        words = list(sys.argv[1:] if args is None else args)
        joined = []  # NOTE: each first-implementation flag as one `--flag=value` word, which argparse leaves in `rest`
        while words:
            word = words.pop(0)
            if word in FIRST_IMPLEMENTATION_FLAGS:
                if not words:
                    self.error(f"{word} needs a value")
                word = f"{word}={words.pop(0)}"
            joined.append(word)
        parsed, rest = super().parse_known_args(joined, namespace)
        parsed.overrides, parsed.checked_flags, other = [], {}, []
        for word in rest:
            flag, _, value = word.partition("=")
            if flag in CHECKED_FLAGS and parsed.run is not None:
                parsed.checked_flags[flag] = value
            elif flag in FIRST_IMPLEMENTATION_FLAGS:
                parsed.overrides.append(f"--{FIRST_IMPLEMENTATION_FLAGS[flag]}={value}")
            elif word.startswith("--") and "=" in word:
                parsed.overrides.append(word)
            else:
                other.append(word)
        return parsed, other


class _HelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Flag defaults shown, the epilog's list of config keys kept as written."""


def build_parser() -> argparse.ArgumentParser:
    aliases = ", ".join(f"{flag} N = --{key}=N" for flag, key in FIRST_IMPLEMENTATION_FLAGS.items())
    parser = _ServerParser(
        prog="python -m spes.server",
        usage="python -m spes.server [RUN.yaml] [--section.key=value ...] [flags]",
        description="SPES parameter server: collects every peer's trained tensors each round, takes each expert\n"
        "block from its owner, averages the shared parameters (DiLoCo: everything), applies the expert-merging\n"
        "warm-up on merge rounds, persists the result (--state_dir) and serves the global model back.\n"
        "The run's settings come from its YAML (any node's file: peers, experts per block, mode, sync_steps, codec,\n"
        "and the `server:` section below, overridable as --server.key=value, like every key); the flags are the\n"
        "deployment's. Without a YAML, the run is the defaults plus the overrides (e.g. --spes_config.num_peers=4),\n"
        "and the model and sync_steps are taken from the first node to join.",
        formatter_class=_HelpFormatter,
        allow_abbrev=False,
        takes_overrides=True,
        epilog="the run's `server:` section (key, default, meaning):\n"
        + "\n".join(config_help(ServerSection, "server."))
        + f"\n\nthe first SPES implementation's flags are accepted as spellings of overrides: {aliases}; with "
        "RUN.yaml, --total_peers and --num_train_experts_per_node are checked against it instead"
        + "\n\nexample: SPES_TOKEN=$(cat secret) python -m spes.server configs/spes_1b/node_0.yaml --port 50051 "
        "--tls_cert server.crt --tls_key server.key --state_dir server_state\nstop with SIGTERM or Ctrl-C (exit 0); "
        "restart with the same --state_dir to resume. See docs/running.md (TLS, tokens, ports).",
    )
    parser.add_argument(
        "run",
        nargs="?",
        metavar="RUN.yaml",
        default=None,
        help="a node YAML of the run: the server builds the run spec from it (with the same --section.key=value "
        "overrides as the nodes), including the model's manifest, and refuses any node whose spec or model differs",
    )
    add_deploy_flags(parser)
    parser.add_argument("--log_level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return parser


@dataclass(frozen=True)
class LegacyRun:
    """The run of a server started without its YAML (the first implementation's habit), from the overrides alone:
    its sync sections and mode; `sync_steps_given`: whether they set `sync_steps` (else the first node's is taken)."""

    spes_config: SpesConfig
    server: ServerSection
    mode: Mode
    sync_steps_given: bool


@dataclass(frozen=True)
class ServerCommand:
    """A `python -m spes.server` command line, read and checked without torch: the run as its YAML at `path` gives
    it (overrides applied), or without one (`path` None) as the overrides alone do, and the deployment."""

    path: str | None
    run: TrainConfig | LegacyRun
    deploy: DeployConfig


def read_run(
    path: str | None, overrides: list[str] | tuple[str, ...] = (), checked_flags: dict[str, str] | None = None
) -> TrainConfig | LegacyRun:
    """The run's config of a node YAML and its overrides, or without a YAML of the overrides alone (`LegacyRun`).
    `checked_flags`: the first implementation's layout flags given with the YAML (`CHECKED_FLAGS`), which must agree
    with it. ValueError (ConfigError) naming the key, flag or file."""
    if path is None:
        return legacy_run(overrides)
    cfg, _ = load_config(path, overrides)
    for flag, value in (checked_flags or {}).items():
        check_first_implementation_flag(flag, value, cfg.spes_config, path)
    return cfg


def check_first_implementation_flag(flag: str, value: str, section: SpesConfig, path: str) -> None:
    """ValueError unless the first implementation's layout flag `flag` (`CHECKED_FLAGS`) says what the run's YAML at
    `path` (its `spes_config` section, overrides applied) says."""
    key = FIRST_IMPLEMENTATION_FLAGS[flag]
    have = getattr(section, key.split(".")[1])
    if value.strip() != str(have):
        raise ValueError(
            f"{flag} {value} ({CHECKED_FLAGS[flag]} of run_parameter_server.sh) disagrees with {path}: {key}={have}; "
            f"unset it (the YAML sets the run's layout), or give --{key}={value} to the server and every node alike"
        )


def legacy_run(overrides: list[str] | tuple[str, ...]) -> LegacyRun:
    """The run of a server without the run's YAML: peers, experts per block, mode, codec and `server:` section from
    the overrides (ConfigError naming any key they may not set)."""
    s, server, mode = load_sync_sections(overrides)
    if mode == "centralized":
        raise ValueError("--using_spes=false is a centralized run, which has no parameter server")
    given = any(o.startswith("--spes_config.sync_steps=") for o in overrides)
    return LegacyRun(s, server, mode, given)


def command_from_args(args: argparse.Namespace) -> ServerCommand:
    """The command of `build_parser()`'s parsed flags: its run read and its deployment checked, still without torch."""
    return ServerCommand(args.run, read_run(args.run, args.overrides, args.checked_flags), deploy_from_args(args))
