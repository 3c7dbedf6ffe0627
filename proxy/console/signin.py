"""Console sign-in: the admin key buys a signed session cookie; every form carries a CSRF token.

Nothing is stored server-side but a short list of signed-out sessions. The cookie is
`<expiry>.<nonce>.<hmac>`, signed with a key derived from the admin key, so changing the
admin key signs everyone out. It is HttpOnly, SameSite=Strict and Path=/console. The CSRF
token of a session is an HMAC of its nonce (a synchronizer token a cross-site form cannot
know); the sign-in form, before any session, uses a double-submit cookie instead. Every POST
must also come from the console's own origin when the browser says where it comes from.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

COOKIE = "clawrl_console"
LOGIN_COOKIE = "clawrl_console_login"
COOKIE_PATH = "/console"
SESSION_TTL_S = 12 * 3600
_SIGNED_OUT_MAX = 10_000


@dataclass(frozen=True)
class ConsoleSession:
    nonce: str
    expires: int
    csrf: str


def _key(admin_key: str, purpose: bytes) -> bytes:
    return hashlib.sha256(b"clawrl-console\0" + purpose + b"\0" + admin_key.encode()).digest()


def _sign(admin_key: str, purpose: bytes, payload: str) -> str:
    return hmac.new(_key(admin_key, purpose), payload.encode(), hashlib.sha256).hexdigest()


def check_admin_key(admin_key: str, given: str) -> bool:
    """Constant-time comparison of two keys of any length (hashes are compared)."""
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(),
                               hashlib.sha256(admin_key.encode()).digest())


def csrf_for(admin_key: str, nonce: str) -> str:
    return _sign(admin_key, b"csrf", nonce)


class SessionBook:
    """Issues and checks session cookies; remembers sessions signed out before they expire."""

    def __init__(self) -> None:
        self._signed_out: OrderedDict[str, int] = OrderedDict()

    def issue(self, admin_key: str, now: float | None = None) -> tuple[str, ConsoleSession]:
        expires = int(now if now is not None else time.time()) + SESSION_TTL_S
        nonce = secrets.token_urlsafe(18)
        payload = f"{expires}.{nonce}"
        cookie = f"{payload}.{_sign(admin_key, b'session', payload)}"
        return cookie, ConsoleSession(nonce, expires, csrf_for(admin_key, nonce))

    def read(self, admin_key: str, cookie: str | None,
             now: float | None = None) -> ConsoleSession | None:
        """The session a cookie holds, or None when it is absent, forged, expired or out."""
        if not cookie or cookie.count(".") != 2:
            return None
        expires_text, nonce, signature = cookie.split(".")
        payload = f"{expires_text}.{nonce}"
        if not hmac.compare_digest(signature, _sign(admin_key, b"session", payload)):
            return None
        expires = int(expires_text) if expires_text.isdigit() else 0
        if expires < (now if now is not None else time.time()) or nonce in self._signed_out:
            return None
        return ConsoleSession(nonce, expires, csrf_for(admin_key, nonce))

    def sign_out(self, session: ConsoleSession) -> None:
        now = time.time()
        self._signed_out[session.nonce] = session.expires
        # Forget entries that have expired anyway, and never hold more than the cap.
        while self._signed_out and (len(self._signed_out) > _SIGNED_OUT_MAX
                                    or next(iter(self._signed_out.values())) < now):
            self._signed_out.popitem(last=False)


def new_login_token() -> str:
    return secrets.token_urlsafe(18)


def same_token(a: str | None, b: str | None) -> bool:
    return bool(a) and bool(b) and hmac.compare_digest(str(a), str(b))
