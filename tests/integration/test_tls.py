"""TLS on the services (issue 18), with a CA and certificates made inside the test: real
processes serving https on 127.0.0.1, clients that verify, a wrong-host certificate refused."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from swarmrl.model.checkpoint import build_tiny_policy, save_policy
from swarmrl.protocol.tls import TLSError, server_context, trust_ca_file
from swarmrl.transport.broadcast import ShardServer, fetch_manifest, publish_version

from harness import read_url_file, wait_for
from orchestrator_harness import make_run_dir

pytestmark = pytest.mark.timeout(300)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, issuer_key, issuer: x509.Name, key, *, ca: bool, sans=()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key=None) -> None:
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """ca.pem; server.pem/.key for 127.0.0.1 and localhost; wronghost.pem/.key for another name."""
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("swarmrl test CA", ca_key, _name("swarmrl test CA"), ca_key, ca=True)
    _write(d / "ca", ca)
    for name, sans in (
        ("server", [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
        ("wronghost", [x509.DNSName("other.example")]),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        _write(d / name, _cert(name, ca_key, ca.subject, key, ca=False, sans=sans), key)
    return d


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swarmrl.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in os.environ.items() if k != "SSL_CERT_FILE"},
    )


class _Orchestrator:
    def __init__(self, run: Path, *tls: str):
        self.log = open(run.parent / f"orch-{run.name}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "swarmrl.cli", "orchestrator", "--run-dir", str(run), "--port", "0", *tls],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        log = run.parent / f"orch-{run.name}.log"
        self.url = wait_for(
            lambda: read_url_file(run / "orchestrator.json"), 60, "orchestrator.json", proc=self.proc, log=log
        )

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def test_orchestrator_over_https_verified_with_the_run_ca(pki, tmp_path):
    run = make_run_dir(tmp_path / "run")
    orch = _Orchestrator(run, "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"))
    try:
        assert orch.url.startswith("https://127.0.0.1:")
        ok = _cli("status", "--orchestrator", orch.url, "--ca-file", str(pki / "ca.pem"), "--json")
        assert ok.returncode == 0, ok.stderr
        assert len(json.loads(ok.stdout)["run"]["run_id"]) == 32
        # Without the CA the certificate cannot be verified: a clear refusal, no traceback, no retrying.
        bad = _cli(
            "worker",
            "--orchestrator",
            orch.url,
            "--cache-dir",
            str(tmp_path / "w"),
            "--key-file",
            str(tmp_path / "w.pem"),
        )
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
        assert "TLS: cannot verify" in bad.stderr and "--ca-file" in bad.stderr
        with pytest.raises(httpx.ConnectError):
            httpx.get(orch.url + "/healthz")  # plain clients verify too
        trusted = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        assert httpx.get(orch.url + "/healthz", verify=trusted).json() == {"ok": True}
    finally:
        orch.stop()


def test_a_certificate_for_another_host_is_refused(pki, tmp_path):
    run = make_run_dir(tmp_path / "run")
    orch = _Orchestrator(run, "--tls-cert", str(pki / "wronghost.pem"), "--tls-key", str(pki / "wronghost.key"))
    try:
        out = _cli("status", "--orchestrator", orch.url, "--ca-file", str(pki / "ca.pem"))
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert "not for this host" in out.stderr or "mismatch" in out.stderr.lower(), out.stderr
    finally:
        orch.stop()


def test_weight_origin_over_https(pki, tmp_path, monkeypatch):
    model, tok = build_tiny_policy(seed=0)
    save_policy(model, tok, tmp_path / "v0")
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from swarmrl.protocol.signing import public_key_hex

    key = Ed25519PrivateKey.generate()
    (tmp_path / "root").mkdir()
    publish_version(tmp_path / "v0", tmp_path / "root", 0, key=key)
    tls = server_context(pki / "server.pem", pki / "server.key")
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with ShardServer(tmp_path / "root", tls=tls) as server:
        assert server.url.startswith("https://")
        with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            fetch_manifest(0, [server.url], public_key=public_key_hex(key))
        monkeypatch.setenv("SSL_CERT_FILE", "")  # restored after the test; trust_ca_file sets it
        trust_ca_file(pki / "ca.pem")
        manifest = fetch_manifest(0, [server.url], public_key=public_key_hex(key))
        assert manifest["version"] == 0
        # A client that connects and never says hello holds one connection slot, not the server.
        import socket

        idle = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
        try:
            assert fetch_manifest(0, [server.url], public_key=public_key_hex(key))["version"] == 0
        finally:
            idle.close()


def test_the_ca_bundle_is_one_file_per_ca_not_one_per_process(pki, monkeypatch):
    """Every process given --ca-file writes the bundle it trusts; named by content, the roles of a
    run share one file (named by process id, a CI run left 24 of 230 KB each in /tmp)."""
    monkeypatch.setenv("SSL_CERT_FILE", "")
    first = trust_ca_file(pki / "ca.pem")
    assert trust_ca_file(pki / "ca.pem") == first and os.environ["SSL_CERT_FILE"] == first
    assert (pki / "ca.pem").read_text() in Path(first).read_text()
    assert not list(Path(first).parent.glob(Path(first).name + ".*.part"))


def test_bad_tls_settings_fail_clearly(pki, tmp_path):
    with pytest.raises(TLSError, match="does not exist"):
        server_context(tmp_path / "nope.pem", pki / "server.key")
    with pytest.raises(TLSError, match="cannot use"):
        server_context(pki / "server.pem", pki / "wronghost.key")  # a key that is not the certificate's
    (tmp_path / "junk.pem").write_text("not a certificate")
    out = _cli("status", "--orchestrator", "https://127.0.0.1:9", "--ca-file", str(tmp_path / "junk.pem"))
    assert out.returncode == 2 and "holds no usable PEM CA certificate" in out.stderr
    out = _cli("worker", "--orchestrator", "http://192.0.2.10:8000", "--cache-dir", str(tmp_path / "w"))
    assert out.returncode == 2 and "plain http to another machine" in out.stderr and "--insecure" in out.stderr
