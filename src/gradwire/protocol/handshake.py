"""Mutual HMAC-SHA256 challenge-response on the job secret, as a pure state machine.

Each side sends HELLO {role, rank, nonce} with a fresh 16-byte nonce, then PROOF {mac}, where::

    mac = HMAC(secret, "gradwire-v1" | direction | own nonce | peer nonce | own role)

The secret never crosses the wire; fresh nonces on both sides defeat replay; the direction byte stops a
peer from reflecting our own proof back; the comparison is constant-time. A peer that fails is dropped
before any other message is read. With an empty secret the same exchange runs (and proves nothing,
which docs/security.md says).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field

from gradwire.errors import AuthenticationError, RemoteProtocolError

NONCE_BYTES = 16
_LABEL = b"gradwire-v1"


@dataclass
class Handshake:
    """One side of the handshake. Feed it the peer's HELLO and PROOF bodies; it says what to send."""

    secret: bytes = field(repr=False)
    role: str
    rank: int
    initiator: bool
    nonce: bytes = field(default_factory=lambda: os.urandom(NONCE_BYTES))
    peer: dict | None = None

    def hello(self) -> dict:
        """The body of our HELLO."""
        return {"role": self.role, "rank": self.rank, "nonce": self.nonce.hex()}

    def receive_hello(self, body: dict) -> dict:
        """Take the peer's HELLO; return the body of our PROOF."""
        try:
            peer_nonce = bytes.fromhex(body["nonce"])
            role, rank = str(body["role"]), int(body["rank"])
        except (KeyError, ValueError, TypeError) as e:
            raise RemoteProtocolError(f"malformed HELLO: {e!r}") from None
        if len(peer_nonce) != NONCE_BYTES:
            raise RemoteProtocolError(f"HELLO nonce must be {NONCE_BYTES} bytes, got {len(peer_nonce)}")
        if peer_nonce == self.nonce:
            raise AuthenticationError("peer echoed our own nonce: a reflection attempt")
        self.peer = {"role": role, "rank": rank, "nonce": peer_nonce}
        return {"mac": self._mac(self.initiator, self.nonce, peer_nonce, self.role).hex()}

    def receive_proof(self, body: dict) -> None:
        """Check the peer's PROOF; raises AuthenticationError if it does not hold the secret."""
        if self.peer is None:
            raise RemoteProtocolError("PROOF before HELLO")
        try:
            mac = bytes.fromhex(body["mac"])
        except (KeyError, ValueError, TypeError) as e:
            raise RemoteProtocolError(f"malformed PROOF: {e!r}") from None
        expected = self._mac(not self.initiator, self.peer["nonce"], self.nonce, self.peer["role"])
        if not hmac.compare_digest(mac, expected):
            raise AuthenticationError(
                f"{self.peer['role']} {self.peer['rank']} failed authentication: wrong job secret "
                "(set the same GRADWIRE_SECRET on every node)"
            )

    def _mac(self, from_initiator: bool, own: bytes, other: bytes, role: str) -> bytes:
        direction = b"I" if from_initiator else b"A"
        message = _LABEL + direction + own + other + role.encode()
        return hmac.new(self.secret, message, hashlib.sha256).digest()
