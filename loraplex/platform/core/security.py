"""API keys: generation, hashing and display prefixes.

Keys are 256-bit random (``secrets.token_urlsafe(32)``) with a readable
prefix, so a single unsalted SHA-256 is enough to store them (the key space
cannot be brute-forced, unlike passwords); lookups are by hash.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

TENANT_KEY_PREFIX = "lpx-"
ADMIN_KEY_PREFIX = "lpx-admin-"
DISPLAY_PREFIX_CHARS = 12


@dataclass(frozen=True)
class NewKey:
    """A freshly generated key: ``plaintext`` is shown once and never stored."""

    plaintext: str
    key_hash: str
    prefix: str


def hash_key(plaintext: str) -> str:
    """sha256 hex digest of the key's UTF-8 bytes (64 characters)."""
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


def display_prefix(plaintext: str) -> str:
    """The first characters of a key, safe to show in listings."""
    return plaintext[:DISPLAY_PREFIX_CHARS]


def generate_key(prefix: str = TENANT_KEY_PREFIX) -> NewKey:
    """A new high-entropy key (43 url-safe characters after ``prefix``)."""
    plaintext = prefix + secrets.token_urlsafe(32)
    return NewKey(plaintext=plaintext, key_hash=hash_key(plaintext), prefix=display_prefix(plaintext))


def key_matches(plaintext: str, key_hash: str) -> bool:
    """Constant-time check of ``plaintext`` against a stored hash."""
    return hmac.compare_digest(hash_key(plaintext), key_hash)



def parse_bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None when absent/malformed."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
