"""Per-user API keys: generation, hashing, lookup and constant-time verification.

A key looks like `ck-<prefix>-<secret>`. The prefix (public, unique) finds the row; only
sha256(secret) is stored, so a database leak reveals no usable key. Keys are random
(256 bits), so a fast hash is enough (no password stretching needed); the comparison is
constant-time (`hmac.compare_digest`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from proxy.db import ApiKey, User
from proxy.errors import Unauthorized

KEY_PREFIX = "ck"


@dataclass(frozen=True)
class Principal:
    """Who is calling: resolved from a valid, unrevoked API key."""

    user_id: int
    user_name: str
    key_id: int
    rate_limit_rpm: int | None
    train_opt_out: bool
    log_opt_out: bool


@dataclass(frozen=True)
class NewKey:
    prefix: str
    secret: str  # the full key, shown once

    @property
    def hash(self) -> str:
        return hash_secret(self.secret)


def hash_secret(full_key: str) -> str:
    return hashlib.sha256(full_key.encode()).hexdigest()


def generate_key() -> NewKey:
    prefix = secrets.token_hex(6)
    return NewKey(prefix=prefix, secret=f"{KEY_PREFIX}-{prefix}-{secrets.token_urlsafe(32)}")


def parse_prefix(full_key: str) -> str | None:
    parts = full_key.split("-", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or not parts[1] or not parts[2]:
        return None
    return parts[1]


def bearer_token(authorization: str | None) -> str:
    if not authorization:
        raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'.",
                           code="missing_api_key")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("Malformed Authorization header: expected 'Bearer <key>'.")
    return token.strip()


async def lookup_principal(db: AsyncEngine, full_key: str) -> Principal:
    """Resolve a key to its principal or raise Unauthorized (unknown, wrong or revoked)."""
    prefix = parse_prefix(full_key)
    if prefix is None:
        raise Unauthorized("Incorrect API key provided.")
    async with db.connect() as conn:
        row = (await conn.execute(
            select(ApiKey.id, ApiKey.secret_hash, ApiKey.revoked_at, ApiKey.rate_limit_rpm,
                   User.id, User.name, User.train_opt_out, User.log_opt_out)
            .join(User, User.id == ApiKey.user_id)
            .where(ApiKey.prefix == prefix)
        )).first()
    # Compare even when the prefix is unknown, so timing does not reveal which prefixes exist.
    stored = row[1] if row is not None else hash_secret("")
    if not hmac.compare_digest(stored, hash_secret(full_key)) or row is None:
        raise Unauthorized("Incorrect API key provided.")
    if row[2] is not None:
        raise Unauthorized("This API key has been revoked.", code="revoked_api_key")
    return Principal(user_id=row[4], user_name=row[5], key_id=row[0], rate_limit_rpm=row[3],
                     train_opt_out=row[6], log_opt_out=row[7])
