"""The SPES parameter server: its command line, and the assembly of the round service and its two planes.

Each round (keyed by the global step) collects one verified upload per peer, builds the global model
(`spes.sync.aggregate`: SPES round or DiLoCo average, outer optimizer, quorum) on its own thread, persists it under
`--state_dir` and serves it to every peer. The round service is `spes.sync.coordinator`; the gRPC handlers
(`spes.sync.plane_grpc`) and the raw-TCP data plane (`spes.sync.plane_tcp`) only validate and move bytes.

    python -m spes.server configs/spes_1b/node_0.yaml --port 50051 --state_dir server_state

The run (`spes.sync.spec.RunSpec`: peers, ownership, mode, schedule, codec, the `server:` section) comes from the
run's YAML, any node's file, with the nodes' `--section.key=value` overrides (`--server.merge_interval=200`),
through the same `run_spec` every node calls; the flags are the deployment's (`spes.sync.settings.DeployConfig`).
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

import argparse
import ctypes
import logging
import os
import resource
import signal
import socket
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any, TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from spes.cli import DefaultsHelpFormatter
from spes.config import ServerSection, SpesConfig, load_config, load_sync_sections
from spes.schema import config_help
from spes.sync import plane_tcp
from spes.sync.admission import UNARY_RESERVE, GuardedHealth
from spes.sync.auth import TokenAuthInterceptor, grpc_common_name
from spes.sync.channel import KEEPALIVE_SERVER_OPTIONS, grpc_options, read_file, server_tls
from spes.sync.coordinator import Coordinator
from spes.sync.plane_grpc import SpesServicer
from spes.sync.proto import spes_pb2_grpc as pb_grpc
from spes.sync.settings import DeployConfig, ServerConfig, add_deploy_flags, deploy_from_args
from spes.sync.spec import RunSpec, run_spec
from spes.sync.state import lock_state_dir

log = logging.getLogger("spes.server")
T = TypeVar("T")

SERVICE_NAME = "spes.v1.ParameterServer"
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
        service.guard.stop()
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


class _ServerParser(argparse.ArgumentParser):
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


def spec_of_run(
    path: str | None, overrides: list[str] | tuple[str, ...] = (), checked_flags: dict[str, str] | None = None
) -> RunSpec:
    """The run spec of a node YAML and its overrides, with the manifest of the model it builds (on the meta device);
    without a YAML, of the defaults and the overrides (a SPES run unless they say otherwise), manifest and
    sync_steps and block owners left to the first node to join. `checked_flags`: the first implementation's layout
    flags given with the YAML (`CHECKED_FLAGS`), which must agree with it. ValueError (ConfigError) naming the key or
    file."""
    if path is None:
        return legacy_spec(overrides)
    from spes.model import Transformer  # NOTE: lazy, so a server without RUN.yaml never imports the model

    cfg, _ = load_config(path, overrides)
    for flag, value in (checked_flags or {}).items():
        check_first_implementation_flag(flag, value, cfg.spes_config, path)
    with torch.device("meta"):
        model = Transformer.for_run(cfg)
    return run_spec(cfg, {n: tuple(p.shape) for n, p in model.named_parameters()}, origin=path)


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


def legacy_spec(overrides: list[str] | tuple[str, ...]) -> RunSpec:
    """The spec of a server without the run's YAML (the first implementation's habit): peers, experts per block,
    mode, codec and `server:` section from the overrides; what depends on the model (its manifest, block owners,
    DiLoCo's experts per block) and an unset `sync_steps` left open for the first node to join."""
    s, server, mode = load_sync_sections(overrides)
    if mode == "centralized":
        raise ValueError("--using_spes=false is a centralized run, which has no parameter server")
    given = any(o.startswith("--spes_config.sync_steps=") for o in overrides)
    return RunSpec(
        mode=mode,
        num_peers=s.num_peers,
        experts_per_block=s.num_train_experts_per_node if mode == "spes" else None,
        block_owners=None,
        sync_steps=s.sync_steps if given else None,
        last_step=None,
        overlap_fragments=s.overlap_fragments,
        codec=s.codec,
        codec_settings=tuple(sorted(s.codec_settings.items())),
        server=server,
        origin="the server's command line",
    )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(spec_of_run(args.run, args.overrides, args.checked_flags), deploy_from_args(args))


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
    try:
        stop.wait()
    finally:
        log.info("shutting down")
        server.stop(grace_s=2.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
