"""Shared helpers for the sync tests: tiny SPES-named models, in-process servers, TLS certificates."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from spes.sync.merge import Mode, trainable_names

if TYPE_CHECKING:
    from spes.sync.client import SyncClient, SyncStats
    from spes.sync.server import ParameterServer

TOKEN = "test-token-0123456789"


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


def random_tensors(manifest: dict[str, tuple[int, ...]], names: list[str], seed: int) -> dict[str, torch.Tensor]:
    """Random fp32 tensors for `names`, reproducible from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(manifest[name], generator=gen) for name in names}


def peer_upload(manifest: dict[str, tuple[int, ...]], peer: int, mode: Mode, seed: int) -> dict[str, torch.Tensor]:
    """What `peer` would upload in a round: random values for the names it trains."""
    return random_tensors(manifest, trainable_names(list(manifest), peer, mode), seed=seed * 100 + peer)


@contextlib.contextmanager
def running_server(**overrides: object) -> Iterator[tuple[ParameterServer, str]]:
    """An in-process server on 127.0.0.1 with an OS-chosen port; yields (server, "127.0.0.1:port")."""
    from spes.sync.server import ServerConfig, start_server  # NOTE: lazy, so the pure-math tests need no gRPC

    settings: dict[str, object] = {"host": "127.0.0.1", "port": 0, "num_peers": 2, "experts_per_peer": 2}
    settings.update(overrides)
    server = start_server(ServerConfig(**settings))  # type: ignore[arg-type]
    try:
        yield server, f"127.0.0.1:{server.port}"
    finally:
        server.stop(grace_s=0.5)


def sync_all(
    clients: Sequence[SyncClient], step: int, uploads: dict[int, dict[str, torch.Tensor]], timeout_s: float = 60.0
) -> dict[int, tuple[dict[str, torch.Tensor], SyncStats]]:
    """Run every peer's blocking `sync` concurrently (peer p = clients[p]) and collect the results."""
    with ThreadPoolExecutor(len(clients)) as pool:
        futures = {p: pool.submit(client.sync, step, uploads[p]) for p, client in enumerate(clients)}
        return {p: future.result(timeout=timeout_s) for p, future in futures.items()}


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
