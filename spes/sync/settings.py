"""The parameter server's settings: the run spec (`spes.sync.spec`) and the deployment's (`DeployConfig`).

What the run is comes from the run's YAML through `run_spec`, like on every node. How this server process is
deployed (interface, ports, TLS, token, state directory, limits) are its command-line flags, generated from the
fields of `DeployConfig` (name, default, help): one place per setting.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from spes.sync.auth import TOKEN_ENV, read_token
from spes.sync.joins import MAX_MODEL_GB, MAX_TENSORS
from spes.sync.spec import RunSpec

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
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls_cert and --tls_key must be given together")
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
