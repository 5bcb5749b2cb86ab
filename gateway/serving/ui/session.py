"""Who may see the dashboard: the admin API's rule, with a login for browsers.

- With an admin key: a browser logs in once with the key and gets a signed, HttpOnly, SameSite=Strict
  session cookie (itsdangerous, as Starlette's SessionMiddleware; the signing secret is derived from
  the key, so changing the key ends every session); a script sends the key as
  ``Authorization: Bearer KEY``. Keys are compared in constant time (``gateway/core/auth.py``).
- Without one: loopback clients only, as the admin API; they get a session cookie without logging in.

The cookie carries a random CSRF token; every form that changes something posts it back and it is
compared in constant time. A request authenticated by its Bearer header needs none (a browser never
adds that header on its own).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from urllib.parse import quote

from itsdangerous import BadSignature, URLSafeTimedSerializer
from starlette.requests import Request

from flywheel.gateway.core.auth import bearer_token
from flywheel.gateway.core.config import Settings
from flywheel.gateway.core.errors import Unauthorized
from flywheel.gateway.serving.gateway_state import GatewayState

COOKIE = "flywheel_dashboard"
MAX_AGE_S = 12 * 3600
PATH = "/flywheel/ui"


class LoginRequired(Exception):  # a redirect, not an error
    """No valid session: the browser goes to the login page, then back to ``next``."""

    def __init__(self, next_path: str) -> None:
        super().__init__(next_path)
        self.next_path = next_path


class PageError(Exception):
    """A page's readable refusal (bad input, unknown id, forbidden) with its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Viewer:
    """An admitted request: its CSRF token (None: authenticated by its Bearer header) and, for a
    loopback client without a session, the cookie to set."""

    csrf: str | None
    keyed: bool  # an admin key is configured (so there is a login and a logout)
    new_cookie: str | None = None


class Sessions:
    """Issues and checks the dashboard's session cookies."""

    def __init__(self, settings: Settings) -> None:
        key = settings.auth.admin_key
        self.keyed = key is not None
        secret = (hmac.new(key.get_secret_value().encode(), b"flywheel dashboard session", hashlib.sha256).digest()
                  if key is not None else secrets.token_bytes(32))  # no key: sessions last as long as the process
        self.serializer = URLSafeTimedSerializer(secret, salt="flywheel-dashboard")

    def issue(self) -> tuple[str, str]:
        """A new session: (the cookie's value, its CSRF token)."""
        token = secrets.token_urlsafe(32)
        return self.serializer.dumps({"csrf": token}), token

    def session(self, request: Request) -> dict[str, str] | None:
        cookie = request.cookies.get(COOKIE)
        if not cookie:
            return None
        try:
            data = self.serializer.loads(cookie, max_age=MAX_AGE_S)
        except BadSignature:  # forged, altered or expired (SignatureExpired is a BadSignature)
            return None
        return data if isinstance(data, dict) and isinstance(data.get("csrf"), str) else None

    def viewer(self, request: Request, *, page: bool = True) -> Viewer:
        """The admitted viewer; else a redirect to the login (``page``) or a 401/403 refusal."""
        auth = GatewayState.of(request).auth
        if self.keyed and bearer_token(request) is not None:
            if not auth.admin_key.matches(bearer_token(request)):
                raise PageError(401, "Wrong admin key in the Authorization header.")
            return Viewer(csrf=None, keyed=True)
        if not self.keyed:
            try:
                auth.admin(request)  # the admin API's rule: loopback clients only
            except Unauthorized as exc:
                raise PageError(403, exc.message) from None
        session = self.session(request)
        if session is not None:
            return Viewer(csrf=session["csrf"], keyed=self.keyed)
        if self.keyed:
            if page:
                raise LoginRequired(request.url.path + (f"?{request.url.query}" if request.url.query else ""))
            raise PageError(401, "Log in first: this needs a dashboard session or the admin key.")
        if not page:
            raise PageError(403, "No dashboard session: reload the page and try again.")
        cookie, token = self.issue()
        return Viewer(csrf=token, keyed=False, new_cookie=cookie)

    def key_matches(self, request: Request, key: str) -> bool:
        return GatewayState.of(request).auth.admin_key.matches(key)


def check_csrf(viewer: Viewer, submitted: str | None) -> None:
    """A form from this dashboard (its session's token), unless the request carried the admin key itself."""
    if viewer.csrf is None:
        return
    if submitted is None or not secrets.compare_digest(submitted.encode(), viewer.csrf.encode()):
        raise PageError(403, "This form has expired or did not come from the dashboard: reload the page and retry.")


def safe_next(target: str | None) -> str:
    """Where to go after the login: a dashboard path only (never another site)."""
    if target and target.startswith(PATH) and not target.startswith("//") and "\\" not in target:
        return target
    return PATH


def login_url(next_path: str) -> str:
    return f"{PATH}/login?next={quote(next_path, safe='')}"
