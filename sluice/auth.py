"""API keys, tiers and rate limits, shared by the server and the gateway (torch-free).

Keys file (YAML or JSON)::

    keys:
      sk-team-a: {tier: p0, rpm: 600, tpm: 200000}   # may send p0; 600 req/min, 200k tok/min
      sk-batch:  {tier: p2}                          # capped at p2, no rate limit
    admin_keys: [sk-admin]                           # gateway /admin/... endpoints

``--api-key KEY`` (repeatable) adds keys with tier p0 and no limit.  Keys are
compared in constant time and never logged: ``KeyInfo.name`` is a short,
non-reversible fingerprint for logs.

Rate limits are token buckets (capacity = one minute's allowance, refilled
continuously), pure functions of an injected clock.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from sluice.errors import AuthenticationError, InvalidRequestError, RateLimitError
from sluice.types import Priority, parse_priority

__all__ = ["KeyInfo", "KeyStore", "load_keys_file", "fingerprint", "RateLimiter"]


def fingerprint(key: str) -> str:
    """A log-safe name for a key: ``key-`` + 8 hex chars of its SHA-256."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class KeyInfo:
    name: str  # fingerprint, safe to log
    tier: Priority = Priority.P0  # most urgent class this key may use
    rpm: float | None = None  # requests per minute, None: unlimited
    tpm: float | None = None  # tokens per minute (prompt + max_tokens), None: unlimited
    is_admin: bool = False

    def cap(self, priority: Priority) -> Priority:
        """Clamp a requested class to the key's tier (P0 < P1 < P2 in urgency order)."""
        return Priority(max(int(priority), int(self.tier)))


ANONYMOUS = KeyInfo(name="anonymous", tier=Priority.P0)


@dataclass
class KeyStore:
    """Maps presented bearer tokens to ``KeyInfo``.  Empty store: auth disabled."""

    _by_digest: dict[bytes, KeyInfo] = field(default_factory=dict)

    @staticmethod
    def _digest(key: str) -> bytes:
        return hashlib.sha256(key.encode()).digest()

    def add(self, key: str, info: KeyInfo | None = None) -> None:
        if not key:
            raise InvalidRequestError("an API key must not be empty")
        self._by_digest[self._digest(key)] = info or KeyInfo(name=fingerprint(key))

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    @property
    def has_admin(self) -> bool:
        return any(k.is_admin for k in self._by_digest.values())

    def authenticate(self, authorization: str | None) -> KeyInfo:
        """Check an ``Authorization: Bearer <key>`` header value.

        Raises ``AuthenticationError`` (401) when keys are configured and the
        header is missing or wrong.  With no keys configured, everyone is P0.
        """
        if not self.enabled:
            return ANONYMOUS
        if not authorization:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationError("malformed Authorization header: expected 'Bearer <key>'")
        digest = self._digest(token.strip())
        for known, info in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                return info
        raise AuthenticationError("invalid API key")

    @classmethod
    def build(cls, api_keys: Iterable[str] = (), keys_file: str | Path | None = None) -> KeyStore:
        store = cls()
        for key in api_keys:
            store.add(key)
        if keys_file:
            for key, info in load_keys_file(keys_file).items():
                store.add(key, info)
        return store


def load_keys_file(path: str | Path) -> dict[str, KeyInfo]:
    """Parse a keys file; raises ``InvalidRequestError`` naming the file and the problem."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise InvalidRequestError(f"cannot read keys file {p}: {e.strerror or e}") from e
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise InvalidRequestError(f"keys file {p} is not valid YAML/JSON: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("keys", {}), dict):
        raise InvalidRequestError(f"keys file {p}: expected a mapping with a 'keys' mapping")
    out: dict[str, KeyInfo] = {}
    for key, spec in (data.get("keys") or {}).items():
        spec = spec or {}
        if not isinstance(spec, dict):
            raise InvalidRequestError(f"keys file {p}: entry {fingerprint(str(key))} must be a mapping")
        try:
            out[str(key)] = KeyInfo(
                name=str(spec.get("name") or fingerprint(str(key))),
                tier=parse_priority(spec.get("tier"), default=Priority.P0),
                rpm=_opt_rate(spec.get("rpm")),
                tpm=_opt_rate(spec.get("tpm")),
                is_admin=bool(spec.get("admin", False)),
            )
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(f"keys file {p}: entry {fingerprint(str(key))}: {e}") from e
    admin = data.get("admin_keys") or []
    if not isinstance(admin, list):
        raise InvalidRequestError(f"keys file {p}: 'admin_keys' must be a list")
    for key in admin:
        prev = out.get(str(key))
        out[str(key)] = KeyInfo(
            name=prev.name if prev else fingerprint(str(key)),
            tier=prev.tier if prev else Priority.P0,
            rpm=prev.rpm if prev else None,
            tpm=prev.tpm if prev else None,
            is_admin=True,
        )
    return out


def _opt_rate(v: object) -> float | None:
    if v is None:
        return None
    f = float(v)  # type: ignore[arg-type]
    if f <= 0:
        raise ValueError(f"rate must be > 0, got {v}")
    return f


class RateLimiter:
    """Per-key token buckets for requests/min and tokens/min.

    ``check(info, tokens)`` either consumes one request and ``tokens`` tokens,
    or raises ``RateLimitError`` with ``retry_after`` (seconds) and consumes
    nothing.  Thread-safe; the clock is injected for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        # key name -> [request tokens, token tokens, last refill time]
        self._buckets: dict[str, list[float]] = {}

    def check(self, info: KeyInfo, tokens: int = 0) -> None:
        if info.rpm is None and info.tpm is None:
            return
        now = self._clock()
        with self._lock:
            b = self._buckets.get(info.name)
            if b is None:
                b = [info.rpm or 0.0, info.tpm or 0.0, now]
                self._buckets[info.name] = b
            dt = max(0.0, now - b[2])
            b[2] = now
            if info.rpm is not None:
                b[0] = min(info.rpm, b[0] + dt * info.rpm / 60.0)
            if info.tpm is not None:
                b[1] = min(info.tpm, b[1] + dt * info.tpm / 60.0)
            wait = 0.0
            if info.rpm is not None and b[0] < 1.0:
                wait = max(wait, (1.0 - b[0]) * 60.0 / info.rpm)
            if info.tpm is not None:
                if tokens > info.tpm:
                    raise RateLimitError(
                        f"request needs {tokens} tokens but the key allows {int(info.tpm)} per minute",
                        retry_after=60.0,
                    )
                if b[1] < tokens:
                    wait = max(wait, (tokens - b[1]) * 60.0 / info.tpm)
            if wait > 0:
                raise RateLimitError(
                    "rate limit exceeded for this API key", retry_after=round(max(wait, 0.001), 3)
                )
            if info.rpm is not None:
                b[0] -= 1.0
            if info.tpm is not None:
                b[1] -= tokens
