"""API keys: client keys for the OpenAI API, one admin key for the admin API.

Keys are kept only as SHA-256 digests and compared with ``secrets.compare_digest``
against every configured key (no early exit), so timing says nothing about which key
or how much of it matched. A key is identified in logs and the store by its key id
(``key_`` + the first 12 hex digits of its digest), never by the key itself.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets

from starlette.requests import Request

from flywheel.gateway.core.config import AuthConfig
from flywheel.gateway.core.errors import Unauthorized


def key_id(key: str) -> str:
    """The printable, non-secret name of an API key."""
    return "key_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class KeyRing:
    """A set of accepted keys, matched in constant time."""

    def __init__(self, keys: list[str]) -> None:
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def matches(self, presented: str | None) -> bool:
        if presented is None:
            return False
        digest = hashlib.sha256(presented.encode()).digest()
        found = False
        for known in self._digests:
            found |= secrets.compare_digest(digest, known)
        return found


class Authenticator:
    """Checks requests against the client keys and the admin key."""

    def __init__(self, client_keys: list[str], admin_key: str | None) -> None:
        self.client_keys = KeyRing(client_keys)
        self.admin_key = KeyRing([admin_key] if admin_key else [])

    @classmethod
    def from_config(cls, config: AuthConfig) -> Authenticator:
        return cls([k.get_secret_value() for k in config.api_keys],
                   config.admin_key.get_secret_value() if config.admin_key else None)

    def client(self, request: Request) -> str | None:
        """The caller's key id (None when client auth is off); 401 when the key is wrong."""
        if not self.client_keys:
            return None
        token = bearer_token(request)
        if token is None:
            raise Unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.")
        if not self.client_keys.matches(token):
            raise Unauthorized("Incorrect API key provided.")
        return key_id(token)

    def admin(self, request: Request) -> None:
        """Admin key when one is set; without one, only loopback clients are admitted."""
        if self.admin_key:
            if not self.admin_key.matches(bearer_token(request)):
                raise Unauthorized("The admin API needs the admin key as 'Authorization: Bearer KEY'.")
            return
        host = request.client.host if request.client else ""
        if not _is_loopback(host):
            raise Unauthorized("No admin key is configured: the admin API answers loopback clients only.")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "testclient"  # starlette's in-process TestClient
