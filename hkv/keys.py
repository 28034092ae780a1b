"""Bearer keys kept as salted SHA-256 digests: the config carries these, never a key."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass


@dataclass(frozen=True)
class KeyHash:
    """A bearer key kept as a salted SHA-256 digest.

    The api only compares keys, so the config (written to the run directory as
    config.json) carries this and never the key itself.
    """

    salt: str  # hex of 16 random bytes
    digest: str  # hex of sha256(salt || key)

    @classmethod
    def of(cls, key: str) -> "KeyHash":
        salt = secrets.token_bytes(16)
        return cls(salt.hex(), _key_digest(salt, key).hex())

    def matches(self, token: str) -> bool:
        """Constant-time comparison of `token`'s digest with the key's."""
        return hmac.compare_digest(_key_digest(bytes.fromhex(self.salt), token), bytes.fromhex(self.digest))

    def admits(self, authorization: str) -> bool:
        """An `Authorization` header value of `Bearer <this key>` (the api's and the pd master's check)."""
        scheme, _, token = authorization.partition(" ")
        return scheme.lower() == "bearer" and self.matches(token.strip())


def _key_digest(salt: bytes, key: str) -> bytes:
    return hashlib.sha256(salt + key.encode("utf-8", "surrogateescape")).digest()
