"""TLS for every service: server contexts from a certificate and key, clients that trust an
operator's own CA, and errors that say what to do.

Servers (orchestrator, weight origin, relays, `swarmrl serve`) take `--tls-cert/--tls-key` PEM
files. Clients verify certificates by default whenever a URL is https (httpx and http.client both
do); `--ca-file` adds a CA to the public ones they trust, for runs whose services carry
certificates from the operator's own CA. It is process-wide (SSL_CERT_FILE, which httpx,
http.client and OpenSSL all read) so every client of a role, and every process it starts,
trusts the same CAs.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import ssl
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from swarmrl.errors import SwarmrlError


class TLSError(SwarmrlError, RuntimeError):
    """A TLS problem no retry can fix (an untrusted or wrong-host certificate, a bad key file)."""


def server_context(cert_file: str | Path, key_file: str | Path, *, flag: str = "--tls-cert") -> ssl.SSLContext:
    """A server-side context for `cert_file` (PEM chain) and `key_file` (PEM), TLS 1.2 at least."""
    for path, name in ((cert_file, flag), (key_file, flag.replace("cert", "key"))):
        if not Path(path).is_file():
            raise TLSError(f"{name} {path} does not exist")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(cert_file), str(key_file))
    except (ssl.SSLError, ValueError) as e:
        raise TLSError(
            f"cannot use {cert_file} with {key_file} ({e}): give a PEM certificate (chain) and its PEM private key"
        ) from None
    return ctx


def trust_ca_file(ca_file: str | Path) -> str:
    """Trust `ca_file`'s CA certificates in this process and its children, on top of the public
    CAs (certifi's bundle); returns the bundle's path."""
    path = Path(ca_file)
    try:
        pem = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TLSError(f"--ca-file {ca_file}: {e}") from None
    try:
        ssl.create_default_context(cadata=pem)  # parses every certificate in it
    except (ssl.SSLError, ValueError) as e:
        raise TLSError(f"--ca-file {ca_file} holds no usable PEM CA certificate ({e})") from None
    try:
        import certifi

        public = Path(certifi.where()).read_text()
    except (ImportError, OSError):
        public = ""
    text = public + "\n" + pem
    # Named by its content, not by process: every role of a run (and every run with the same CA)
    # shares one file instead of leaving a 230 KB bundle per process in the temp folder. Written
    # under a name of its own and renamed, so a process reading it never sees half a file.
    bundle = Path(tempfile.gettempdir()) / f"swarmrl-ca-{hashlib.sha256(text.encode()).hexdigest()[:16]}.pem"
    try:
        if not bundle.is_file() or bundle.read_text() != text:
            part = bundle.with_name(f"{bundle.name}.{os.getpid()}.part")
            part.write_text(text)
            os.replace(part, bundle)
    except OSError as e:
        raise TLSError(
            f"--ca-file {ca_file}: cannot write the CA bundle {bundle} ({e}); is the temp folder writable?"
        ) from None
    os.environ["SSL_CERT_FILE"] = str(bundle)
    return str(bundle)


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tls_failure(exc: BaseException) -> ssl.SSLError | None:
    """The SSL error behind `exc` (httpx wraps it), if it is one."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, ssl.SSLError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def explain(url: str, err: ssl.SSLError) -> str:
    reason = getattr(err, "verify_message", None) or getattr(err, "reason", None) or str(err)
    hint = (
        "the certificate is not for this host: use the host name the certificate names"
        if "mismatch" in str(reason).lower() or "hostname" in str(reason).lower()
        else "if it is signed by your own CA, pass --ca-file CA.pem"
    )
    return f"TLS: cannot verify {url} ({reason}); {hint}"


def make_loopback_certificates(folder: str | Path) -> tuple[Path, Path, Path]:
    """A CA of its own and a certificate for 127.0.0.1 / localhost signed by it, in `folder`
    (ca.pem, server.pem, server.key; kept if already there): what `swarmrl rl --async.tls true`
    serves its roles with. Returns (ca, cert, key)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder = Path(folder)
    ca_path, cert_path, key_path = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    if ca_path.is_file() and cert_path.is_file() and key_path.is_file():
        return ca_path, cert_path, key_path
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def build(subject: str, issuer, signer, public, *, ca: bool, sans=None):
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = build(
        "swarmrl run CA",
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "swarmrl run CA")]),
        ca_key,
        ca_key.public_key(),
        ca=True,
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = build(
        "127.0.0.1",
        ca.subject,
        ca_key,
        key.public_key(),
        ca=False,
        sans=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
    )
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    os.chmod(key_path, 0o600)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return ca_path, cert_path, key_path
