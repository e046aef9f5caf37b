"""Shared helpers for the sync tests: tiny SPES-named models and their run specs, in-process servers, clients and
their Join requests, TLS certificates, and the check of a round against the pure round function."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from spes.config import ServerSection, SpesConfig
from spes.sync.codecs.interface import Served
from spes.sync.fragments import WHOLE
from spes.sync.merge import build_global
from spes.sync.proto import spes_pb2 as pb
from spes.sync.proto import spes_pb2_grpc as pb_grpc
from spes.sync.protocol import PROTOCOL_VERSION, Mode
from spes.sync.rounds import Completed
from spes.sync.spec import RunSpec

if TYPE_CHECKING:
    from spes.sync.client import SyncClient, SyncStats
    from spes.sync.server import ParameterServer

TOKEN = "test-token-0123456789"
NO_MERGE = ServerSection(merge_interval=0)
"""A run's `server:` section without the merge warm-up."""


def tiny_manifest(
    *, num_layers: int = 2, num_blocks: int = 2, k: int = 2, d: int = 8, f: int = 4
) -> dict[str, tuple[int, ...]]:
    """Names and shapes following the model's convention, small enough for fast tests."""
    manifest: dict[str, tuple[int, ...]] = {"embed.weight": (16, d)}
    for layer in range(num_layers):
        manifest[f"blocks.{layer}.attn.qkv.weight"] = (3 * d, d)
        manifest[f"blocks.{layer}.attn_norm.weight"] = (d,)
        manifest[f"blocks.{layer}.ffn.router.weight"] = (num_blocks * k, d)
        for b in range(num_blocks):
            manifest[f"blocks.{layer}.ffn.experts.w1.{b}"] = (k, d, f)
            manifest[f"blocks.{layer}.ffn.experts.v1.{b}"] = (k, d, f)
            manifest[f"blocks.{layer}.ffn.experts.w2.{b}"] = (k, f, d)
    manifest["lm_head.weight"] = (16, d)
    return manifest


def tiny_spec(
    *,
    mode: Mode = "spes",
    num_peers: int = 2,
    num_blocks: int | None = None,
    k: int = 2,
    num_layers: int = 2,
    d: int = 8,
    f: int = 4,
    sync_steps: int = 1,
    overlap_fragments: int = 1,
    codec: str = "fp32",
    codec_settings: dict[str, int] | None = None,
    server: ServerSection | None = None,
) -> RunSpec:
    """The run spec of a tiny model: SPES with one block of `k` experts per peer (DiLoCo: one block), peer b owning
    block b, a round every `sync_steps` steps (the server admits only the next one) and no last step; `server`
    defaults to the section's defaults."""
    blocks = (num_peers if mode == "spes" else 1) if num_blocks is None else num_blocks
    return RunSpec(
        mode=mode,
        num_peers=num_peers,
        experts_per_block=k,
        block_owners=tuple(range(blocks)) if mode == "spes" else (),
        sync_steps=sync_steps,
        overlap_fragments=overlap_fragments,
        codec=codec,
        codec_settings=tuple(sorted((codec_settings or {}).items())),
        manifest=tiny_manifest(num_layers=num_layers, num_blocks=blocks, k=k, d=d, f=f),
        server=server or ServerSection(),
    )


def random_tensors(manifest: dict[str, tuple[int, ...]], names: list[str], seed: int) -> dict[str, torch.Tensor]:
    """Random fp32 tensors for `names`, reproducible from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(manifest[name], generator=gen) for name in names}


def peer_upload(spec: RunSpec, peer: int, seed: int) -> dict[str, torch.Tensor]:
    """What `peer` would upload in a round: random values for the names it trains."""
    assert spec.manifest is not None
    return random_tensors(spec.manifest, spec.trainable(peer), seed=seed * 100 + peer)


def completed(step: int, peers: Collection[int] = (0,), model: dict[str, torch.Tensor] | None = None) -> Completed:
    """A completed whole round of a raw codec, built by `peers`, of `model` (default: one tensor)."""
    model = {"x": torch.ones(1)} if model is None else model
    return Completed(step, frozenset(peers), WHOLE, 0.0, model, {}, Served(step, model))


@contextlib.contextmanager
def running_server(spec: RunSpec | None = None, **deploy: object) -> Iterator[tuple[ParameterServer, str]]:
    """An in-process server of `spec` (default: `tiny_spec()`) on 127.0.0.1 with an OS-chosen port and the
    `DeployConfig` settings `deploy`; yields (server, "127.0.0.1:port")."""
    from spes.sync.server import start_server  # NOTE: lazy, so the pure-math tests need no gRPC
    from spes.sync.settings import DeployConfig, ServerConfig

    settings: dict[str, object] = {"host": "127.0.0.1", "port": 0, **deploy}
    server = start_server(ServerConfig(spec or tiny_spec(), DeployConfig(**settings)))  # type: ignore[arg-type]
    try:
        yield server, f"127.0.0.1:{server.port}"
    finally:
        server.stop(grace_s=0.5)


def make_client(
    addr: str, spec: RunSpec, peer: int, *, token: str | None = None, reuse_buffers: bool = False, **settings: object
) -> SyncClient:
    """A client of peer `peer` of `spec` at `addr`; `settings`: `spes_config` keys (rpc_timeout_s, max_retries,
    data_plane, tls_ca, ...)."""
    from spes.sync.client import SyncClient

    return SyncClient(
        spec,
        peer,
        SpesConfig(server_addr=addr, **settings),
        token=token,
        reuse_buffers=reuse_buffers,  # type: ignore[arg-type]
    )


def sync_all(
    clients: Sequence[SyncClient], step: int, uploads: dict[int, dict[str, torch.Tensor]], timeout_s: float = 60.0
) -> dict[int, tuple[dict[str, torch.Tensor], SyncStats]]:
    """Run every peer's blocking `sync` concurrently (peer p = clients[p]) and collect the results."""
    with ThreadPoolExecutor(len(clients)) as pool:
        futures = {p: pool.submit(client.sync, step, uploads[p]) for p, client in enumerate(clients)}
        return {p: future.result(timeout=timeout_s) for p, future in futures.items()}


@contextlib.contextmanager
def joined_clients(
    addr: str,
    spec: RunSpec,
    *,
    per_peer: Callable[[int], dict[str, Any]] | None = None,
    token: str | None = None,
    **settings: object,
) -> Iterator[list[SyncClient]]:
    """Peers 0..num_peers-1 of `spec`, joined; `per_peer(p)` adds peer p's own settings (e.g. its certificate)."""
    with contextlib.ExitStack() as stack:
        clients = []
        for peer in range(spec.num_peers):
            own = {"rpc_timeout_s": 10, "round_timeout_s": 30, **settings, **(per_peer(peer) if per_peer else {})}
            client = stack.enter_context(make_client(addr, spec, peer, token=token, **own))
            client.join()
            clients.append(client)
        yield clients


def check_round(results: dict, uploads: dict, spec: RunSpec, *, step: int) -> None:
    """Each peer got exactly what it needs, equal to build_global over the uploads."""
    want = build_global(uploads, spec=spec, step=step).tensors
    for peer, (got, stats) in results.items():
        assert stats.round == step
        assert sorted(got) == sorted(spec.downloads(peer, merged=stats.merged))
        for name, tensor in got.items():
            assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
            torch.testing.assert_close(tensor, want[name], rtol=0, atol=0)


def join_request(
    peer: int,
    spec: RunSpec | None = None,
    *,
    manifest: dict[str, tuple[int, ...]] | None = None,
    run_id: str = "",
) -> pb.JoinRequest:
    """Peer `peer`'s Join of `spec` (default: `tiny_spec()`) in run `run_id` ("": a fresh node), announcing
    `manifest` (default: the spec's)."""
    spec = spec or tiny_spec()
    shapes = (spec.manifest or {}) if manifest is None else manifest
    return pb.JoinRequest(
        peer_id=peer,
        manifest=[pb.TensorSpec(name=n, shape=s) for n, s in shapes.items()],
        protocol=PROTOCOL_VERSION,
        spec=spec.to_proto(),
        run_id=run_id,
    )


@contextlib.contextmanager
def stub_for(addr: str) -> Iterator[pb_grpc.ParameterServerStub]:
    """A raw stub of the server at `addr`, for the tests that speak the protocol without a client."""
    with grpc.insecure_channel(addr) as channel:
        yield pb_grpc.ParameterServerStub(channel)


def _write_cert(
    directory: Path,
    name: str,
    *,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None = None,
    is_ca: bool = False,
) -> tuple[Path, Path, x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Write a P-256 cert/key pair for localhost/127.0.0.1, self-signed or signed by `issuer`."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_cert, issuer_key = issuer if issuer is not None else (None, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_cert.subject if issuer_cert is not None else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if not is_ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    cert = builder.sign(issuer_key, hashes.SHA256())
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path, cert, key


@dataclass(frozen=True)
class Pki:
    """A CA with a server certificate it signed; paths come as the keyword arguments the server/client take."""

    directory: Path
    ca: str
    server: dict[str, str]
    ca_cert: x509.Certificate
    ca_key: ec.EllipticCurvePrivateKey

    def issue(self, name: str) -> dict[str, str]:
        """A client certificate with common name `name`, signed by the CA: {"tls_cert": ..., "tls_key": ...}."""
        crt, key, _, _ = _write_cert(self.directory, name, issuer=(self.ca_cert, self.ca_key))
        return {"tls_cert": str(crt), "tls_key": str(key)}

    @property
    def client(self) -> dict[str, str]:
        return self.issue("client")


def write_pki(directory: Path) -> Pki:
    ca_crt, _, ca_cert, ca_key = _write_cert(directory, "ca", is_ca=True)
    srv_crt, srv_key, _, _ = _write_cert(directory, "server", issuer=(ca_cert, ca_key))
    return Pki(directory, str(ca_crt), {"tls_cert": str(srv_crt), "tls_key": str(srv_key)}, ca_cert, ca_key)
