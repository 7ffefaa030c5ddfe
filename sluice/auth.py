"""API keys, tiers and rate limits, shared by the server and the gateway (torch-free).

Keys file (YAML or JSON)::

    keys:
      sk-team-a: {tier: p0, rpm: 600, tpm: 200000}   # may send p0; 600 req/min, 200k tok/min
      sk-batch:  {tier: p2}                          # capped at p2, no rate limit
    admin_keys: [sk-admin]                           # /admin/... and LoRA load/unload endpoints

``--api-key KEY`` (repeatable) adds keys with tier p0 and no limit.
``--admin-key KEY`` (repeatable, ``SLUICE_ADMIN_KEY``) adds a key that opens the
admin endpoints only: unlike a keys file's ``admin_keys``, it does not switch on
keys for the inference routes.  Keys are compared in constant time and never
logged: ``KeyInfo.name`` is a short, non-reversible fingerprint for logs.

``AdminAccess`` decides who may call the admin endpoints (NOTE(admin-access)).

Rate limits are token buckets (capacity = one minute's allowance, refilled
continuously), pure functions of an injected clock.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from sluice.errors import (
    AuthenticationError,
    InvalidRequestError,
    PermissionDeniedError,
    RateLimitError,
)
from sluice.types import Priority, parse_priority

__all__ = [
    "KeyInfo",
    "KeyStore",
    "load_keys_file",
    "fingerprint",
    "RateLimiter",
    "AdminAccess",
    "AdminMode",
    "is_loopback_host",
]


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
    """Maps presented bearer tokens to ``KeyInfo``.  No inference keys: auth disabled
    for the inference routes (admin-only keys do not count)."""

    _by_digest: dict[bytes, KeyInfo] = field(default_factory=dict)
    _admin_only: dict[bytes, KeyInfo] = field(default_factory=dict)  # --admin-key: admin routes only

    @staticmethod
    def _digest(key: str) -> bytes:
        return hashlib.sha256(key.encode()).digest()

    def add(self, key: str, info: KeyInfo | None = None) -> None:
        if not key:
            raise InvalidRequestError("an API key must not be empty")
        self._by_digest[self._digest(key)] = info or KeyInfo(name=fingerprint(key))

    def add_admin_key(self, key: str) -> None:
        """A key for the admin endpoints alone (``--admin-key``)."""
        if not key:
            raise InvalidRequestError("an admin key must not be empty")
        self._admin_only[self._digest(key)] = KeyInfo(name=fingerprint(key), is_admin=True)

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    @property
    def has_admin(self) -> bool:
        return bool(self._admin_only) or any(k.is_admin for k in self._by_digest.values())

    def _bearer_digest(self, authorization: str | None, missing: str) -> bytes:
        """The digest of an ``Authorization: Bearer <key>`` header's key; 401 (``missing``) without one."""
        if not authorization:
            raise AuthenticationError(missing)
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationError("malformed Authorization header: expected 'Bearer <key>'")
        return self._digest(token.strip())

    @staticmethod
    def _lookup(digest: bytes, *tables: dict[bytes, KeyInfo]) -> KeyInfo:
        """The first key with ``digest``, compared in constant time with every known key; 401 for none."""
        found: KeyInfo | None = None
        for table in tables:
            for known, info in table.items():
                if hmac.compare_digest(known, digest):
                    found = found or info
        if found is None:
            raise AuthenticationError("invalid API key")
        return found

    def authenticate_admin(self, authorization: str | None) -> KeyInfo:
        """An admin key: 401 when missing or unknown, 403 for a known key that is not an admin's."""
        digest = self._bearer_digest(authorization, "missing admin key: send 'Authorization: Bearer <admin key>'")
        found = self._lookup(digest, self._admin_only, self._by_digest)
        if not found.is_admin:
            raise PermissionDeniedError("this endpoint needs an admin key", code="admin_key_required")
        return found

    def authenticate(self, authorization: str | None) -> KeyInfo:
        """Check an ``Authorization: Bearer <key>`` header value.

        Raises ``AuthenticationError`` (401) when keys are configured and the
        header is missing or wrong.  With no keys configured, everyone is P0.
        """
        if not self.enabled:
            return ANONYMOUS
        digest = self._bearer_digest(authorization, "missing API key: send 'Authorization: Bearer <key>'")
        return self._lookup(digest, self._by_digest)

    @classmethod
    def build(cls, api_keys: Iterable[str] = (), keys_file: str | Path | None = None,
              admin_keys: Iterable[str] = ()) -> KeyStore:  # fmt: skip
        store = cls()
        for key in api_keys:
            store.add(key)
        if keys_file:
            for key, info in load_keys_file(keys_file).items():
                store.add(key, info)
        for key in admin_keys:
            store.add_admin_key(key)
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


# -- admin endpoints ------------------------------------------------------------------

# Headers a proxy adds: a request that carries one came through a proxy, so its
# peer address says nothing about where the caller is.
_FORWARDING_HEADERS = ("forwarded", "x-forwarded-for", "x-real-ip")


def is_loopback_host(host: str | None) -> bool:
    """Whether an address (a bind address or a client's) is this machine's loopback.

    ``localhost``, ``127.0.0.0/8``, ``::1`` and IPv4-mapped ``::ffff:127.x``; every
    other name (``0.0.0.0``, ``::``, a hostname, none at all) is not.
    """
    if not host:
        return False
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


class AdminMode(str, enum.Enum):
    KEY = "key"  # an admin key is configured: only it opens them
    OPEN = "open"  # --allow-admin-without-key: like the inference routes (the operator's proxy guards them)
    LOOPBACK = "loopback"  # no keys, bound to loopback: clients on this machine only
    CLOSED = "closed"  # otherwise: 403


class AdminAccess:
    """Who may call the admin endpoints (``/admin/*``, LoRA load and unload) of a server or gateway.

    NOTE(admin-access): they run the operator's tools (py-spy on the serving
    processes, the whole prefix cache to disk, adapters read from the server's
    disk), so they are closed unless an operator opens them:

    - an admin key configured (``--admin-key``, ``admin_keys`` or ``admin: true`` in
      the keys file): that key, and nothing else (401 without it, 403 for another key);
    - ``--allow-admin-without-key``: whoever may use the inference routes, for
      operators whose own proxy guards ``/admin/*``;
    - no keys at all and bound to loopback alone: clients on loopback, so the
      examples and a laptop work with no setup;
    - anything else (bound beyond loopback, or API keys but no admin key): 403
      saying how to open them.

    A request that carries a proxy's forwarding header (``Forwarded``,
    ``X-Forwarded-For``, ``X-Real-IP``) is not taken as local even from
    127.0.0.1: a reverse proxy on this machine would make every client look local.
    """

    def __init__(self, keys: KeyStore, *, host: str, allow_without_key: bool = False, name: str = "sluice serve"):
        self.keys = keys
        self.host = host
        self.name = name  # the process, for messages
        if keys.has_admin:
            self.mode = AdminMode.KEY
        elif allow_without_key:
            self.mode = AdminMode.OPEN
        elif not keys.enabled and is_loopback_host(host):
            self.mode = AdminMode.LOOPBACK
        else:
            self.mode = AdminMode.CLOSED

    def check(self, headers: Mapping[str, str], client_host: str | None) -> KeyInfo:
        """The caller's key (``ANONYMOUS`` without keys); raises 401 / 403 ``SluiceError``s."""
        if self.mode is AdminMode.KEY:
            return self.keys.authenticate_admin(headers.get("authorization"))
        if self.mode is AdminMode.OPEN:
            return self.keys.authenticate(headers.get("authorization"))
        if self.mode is AdminMode.LOOPBACK:
            if is_loopback_host(client_host) and not any(h in headers for h in _FORWARDING_HEADERS):
                return ANONYMOUS
            raise PermissionDeniedError(
                f"admin endpoints answer only to clients on this machine while {self.name} has no admin key; "
                f"{self._how}", code="admin_key_required")  # fmt: skip
        why = "it has API keys but no admin key" if self.keys.enabled else \
            f"it listens on {self.host}, beyond loopback, with no admin key"  # fmt: skip
        raise PermissionDeniedError(f"admin endpoints are closed on this {self.name}: {why}; {self._how}",
                                    code="admin_key_required")  # fmt: skip

    @property
    def _how(self) -> str:
        return ("to open them, configure an admin key (--admin-key or SLUICE_ADMIN_KEY, or admin_keys in "
                "--keys-file) and send it as 'Authorization: Bearer <key>', or start with "
                "--allow-admin-without-key if a proxy of yours guards /admin/*")  # fmt: skip

    def describe(self) -> str:
        """One line for the start-up log."""
        return {
            AdminMode.KEY: "admin endpoints (/admin/*, LoRA load/unload) need an admin key",
            AdminMode.OPEN: "admin endpoints (/admin/*, LoRA load/unload) are open to every client that may "
                            "use the API (--allow-admin-without-key): guard them in your proxy",
            AdminMode.LOOPBACK: f"admin endpoints (/admin/*, LoRA load/unload) answer to loopback clients only "
                                f"(bound to {self.host}, no keys); configure an admin key to use them from "
                                "elsewhere",
            AdminMode.CLOSED: f"admin endpoints (/admin/*, LoRA load/unload) are closed: bound to {self.host} "
                              "with no admin key (--admin-key, or --allow-admin-without-key behind your proxy)"
                              if not self.keys.enabled else
                              "admin endpoints (/admin/*, LoRA load/unload) are closed: API keys but no admin "
                              "key (--admin-key, or admin_keys in --keys-file)",
        }[self.mode]  # fmt: skip
