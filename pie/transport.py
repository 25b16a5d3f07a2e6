"""The control↔backend link's security: who may talk to a backend over tcp://.

A backend reachable over the network runs the model for whoever sends it a batch, and a
batch names physical KV pages: an unauthenticated peer could read or overwrite any user's
cache. So a tcp:// endpoint off loopback needs a shared secret (`backend.secret_file`, or
`PIE_BACKEND_SECRET`), and every frame then goes through ZeroMQ's CURVE security
(Curve25519 keys, authenticated encryption): both key pairs are derived from the secret, so
the operator shares one string, and the backend's ZAP handler admits only the control
side's key. A wrong or missing secret fails CURVE's handshake; the control side's socket
monitor sees ZeroMQ's handshake-failed event and says so (`handshake_failure`), instead of
waiting for a reply that never comes. ipc:// endpoints (a spawned backend's private socket, mode
0700 directory) and tcp on loopback need no secret.

Used by both ends of the link (pie/backend/server.py binds, pie/control/* connect), hence
beside pie/protocol.py.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import urllib.parse
from pathlib import Path

import zmq
import zmq.auth.thread
import zmq.utils.monitor

SECRET_ENV = "PIE_BACKEND_SECRET"
MIN_SECRET_BYTES = 16


class TransportError(RuntimeError):
    """An endpoint that may not be used as configured, or a peer that failed to authenticate."""


def load_secret(secret_file: str) -> bytes | None:
    """The shared secret: `PIE_BACKEND_SECRET`, else the contents of `secret_file` (stripped),
    else None."""
    if value := os.environ.get(SECRET_ENV):
        secret = value.encode()
    elif secret_file:
        path = Path(secret_file).expanduser()
        try:
            secret = path.read_bytes().strip()
        except OSError as e:
            raise TransportError(f"backend.secret_file {str(path)!r} cannot be read: {e.strerror}") from None
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise TransportError(f"the backend secret must be at least {MIN_SECRET_BYTES} bytes (`pie token` makes one)")
    return secret


def is_loopback(endpoint: str) -> bool:
    """Whether a tcp:// endpoint stays on this machine (ipc:// and inproc:// always do)."""
    if not endpoint.startswith("tcp://"):
        return True
    host = urllib.parse.urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or a wildcard (*): reachable from elsewhere


def for_endpoint(endpoint: str, secret: bytes | None) -> bytes | None:
    """The secret a link on `endpoint` uses: tcp links only (an ipc:// socket is private to
    this machine's user; a spawned backend inherits PIE_BACKEND_SECRET and must not use it)."""
    return secret if endpoint.startswith("tcp://") else None


def check_endpoint(endpoint: str, secret: bytes | None) -> None:
    if secret is None and not is_loopback(endpoint):
        raise TransportError(f"{endpoint} is reachable from other machines: set backend.secret_file (or "
                             f"{SECRET_ENV}) on both ends, so that only your control process can use the "
                             f"backend; an unauthenticated backend is only served on loopback or ipc://")


def _keypair(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys of `role`, derived from the shared secret."""
    private = zmq.utils.z85.encode(hashlib.sha256(b"pie-backend-curve\0" + role + b"\0" + secret).digest())
    return zmq.curve_public(private), private


def secure_server(socket: zmq.Socket, context: zmq.Context, secret: bytes) -> zmq.auth.thread.ThreadAuthenticator:
    """Make a bound backend socket a CURVE server admitting only the control side's key;
    returns the ZAP authenticator thread (stop it when the socket closes)."""
    server_public, server_private = _keypair(secret, b"server")
    client_public, _ = _keypair(secret, b"client")
    auth = zmq.auth.thread.ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_OnlyKey(client_public))
    socket.curve_secretkey, socket.curve_publickey = server_private, server_public
    socket.curve_server = True
    return auth


class _OnlyKey:
    """pyzmq's CURVE credentials provider: `callback` gets the client's Z85 public key."""

    def __init__(self, key: bytes):
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


def secure_client(socket: zmq.Socket, secret: bytes | None) -> None:
    """CURVE client keys on a socket about to connect (nothing without a secret)."""
    if secret is None:
        return
    server_public, _ = _keypair(secret, b"server")
    client_public, client_private = _keypair(secret, b"client")
    socket.curve_serverkey = server_public
    socket.curve_publickey, socket.curve_secretkey = client_public, client_private


def watch_handshakes(socket: zmq.Socket) -> zmq.Socket:
    """A monitor socket reporting the link's handshake outcomes (`handshake_failure`)."""
    return socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_SUCCEEDED)


def handshake_failure(monitor: zmq.Socket, endpoint: str) -> str | None:
    """Why the link's security handshake failed, from the events seen so far; None if none did."""
    while monitor.poll(0):
        event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return f"the backend at {endpoint} refused our key (backend.secret_file / {SECRET_ENV})"
        if event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
            # A wrong secret derives another server key too, so CURVE fails as a protocol
            # error, the same as a missing secret on one side: one message for both.
            return (f"the security handshake with {endpoint} failed: the two ends' backend secrets differ, "
                    f"or one has none (backend.secret_file / {SECRET_ENV}), or the peer is not a Pie backend")
    return None
