"""The SPES parameter server: the assembly of the round service and its two planes, from a checked command line.

Each round (keyed by the global step) collects one verified upload per peer, builds the global model
(`spes.sync.aggregate`: SPES round or DiLoCo average, outer optimizer, quorum) on its own thread, persists it under
`--state_dir` and serves it to every peer. The round service is `spes.sync.coordinator`; the gRPC handlers
(`spes.sync.plane_grpc`) and the raw-TCP data plane (`spes.sync.plane_tcp`) only validate and move bytes.

    python -m spes.server configs/spes_1b/node_0.yaml --port 50051 --state_dir server_state

The run (`spes.sync.spec.RunSpec`: peers, ownership, mode, schedule, codec, the `server:` section) comes from the
run's YAML, any node's file, with the nodes' `--section.key=value` overrides (`--server.merge_interval=200`),
through the same `run_spec` every node calls; the flags are the deployment's (`spes.sync.settings.DeployConfig`).
The command line is parsed and checked in `spes.sync.settings`, without torch: `python -m spes.server` imports this
module only for a command that holds.
Without a YAML (the first implementation's habit: `--total_peers 4 --num_train_experts_per_node 4`, or
`TOTAL_PEERS=4 run_scripts/run_parameter_server.sh`) the spec is built from the defaults and the overrides, and the
model's manifest and `sync_steps` are taken from the first node to join.

Security: a shared token (env SPES_TOKEN or --token_file) is checked on every call before any handler runs,
TLS/mTLS from PEM files, and nothing received is ever unpickled (see `spes.sync.wire` and docs/running.md "Security").
Off loopback the server refuses to start without a token, or with a token but no TLS, unless --insecure.
No call can hold it: streams take bounded slots and are closed when idle, one process per peer id
(`spes.sync.admission`); connections are bounded, closed when their handshake stalls, and fit in the process's
open-file limit (`connection_limits`, `ensure_open_files`); a Join's spec and manifest must equal the run's (or,
a server started without one, are bounded by --max_tensors and --max_model_gb).
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import socket
from collections.abc import Callable
from concurrent import futures
from typing import TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from spes.config import TrainConfig
from spes.sync import plane_tcp
from spes.sync.admission import UNARY_RESERVE, GuardedHealth
from spes.sync.auth import TokenAuthInterceptor, grpc_common_name
from spes.sync.channel import KEEPALIVE_SERVER_OPTIONS, grpc_options, read_file, server_tls
from spes.sync.coordinator import Coordinator
from spes.sync.plane_grpc import SpesServicer
from spes.sync.proto import spes_pb2_grpc as pb_grpc
from spes.sync.settings import DeployConfig, LegacyRun, ServerCommand, ServerConfig, read_run
from spes.sync.spec import RunSpec, run_spec
from spes.sync.state import lock_state_dir

log = logging.getLogger("spes.server")
T = TypeVar("T")

SERVICE_NAME = "spes.v1.ParameterServer"


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
        state_lock: int | None = None,
    ) -> None:
        self.server, self.service, self.health, self.port = server, service, health_servicer, port
        self._executor, self._data_plane, self._state_lock = executor, data_plane, state_lock
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
        _release(self._state_lock)  # NOTE: last: no round can be saved after it
        self._state_lock = None


def start_server(cfg: ServerConfig) -> ParameterServer:
    """Claim `--state_dir` (refused while another server holds it), restore it if it holds a round, then bind and
    start the server (non-blocking)."""
    cfg.deploy.check_exposure()
    lock = lock_state_dir(cfg.deploy.state_dir) if cfg.deploy.state_dir else None
    try:
        service = Coordinator(cfg)
    except BaseException:
        _release(lock)
        raise
    try:
        return _serve(cfg, service, lock)
    except BaseException:
        service.shutdown(grace_s=0.0)  # NOTE: its status reporter too: a server that failed to start says nothing
        _release(lock)
        raise


def _release(lock: int | None) -> None:
    """Let go of the `--state_dir` lock (`lock_state_dir`), if held."""
    if lock is not None:
        os.close(lock)


def _serve(cfg: ServerConfig, service: Coordinator, lock: int | None) -> ParameterServer:
    deploy = cfg.deploy
    ensure_open_files(deploy)
    interceptors = [TokenAuthInterceptor(deploy.token, service.warn)] if deploy.token is not None else []
    # NOTE: streams hold at most `max_streams` threads (StreamGuard); the rest serve Join, Status and health checks.
    executor = futures.ThreadPoolExecutor(max_workers=deploy.max_streams + UNARY_RESERVE, thread_name_prefix="spes-rpc")
    server = grpc.server(
        executor,
        interceptors=interceptors,
        # NOTE: no SO_REUSEPORT: a second server on the same port must fail, not share the peers' calls.
        options=[
            *grpc_options(deploy.max_message_mb),
            ("grpc.so_reuseport", 0),
            *KEEPALIVE_SERVER_OPTIONS,
            *connection_limits(deploy),
        ],
    )
    pb_grpc.add_ParameterServerServicer_to_server(SpesServicer(service), server)
    health_servicer = GuardedHealth(service.guard, service.presence, grpc_common_name)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{deploy.host}:{deploy.port}"
    tls = server_tls(deploy.tls_cert, deploy.tls_key, deploy.tls_client_ca)
    _port_free(deploy.host, deploy.port, "--port")
    if deploy.tls_cert is not None and deploy.tls_key is not None:
        credentials = grpc.ssl_server_credentials(
            [(read_file(deploy.tls_key, "--tls_key"), read_file(deploy.tls_cert, "--tls_cert"))],
            root_certificates=read_file(deploy.tls_client_ca, "--tls_client_ca") if deploy.tls_client_ca else None,
            require_client_auth=deploy.tls_client_ca is not None,
        )
        port = _bind(lambda: server.add_secure_port(address, credentials), address, "--port")
    else:
        port = _bind(lambda: server.add_insecure_port(address), address, "--port")
    data_plane = None
    if deploy.data_port >= 0:
        data_plane = _bind(
            lambda: plane_tcp.DataPlaneListener(
                deploy.host,
                deploy.data_port,
                plane_tcp.DataHandler(service, deploy.token),
                tls=tls,
                max_connections=deploy.max_streams,
                io_timeout_s=deploy.stream_idle_timeout,
                handshake_s=deploy.handshake_timeout,
                warn=service.warn,
            ),
            f"{deploy.host}:{deploy.data_port}",
            "--data_port",
        )
        service.data_port = data_plane.port
    server.start()
    for service_name in ("", SERVICE_NAME):
        health_servicer.set(service_name, health_pb2.HealthCheckResponse.SERVING)
    return ParameterServer(server, service, health_servicer, port, executor, data_plane, lock)


def connection_limits(deploy: DeployConfig) -> list[tuple[str, int]]:
    """gRPC core's bounds on the port's connections: at most `max_connections` open (past it a new one is closed
    at accept), each closed unless its handshake completes within `handshake_timeout` (gRPC's default: 120 s).
    Without them a flood of silent connections held a descriptor each until the process could open no file: the
    data plane stopped accepting and the round's state file could not be written."""
    return [
        ("grpc.max_allowed_incoming_connections", deploy.max_connections),
        ("grpc.server_handshake_timeout_ms", round(deploy.handshake_timeout * 1000)),
    ]


def ensure_open_files(deploy: DeployConfig) -> None:
    """Raise this process's soft limit of open files (`ulimit -n`) to what `deploy`'s limits can hold
    (`DeployConfig.open_files`), or ValueError naming the limits when its hard limit is below that."""
    needed = deploy.open_files()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise ValueError(
            f"--max_connections={deploy.max_connections} and --max_streams={deploy.max_streams} need {needed} "
            f"open files, and this process may open {hard} (ulimit -Hn): raise the limit or lower those flags"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    log.info("raised the open-file limit from %d to %d (--max_connections, --max_streams)", soft, needed)


def _port_free(host: str, port: int, flag: str) -> None:
    """ValueError naming `flag` when `host:port` is taken, tried with a plain socket before grpc binds it: grpc's
    core logs a line of its own (`add_port.cc ... Address already in use`) above the one-line error."""
    if port == 0:
        return
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, IndexError):
        return  # NOTE: an address this cannot resolve is grpc's to report
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc: a port in TIME_WAIT is free
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            raise ValueError(
                f"cannot listen on {host}:{port} ({exc.strerror}): stop the process using it or pick another {flag}"
            ) from None


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


def exposure_warnings(deploy: DeployConfig) -> list[str]:
    """What the log says of a server anyone who reaches it may join, or whose token travels in clear text.

    Why the second: `run_cluster.sh` always passes --insecure, so a SPES_TOKEN given without TLS files went over the
    network in clear text without a word."""
    if deploy.token is None:
        return ["no SPES_TOKEN or --token_file: anyone who can reach this port can join the run"]
    if deploy.insecure and deploy.tls_cert is None:
        return [
            "--insecure with a token but no --tls_cert/--tls_key: the token travels in clear text, and anyone on the "
            "network path can read it and join the run; add --tls_cert/--tls_key to protect it"
        ]
    return []


def describe_run(spec: RunSpec) -> str:
    """The run the server holds, under its config keys, for the start line (a setting still open: `open`, taken
    from the first node to join); the merge warm-up or the outer step the server applies, by mode."""
    server, open_ = spec.server, "open"
    parts = [
        f"mode {spec.mode}",
        f"num_peers {spec.num_peers}",
        f"experts per block {open_ if spec.experts_per_block is None else spec.experts_per_block}",
        f"sync_steps {open_ if spec.sync_steps is None else spec.sync_steps}",
        f"last step {open_ if spec.last_step is None else spec.last_step}",
        f"codec {spec.codec}" + "".join(f" {k}={v}" for k, v in spec.codec_settings),
    ]
    if spec.overlap_fragments > 1:
        parts.append(f"overlap_fragments {spec.overlap_fragments}")
    if spec.mode == "spes":
        parts.append(
            f"merge warm-up every {server.merge_interval} steps, alpha {server.merge_alpha_start:g} decaying to 0 at "
            f"step {server.merge_decay_steps}"
            if server.merge_interval and server.merge_alpha_start > 0
            else "no merge warm-up"
        )
    else:
        parts.append(f"outer_optimizer {server.outer_optimizer}")
    return ", ".join(parts) + (f" (from {spec.origin})" if spec.origin else "")


def spec_of_run(
    path: str | None, overrides: list[str] | tuple[str, ...] = (), checked_flags: dict[str, str] | None = None
) -> RunSpec:
    """The run spec of a node YAML and its overrides, or without a YAML of the overrides alone (`read_run`, which
    names a key or flag the command gets wrong)."""
    return spec_of(read_run(path, overrides, checked_flags), path)


def spec_of(run: TrainConfig | LegacyRun, path: str | None) -> RunSpec:
    """The run spec of a node YAML's config (read from `path`), with the manifest of the model it builds (on the meta
    device); of a `LegacyRun`, a SPES run unless it says otherwise, what depends on the model (its manifest, block
    owners, DiLoCo's experts per block) and an unset `sync_steps` left open for the first node to join."""
    if isinstance(run, LegacyRun):
        s = run.spes_config
        return RunSpec(
            mode=run.mode,
            num_peers=s.num_peers,
            experts_per_block=s.num_train_experts_per_node if run.mode == "spes" else None,
            block_owners=None,
            sync_steps=s.sync_steps if run.sync_steps_given else None,
            last_step=None,
            overlap_fragments=s.overlap_fragments,
            codec=s.codec,
            codec_settings=tuple(sorted(s.codec_settings.items())),
            server=run.server,
            origin="the server's command line",
        )
    from spes.model import Transformer  # NOTE: lazy, so a server without RUN.yaml never imports the model

    with torch.device("meta"):
        model = Transformer.for_run(run)
    return run_spec(run, {n: tuple(p.shape) for n, p in model.named_parameters()}, origin=path or "")


def config_of(command: ServerCommand) -> ServerConfig:
    return ServerConfig(spec_of(command.run, command.path), command.deploy)


def start_command(command: ServerCommand) -> ParameterServer:
    """Start the server `command` describes (`start_server`) and log what it serves, and how safely."""
    limit_malloc_arenas()
    cfg = config_of(command)
    server = start_server(cfg)
    deploy = cfg.deploy  # NOTE: its token field is repr=False: never logged
    log.info(
        "spes parameter server listening on %s:%d (data plane %s, auth %s, tls %s); run: %s",
        deploy.host,
        server.port,
        server.data_port or "off",
        "on" if deploy.token else "OFF",
        "mutual" if deploy.tls_client_ca else ("on" if deploy.tls_cert else "off"),
        describe_run(cfg.spec),
    )
    for warning in exposure_warnings(deploy):
        log.warning(warning)
    return server
