"""The SPES parameter server: its settings, command line, and the assembly of the round service and two planes.

Each round (keyed by the global step) collects one verified upload per peer, builds the global model with
`spes.sync.merge.build_global` (SPES round or DiLoCo average, outer optimizer, quorum) on its own thread,
persists it under `--state_dir` and serves it to every peer. The round service is `spes.sync.coordinator`
(round rules in `spes.sync.rounds`, persistence in `spes.sync.state`); the gRPC handlers
(`spes.sync.plane_grpc`) and the raw-TCP data plane (`spes.sync.plane_tcp`) only validate and move bytes.

    python -m spes.server configs/spes_1b/node_0.yaml --port 50051 --state_dir server_state

The run's settings (peers, experts per block, mode, merge warm-up, outer optimizer, dead peers) come from the
run's YAML, any node's file, with the nodes' `--section.key=value` overrides (`--server.merge_interval=200`);
the flags are the deployment's (`--help`).

Security: a shared token (env SPES_TOKEN or --token_file) is checked on every call before any handler runs,
TLS/mTLS from PEM files, and nothing received is ever unpickled (see `spes.sync.wire` and README "Security").
Off loopback the server refuses to start without a token, or with a token but no TLS, unless --insecure.
No call can hold it: streams take bounded slots and are closed when idle, one process per peer id
(`spes.sync.admission`); a Join's manifest must equal the model the run's YAML builds (or, a server started
without one, is bounded by --max_tensors and --max_model_gb).
"""

from __future__ import annotations

import argparse
import ctypes
import ipaddress
import logging
import signal
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from spes.config import (
    ServerSection,
    TrainConfig,
    add_server_flags,
    config_help,
    load_config,
    load_server_section,
    server_flag_overrides,
)
from spes.sync import plane_tcp
from spes.sync.admission import UNARY_RESERVE, GuardedHealth
from spes.sync.auth import (
    TOKEN_ENV,
    TokenAuthInterceptor,
    read_token,
)
from spes.sync.coordinator import Coordinator
from spes.sync.merge import MergeConfig, OuterConfig
from spes.sync.plane_grpc import SpesServicer
from spes.sync.proto import spes_pb2_grpc as pb_grpc
from spes.sync.protocol import WIRE_CHOICES, Mode, Shape
from spes.sync.rounds import MAX_MODEL_GB, MAX_TENSORS, DeadPeerPolicy, RoundPolicy
from spes.sync.wire import KEEPALIVE_SERVER_OPTIONS, grpc_options, read_file

log = logging.getLogger("spes.server")
T = TypeVar("T")

SERVICE_NAME = "spes.v1.ParameterServer"


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Everything the parameter server needs; built by `main` from the run's YAML (its layout and `server:`
    section, `spes.config.ServerSection`) and the deployment flags."""

    num_peers: int
    """Number of peers in the run."""
    experts_per_peer: int
    """Experts per ownership block (num_train_experts_per_node); peers must agree."""
    host: str = "0.0.0.0"
    """Interface to bind."""
    port: int = 50051
    """TCP port; 0 lets the OS choose (see `ParameterServer.port`)."""
    mode: Mode = "spes"
    """`spes` (experts from owners, shared averaged, merge warm-up) or `diloco` (average everything)."""
    wire_dtype: str = "fp32"
    """The run's `spes_config.wire_dtype`: `int8` makes the server hold the held model and speak int8 deltas (every
    node must use int8 then); with `fp32` or `bf16` each node picks either."""
    merge: MergeConfig = field(default_factory=MergeConfig)
    """Expert-merging warm-up (SPES mode only); defaults: the run config's `server:` section."""
    outer: OuterConfig = field(default_factory=OuterConfig)
    """DiLoCo outer optimizer (DiLoCo mode only)."""
    round_timeout_s: float = ServerSection.round_timeout_s
    """Seconds after a round's first upload after which it has timed out (see `dead_peer_policy`)."""
    dead_peer_policy: DeadPeerPolicy = ServerSection.dead_peer_policy
    """At the timeout, `wait` fails the waiting downloads naming the missing peers; `quorum` closes the round."""
    min_peers: int | None = ServerSection.min_peers
    """Fewest peers a quorum round needs (None: a majority)."""
    state_dir: str | None = None
    """Directory where every completed round is persisted and from which a restarted server resumes."""
    token: str | None = field(default=None, repr=False)
    """Shared secret every call must carry; None disables authentication. Never logged."""
    tls_cert: str | None = None
    """PEM certificate chain of the server (enables TLS, with `tls_key`)."""
    tls_key: str | None = None
    """PEM private key of the server."""
    tls_client_ca: str | None = None
    """PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS)."""
    tls_peer_ids: bool = False
    """With mutual TLS: a node may only act as the peer its certificate names (common name `peer-<id>`)."""
    max_message_mb: int = 4
    """gRPC message size limit in MiB: chunks are 1 MiB, so a larger message is refused unread."""
    data_port: int = -1
    """TCP port of the raw data plane for tensor payloads (`spes.sync.plane_tcp`); 0: OS-chosen, -1: disabled."""
    stream_idle_timeout_s: float = 60.0
    """A stream (either plane) that neither receives nor sends a message for this long is closed, its upload dropped."""
    max_streams: int = 64
    """Upload/Download streams served at once per plane; more are refused with RESOURCE_EXHAUSTED."""
    max_streams_per_peer: int = 6
    """Streams one peer id may hold open at once (both planes together)."""
    peer_liveness_s: float = 10.0
    """A joined peer without a presence stream heard from within this long is live (see `spes.sync.admission`)."""
    max_model_gb: float = MAX_MODEL_GB
    """Largest model (GB of fp32, 1e9 bytes) a Join's manifest may declare when the run's YAML is not given."""
    max_tensors: int = MAX_TENSORS
    """Most tensors a Join's manifest may declare."""
    expected_manifest: dict[str, Shape] | None = field(default=None, repr=False)
    """Every tensor of the run's model (from its YAML, `manifest_of_run`): joins must declare exactly this."""
    insecure: bool = False
    """Allow a non-loopback bind without a token, or with a token but without TLS."""

    def __post_init__(self) -> None:
        if self.num_peers < 1:
            raise ValueError(f"--total_peers must be >= 1, got {self.num_peers}")
        if self.experts_per_peer < 1:
            raise ValueError(f"--num_train_experts_per_node must be >= 1, got {self.experts_per_peer}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not -1 <= self.data_port <= 65535:
            raise ValueError(f"--data_port must be -1 (disabled) or in [0, 65535], got {self.data_port}")
        if self.mode not in ("spes", "diloco"):
            raise ValueError(f"--mode must be 'spes' or 'diloco', got {self.mode!r}")
        if self.wire_dtype not in WIRE_CHOICES:
            raise ValueError(f"--wire_dtype must be one of {list(WIRE_CHOICES)}, got {self.wire_dtype!r}")
        self.policy()  # validates --round_timeout, --dead_peer_policy, --min_peers
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
        for flag, value in (
            ("--stream_idle_timeout", self.stream_idle_timeout_s),
            ("--max_model_gb", self.max_model_gb),
            ("--peer_liveness", self.peer_liveness_s),
            ("--max_streams", self.max_streams),
            ("--max_streams_per_peer", self.max_streams_per_peer),
            ("--max_tensors", self.max_tensors),
        ):
            if not value > 0:
                raise ValueError(f"{flag} must be > 0, got {value}")

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

    def policy(self) -> RoundPolicy:
        return RoundPolicy(
            num_peers=self.num_peers,
            timeout_s=self.round_timeout_s,
            dead_peer_policy=self.dead_peer_policy,
            min_peers=self.min_peers,
        )

    def run_identity(self) -> dict[str, Any]:
        """The settings a persisted state must have been written with: those that fix what the model means.

        The merge warm-up, outer optimizer and dead-peer settings may change across a restart.
        """
        return {"num_peers": self.num_peers, "experts_per_peer": self.experts_per_peer, "mode": self.mode}


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ParameterServer:
    """A running server: the round service, its gRPC server and health service, and the data plane.

    Stop with `stop()`."""

    def __init__(
        self,
        server: grpc.Server,
        service: Coordinator,
        health_servicer: health.HealthServicer,
        port: int,
        executor: futures.ThreadPoolExecutor,
        data_plane: plane_tcp.DataPlaneListener | None = None,
    ) -> None:
        self.server, self.service, self.health, self.port = server, service, health_servicer, port
        self._executor, self._data_plane = executor, data_plane
        self.data_port = data_plane.port if data_plane is not None else 0
        """The raw data plane's port (0: disabled)."""

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving: waiting downloads end with UNAVAILABLE, in-flight calls get `grace_s` seconds.

        The health watchers' NOT_SERVING notice is only queued (`GuardedHealth`): a watcher that does not read
        cannot hold the stop, and its stream ends with the server's."""
        self.health.enter_graceful_shutdown()
        self.service.shutdown(grace_s)
        if self._data_plane is not None:
            self._data_plane.stop()
        self.server.stop(grace_s).wait()
        self._executor.shutdown(wait=False)  # NOTE: grpc leaves its handler threads running otherwise


def start_server(cfg: ServerConfig) -> ParameterServer:
    """Restore `cfg.state_dir` if it holds a round, then bind and start the server (non-blocking)."""
    cfg.check_exposure()
    service = Coordinator(cfg)
    try:
        return _serve(cfg, service)
    except BaseException:
        service.guard.stop()
        raise


def _serve(cfg: ServerConfig, service: Coordinator) -> ParameterServer:
    interceptors = [TokenAuthInterceptor(cfg.token)] if cfg.token is not None else []
    # NOTE: streams hold at most `max_streams` threads (StreamGuard); the rest serve Join, Status and health checks.
    executor = futures.ThreadPoolExecutor(max_workers=cfg.max_streams + UNARY_RESERVE, thread_name_prefix="spes-rpc")
    server = grpc.server(
        executor,
        interceptors=interceptors,
        # NOTE: no SO_REUSEPORT: a second server on the same port must fail, not share the peers' calls.
        options=[*grpc_options(cfg.max_message_mb), ("grpc.so_reuseport", 0), *KEEPALIVE_SERVER_OPTIONS],
    )
    pb_grpc.add_ParameterServerServicer_to_server(SpesServicer(service), server)
    health_servicer = GuardedHealth(service.guard, service.presence)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{cfg.host}:{cfg.port}"
    if cfg.tls_cert is not None and cfg.tls_key is not None:
        credentials = grpc.ssl_server_credentials(
            [(read_file(cfg.tls_key, "--tls_key"), read_file(cfg.tls_cert, "--tls_cert"))],
            root_certificates=read_file(cfg.tls_client_ca, "--tls_client_ca") if cfg.tls_client_ca else None,
            require_client_auth=cfg.tls_client_ca is not None,
        )
        port = _bind(lambda: server.add_secure_port(address, credentials), address, "--port")
    else:
        port = _bind(lambda: server.add_insecure_port(address), address, "--port")
    data_plane = None
    if cfg.data_port >= 0:
        tls = plane_tcp.server_tls(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
        data_plane = _bind(
            lambda: plane_tcp.DataPlaneListener(
                cfg.host,
                cfg.data_port,
                plane_tcp.DataHandler(service, cfg.token),
                tls=tls,
                max_connections=cfg.max_streams,
                io_timeout_s=cfg.stream_idle_timeout_s,
            ),
            f"{cfg.host}:{cfg.data_port}",
            "--data_port",
        )
        service.data_port = data_plane.port
    server.start()
    for service_name in ("", SERVICE_NAME):
        health_servicer.set(service_name, health_pb2.HealthCheckResponse.SERVING)
    return ParameterServer(server, service, health_servicer, port, executor, data_plane)


def _bind(listen: Callable[[], T], address: str, flag: str) -> T:
    """`listen()`, with a failure to bind (grpc: RuntimeError or port 0; sockets: OSError) as one ValueError."""
    try:
        bound: T | None = listen()
    except OSError as exc:
        raise ValueError(
            f"cannot listen on {address} ({exc.strerror}): stop the process using it or pick another {flag}"
        ) from None
    except RuntimeError:  # grpc's text adds nothing: it only says that binding failed
        bound = None
    if bound is None or bound == 0:
        raise ValueError(
            f"cannot listen on {address}: is another server using the port? stop it or pick another {flag}"
        )
    return bound


class _ServerParser(argparse.ArgumentParser):
    """The deployment flags; every other `--key=value` word is an override of the run's config (`args.overrides`)."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[Any, list[str]]:
        parsed, rest = super().parse_known_args(args, namespace)
        parsed.overrides = [a for a in rest if a.startswith("--") and "=" in a]
        return parsed, [a for a in rest if a not in parsed.overrides]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Flag defaults shown, the epilog's list of config keys kept as written."""


def build_parser() -> argparse.ArgumentParser:
    parser = _ServerParser(
        prog="python -m spes.server",
        usage="python -m spes.server RUN.yaml [--section.key=value ...] [flags]",
        description="SPES parameter server: collects every peer's trained tensors each round, takes each expert\n"
        "block from its owner, averages the shared parameters (DiLoCo: everything), applies the expert-merging\n"
        "warm-up on merge rounds, persists the result (--state_dir) and serves the global model back.\n"
        "The run's settings come from its YAML (any node's file: peers, experts per block, mode, and the\n"
        "`server:` section below, overridable as --server.key=value); the flags are the deployment's.",
        formatter_class=_HelpFormatter,
        allow_abbrev=False,
        epilog="the run's `server:` section (key, default, meaning):\n"
        + "\n".join(config_help(ServerSection, "server."))
        + "\n\nexample: SPES_TOKEN=$(cat secret) python -m spes.server configs/spes_1b/node_0.yaml --port 50051 "
        "--tls_cert server.crt --tls_key server.key --state_dir server_state\nPeers connect with "
        "spes.sync.client.SyncClient; stop with SIGTERM or Ctrl-C (exit 0); restart with the same --state_dir to "
        "resume. See README 'Security'.",
    )
    add = parser.add_argument_group
    parser.add_argument(
        "run",
        nargs="?",
        metavar="RUN.yaml",
        default=None,
        help="a node YAML of the run: the server takes the run's layout and `server:` section from "
        "it (with the same --section.key=value overrides as the nodes), builds the model's manifest "
        "and refuses any node whose model differs",
    )
    parser.add_argument(
        "--state_dir",
        default=None,
        help="persist every completed round here (atomically) and resume from it on restart",
    )
    run = add("without RUN.yaml (tests, tools): the layout, and the run flags of earlier versions")
    run.add_argument(
        "--total_peers",
        dest="num_peers",
        type=int,
        default=None,
        help="number of peers (nodes) in the run; with RUN.yaml it must equal spes_config.num_peers",
    )
    run.add_argument(
        "--num_train_experts_per_node",
        type=int,
        default=None,
        help="experts per ownership block; with RUN.yaml it must equal the run's",
    )
    run.add_argument(
        "--mode",
        choices=("spes", "diloco"),
        default=None,
        help="spes: experts from their owners + averaged shared params; diloco: average everything "
        "(default: the YAML's, else spes)",
    )
    run.add_argument(
        "--wire_dtype",
        choices=WIRE_CHOICES,
        default=None,
        help="the run's spes_config.wire_dtype: int8 makes the server hold the held model and speak int8 deltas, "
        "and every node must use int8; fp32/bf16: each node picks either (default: the YAML's, else fp32)",
    )
    add_server_flags(run)
    net = add("network")
    net.add_argument("--host", default="0.0.0.0", help="interface to bind")
    net.add_argument("--port", type=int, default=50051, help="TCP port (0: let the OS choose; the log says which)")
    net.add_argument("--max_message_mb", type=int, default=4, help="gRPC message size limit (MiB)")
    net.add_argument(
        "--data_port",
        type=int,
        default=-1,
        help="TCP port of the raw data plane for tensor payloads, ~10x faster than gRPC (0: let the OS "
        "choose, advertised to peers at Join; -1: disabled, tensors go over gRPC)",
    )
    limits = add("limits (what no peer, careless or hostile, may exceed)")
    limits.add_argument(
        "--stream_idle_timeout",
        type=float,
        default=60.0,
        help="close an upload/download stream (either plane) that sends nothing for this many "
        "seconds (DEADLINE_EXCEEDED); its partial upload is dropped",
    )
    limits.add_argument(
        "--max_streams",
        type=int,
        default=64,
        help="upload/download streams served at once per plane; more: RESOURCE_EXHAUSTED",
    )
    limits.add_argument(
        "--max_streams_per_peer",
        type=int,
        default=6,
        help="streams one peer id may hold open at once; more: RESOURCE_EXHAUSTED",
    )
    limits.add_argument(
        "--max_model_gb",
        type=float,
        default=MAX_MODEL_GB,
        help="without RUN.yaml: largest model (GB in fp32) a join may declare (the paper's 9B "
        "upcycled config is 37.7 GB)",
    )
    limits.add_argument(
        "--max_tensors",
        type=int,
        default=MAX_TENSORS,
        help="most tensors a join's manifest may declare (the 9B upcycled config has 591)",
    )
    limits.add_argument(
        "--peer_liveness",
        type=float,
        default=10.0,
        help="a second process joining with a live peer's peer_id is refused (ALREADY_EXISTS); a "
        "peer is live while its presence stream is open (spes clients keep one), or, a client "
        "without one, when heard from within this many seconds",
    )
    sec = add("security")
    sec.add_argument(
        "--token_file",
        default=None,
        help=f"file holding the run's shared secret (default: env {TOKEN_ENV}; neither: no auth)",
    )
    sec.add_argument("--tls_cert", default=None, help="PEM certificate chain (enables TLS)")
    sec.add_argument("--tls_key", default=None, help="PEM private key for --tls_cert")
    sec.add_argument("--tls_client_ca", default=None, help="PEM CA that must have signed client certificates (mTLS)")
    sec.add_argument(
        "--tls_peer_ids",
        action="store_true",
        help="with mTLS, a node may only act as the peer its certificate names (CN peer-<id>)",
    )
    sec.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --host without a token, or with a token but without TLS (refused "
        "otherwise: anyone on the network could join, or read the token)",
    )
    parser.add_argument("--log_level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return parser


def manifest_of_run(path: str, overrides: list[str] | tuple[str, ...] = ()) -> tuple[dict[str, Shape], TrainConfig]:
    """The name and shape of every tensor of the run's model (built on the meta device) and the run's config."""
    from spes.model import (
        Transformer,  # NOTE: lazy, so a server without RUN.yaml never imports the model
    )

    cfg, _ = load_config(path, overrides)
    with torch.device("meta"):
        model = Transformer.for_run(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}, cfg


def merge_of(section: ServerSection) -> MergeConfig:
    """The merge warm-up the round math takes, from the run's `server:` section."""
    return MergeConfig(
        interval=section.merge_interval,
        alpha_start=section.merge_alpha_start,
        decay_steps=section.merge_decay_steps,
        topk=section.merge_topk,
    )


def outer_of(section: ServerSection) -> OuterConfig:
    """The DiLoCo outer optimizer the round math takes, from the run's `server:` section."""
    return OuterConfig(optimizer=section.outer_optimizer, lr=section.outer_lr, momentum=section.outer_momentum)


def _run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's `ServerConfig` fields: from RUN.yaml and its overrides (the nodes' layout and `server:` section),
    or without one from --total_peers, --num_train_experts_per_node, --mode and --server.key=value overrides.

    The former run flags (`--merge_interval 8`) are spellings of `--server.*` overrides; a layout flag given with
    RUN.yaml must agree with it.
    """
    overrides = [*args.overrides, *server_flag_overrides(args)]
    layout = {
        "--total_peers": args.num_peers,
        "--num_train_experts_per_node": args.num_train_experts_per_node,
        "--mode": args.mode,
        "--wire_dtype": args.wire_dtype,
    }
    manifest = None
    if args.run is not None:
        manifest, run = manifest_of_run(args.run, overrides)
        if not run.sync_enabled:
            raise ValueError(
                f"{args.run} is a centralized run (using_spes: false), which has no parameter server: "
                "give the YAML of a SPES or DiLoCo node"
            )
        of_run = {
            "--total_peers": run.num_peers,
            "--num_train_experts_per_node": run.experts_per_peer,
            "--mode": run.mode,
            "--wire_dtype": run.spes_config.wire_dtype,
        }
        for flag, value in layout.items():
            if value is not None and value != of_run[flag]:
                raise ValueError(
                    f"{flag}={value} disagrees with {args.run}, whose run has {of_run[flag]}: drop the "
                    "flag or fix the YAML"
                )
        layout, section = of_run, run.server
    else:
        missing = [flag for flag in ("--total_peers", "--num_train_experts_per_node") if layout[flag] is None]
        if missing:
            raise ValueError(
                f"no run given: pass the run's YAML (python -m spes.server RUN.yaml); without one, "
                f"{' and '.join(missing)} required"
            )
        section = load_server_section(overrides)
    optional = {key: layout[f"--{key}"] for key in ("mode", "wire_dtype") if layout[f"--{key}"] is not None}
    return {
        "num_peers": layout["--total_peers"],
        "experts_per_peer": layout["--num_train_experts_per_node"],
        **optional,
        "merge": merge_of(section),
        "outer": outer_of(section),
        "round_timeout_s": section.round_timeout_s,
        "dead_peer_policy": section.dead_peer_policy,
        "min_peers": section.min_peers,
        "expected_manifest": manifest,
    }


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        **_run_settings(args),
        host=args.host,
        port=args.port,
        state_dir=args.state_dir,
        token=read_token(args.token_file, "--token_file"),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        tls_peer_ids=args.tls_peer_ids,
        max_message_mb=args.max_message_mb,
        data_port=args.data_port,
        stream_idle_timeout_s=args.stream_idle_timeout,
        max_streams=args.max_streams,
        max_streams_per_peer=args.max_streams_per_peer,
        peer_liveness_s=args.peer_liveness,
        max_model_gb=args.max_model_gb,
        max_tensors=args.max_tensors,
        insecure=args.insecure,
    )


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas (as MALLOC_ARENA_MAX would) for a long-lived server process.

    NOTE: each data-plane connection runs on a new thread, and glibc gives threads their own arenas (up to
    8 per core), whose freed pages it keeps: measured in bench/bench_soak.py, RSS crept ~40 KiB per round
    without this and stayed flat with it. A no-op off glibc.
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(-8, arenas)  # -8: M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    """Run the server until SIGTERM/SIGINT, then shut down cleanly and return 0."""
    limit_malloc_arenas()
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.set())
    try:
        cfg = config_from_args(args)
        server = start_server(cfg)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    shown = replace(cfg, port=server.port)  # the token field is repr=False: never logged
    log.info(
        "spes parameter server listening on %s:%d (data plane %s, auth %s, tls %s) %s",
        cfg.host,
        server.port,
        server.data_port or "off",
        "on" if cfg.token else "OFF",
        "mutual" if cfg.tls_client_ca else ("on" if cfg.tls_cert else "off"),
        shown,
    )
    if cfg.token is None:
        log.warning("no SPES_TOKEN or --token_file: anyone who can reach this port can join the run")
    try:
        stop.wait()
    finally:
        log.info("shutting down")
        server.stop(grace_s=2.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
