"""Worker identity and signed requests.

A worker's identity is an ed25519 public key; the private key lives in a file the worker creates
on first start. Every mutating request carries five headers and is signed over

    swarmrl-v2 \\n RUN \\n METHOD \\n PATH \\n sha256(body) hex \\n TIMESTAMP \\n NONCE

so a signature cannot be moved to another run, another endpoint, another body or another time.
RUN is the orchestrator's run id (GET /v1/status): a request signed for one run is refused by
every other, so one key may safely join many runs and a submission cannot be replayed where its
lease means something else. The orchestrator refuses a timestamp outside its clock-skew window and
a nonce it has already seen from that key within the window (nonces are kept in SQLite, so a
restart does not reopen replays). The query string is not signed: no mutating endpoint takes one.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import time
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

_LOWER_HEX = re.compile(r"[0-9a-f]{64}")

H_RUN = "x-swarmrl-run"
H_KEY = "x-swarmrl-key"
H_TIMESTAMP = "x-swarmrl-timestamp"
H_NONCE = "x-swarmrl-nonce"
H_SIGNATURE = "x-swarmrl-signature"
SIGNED_HEADERS = (H_KEY, H_TIMESTAMP, H_NONCE, H_SIGNATURE)
_RUN_ID = re.compile(r"[0-9a-f]{32}")
# The first line of every signed message: a signature made under another scheme never verifies.
SCHEME = "swarmrl-v2"


class AuthError(ValueError):
    """A request whose signature, timestamp or nonce is not acceptable; the message says which."""


class ClockSkew(AuthError):
    """The timestamp is outside the window: the clocks disagree (retryable once they agree)."""


class WrongRun(AuthError):
    """The request was signed for another run (or for none): never retryable as it is."""


def new_run_id() -> str:
    return secrets.token_hex(16)


def load_or_create_key(path: str | Path) -> Ed25519PrivateKey:
    """The worker's private key from `path`, created (mode 0600) on first use."""
    path = Path(path)
    if path.exists():
        data = path.read_bytes()
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except ValueError as e:
            raise AuthError(f"{path} is not a PEM private key ({e}); delete it to create a new identity") from e
        if not isinstance(key, Ed25519PrivateKey):
            raise AuthError(f"{path} holds a {type(key).__name__}, not an ed25519 key; delete it to create a new one")
        return key
    path.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    # O_EXCL: two workers started on the same file never overwrite each other's identity.
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    try:
        os.link(tmp, path)  # fails if another process created the key meanwhile
    except FileExistsError:
        os.unlink(tmp)
        return load_or_create_key(path)
    os.unlink(tmp)
    return key


def public_key_hex(key: Ed25519PrivateKey) -> str:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def signing_message(run_id: str, method: str, path: str, body: bytes, timestamp: str, nonce: str) -> bytes:
    return "\n".join(
        [SCHEME, run_id, method.upper(), path, hashlib.sha256(body).hexdigest(), timestamp, nonce]
    ).encode()


def sign_headers(
    key: Ed25519PrivateKey, run_id: str, method: str, path: str, body: bytes, *, now: float | None = None
) -> dict[str, str]:
    if not _RUN_ID.fullmatch(run_id or ""):
        raise ValueError(f"run id must be 32 lowercase hex characters (GET /v1/status), got {run_id!r}")
    ts = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(16)
    sig = key.sign(signing_message(run_id, method, path, body, ts, nonce))
    return {H_RUN: run_id, H_KEY: public_key_hex(key), H_TIMESTAMP: ts, H_NONCE: nonce, H_SIGNATURE: sig.hex()}


def _hex(value: str, nbytes: int, what: str) -> bytes:
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raw = b""
    if len(raw) != nbytes:
        raise AuthError(f"header {what} must be {2 * nbytes} hex characters")
    return raw


def verify_request(
    headers: dict[str, str],
    method: str,
    path: str,
    body: bytes,
    *,
    run_id: str,
    max_skew_s: float,
    now: float | None = None,
) -> tuple[str, str, float]:
    """Check the run, signature and timestamp of a request; return (key hex, nonce, timestamp).

    The nonce is only checked for shape here; uniqueness is the store's job."""
    missing = [h for h in SIGNED_HEADERS if not headers.get(h)]
    if missing:
        raise AuthError(f"unsigned request: missing header(s) {', '.join(missing)}; sign it with the worker key")
    claimed = headers.get(H_RUN)
    if not claimed:
        raise WrongRun(
            f"request not bound to a run: header {H_RUN} is missing. Sign requests with the run id "
            "of GET /v1/status (swarmrl protocol v2); an older worker must be upgraded"
        )
    if claimed != run_id:
        raise WrongRun(
            f"request signed for run {claimed[:40]!r}, but this orchestrator serves run {run_id}: "
            "a signature is only valid in the run it was made for; read the run id from "
            "GET /v1/status of the orchestrator you talk to"
        )
    key_hex, ts, nonce, sig = (headers[h] for h in SIGNED_HEADERS)
    if not _LOWER_HEX.fullmatch(key_hex):
        # One spelling per key: bytes.fromhex would accept upper case and spaces, and the header
        # text is the identity (nonces, leases, bans), so variants would dodge all three.
        raise AuthError(f"header {H_KEY} must be exactly 64 lowercase hex characters")
    raw_key = _hex(key_hex, 32, H_KEY)
    try:
        pub = Ed25519PublicKey.from_public_bytes(raw_key)
    except ValueError:
        raise AuthError(f"header {H_KEY} is not an ed25519 public key") from None
    signature = _hex(sig, 64, H_SIGNATURE)
    if not (8 <= len(nonce) <= 64 and nonce.isalnum()):
        raise AuthError(f"header {H_NONCE} must be 8-64 letters or digits")
    try:
        t = float(ts)
    except ValueError:
        raise AuthError(f"header {H_TIMESTAMP} must be unix seconds, got {ts[:40]!r}") from None
    now = time.time() if now is None else now
    if not abs(now - t) <= max_skew_s:  # `not <=` also refuses nan
        raise ClockSkew(
            f"timestamp {ts[:40]} is more than {max_skew_s:.0f} s from the orchestrator's clock "
            f"({now:.0f}); check the worker's clock"
        )
    try:
        pub.verify(signature, signing_message(run_id, method, path, body, ts, nonce))
    except InvalidSignature:
        raise AuthError("bad signature: it does not match this key, run, method, path and body") from None
    return key_hex, nonce, t
