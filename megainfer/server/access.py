"""Who may use the server, and how much: API keys checked in constant time, the principal a
key stands for, and each key's request rate and concurrency limits.

One `AccessPolicy` serves both frontends (the gRPC interceptor in grpc_access.py, the HTTP
middleware in http_access.py), so a key's limits count its requests over both. The policy
keeps only the keys' SHA-256 digests; a presented key is hashed and compared with
`hmac.compare_digest` against every configured digest, with no early exit, so neither the
time to answer nor the order of the keys tells a guesser how close it came.

Limits count generation requests (gRPC Generate, HTTP POST /v1/completions and
/v1/chat/completions); reading models, metrics or server info is only authenticated.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from megainfer.errors import ConfigError, Overloaded
from megainfer.server.api_key_file import KeyEntry, KeyLimits, check_key, configured_keys, default_limits

FINGERPRINT_HEX = 8  # a key without a name is called "key-" + this many hex digits of its SHA-256
MISSING_KEY = ("no API key: send the header `Authorization: Bearer <key>` (gRPC: metadata `authorization`); "
               "`megainfer generate --api-key` or MEGAINFER_API_KEY, the OpenAI SDK's api_key")
WRONG_KEY = ("the API key is not valid: send one of the keys the server was started with, as "
             "`Authorization: Bearer <key>`")


def bearer_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` value (scheme in any case), else None."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None


def fingerprint(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:FINGERPRINT_HEX]


class KeyLimitExceeded(Overloaded):
    """A key asked for more than its limits allow; `retry_after_s` is when it may try again
    (None: when one of its requests ends)."""

    def __init__(self, message: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TokenBucket:
    """`rate` tokens per second, at most `capacity` saved up; thread-safe under the caller's lock."""

    def __init__(self, rate: float, capacity: float, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.capacity = capacity
        self.clock = clock
        self.tokens = capacity
        self.updated = clock()

    def take(self) -> float:
        """Takes a token and returns 0, or returns the seconds until one will be there."""
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


@dataclass
class _KeyState:
    principal: str
    digest: bytes  # SHA-256 of the key
    limits: KeyLimits
    bucket: TokenBucket | None  # None: no rate limit
    live: int = 0  # generation requests admitted and not yet ended


class Admission:
    """One admitted request's hold on its key's concurrency; `release()` once it ends, however
    it ends (calling it again does nothing)."""

    def __init__(self, lock: threading.Lock, state: _KeyState) -> None:
        self._lock = lock
        self._state: _KeyState | None = state

    def release(self) -> None:
        with self._lock:
            if self._state is not None:
                self._state.live -= 1
                self._state = None

    def __enter__(self) -> "Admission":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class AccessPolicy:
    def __init__(self, entries: Sequence[KeyEntry], clock: Callable[[], float] = time.monotonic) -> None:
        """entries: at least one; their names (or fingerprints) must be distinct."""
        if not entries:
            raise ConfigError("an access policy needs at least one key; without keys, pass access=None")
        self._lock = threading.Lock()
        self._keys: list[_KeyState] = []
        for entry in entries:
            limits = entry.limits
            # A bucket holds one second's worth of requests (at least one): bursts up to the rate.
            bucket = None if limits.rate_limit is None else \
                TokenBucket(limits.rate_limit, max(1.0, math.floor(limits.rate_limit)), clock)
            self._keys.append(_KeyState(entry.name or fingerprint(entry.key),
                                        hashlib.sha256(entry.key.encode()).digest(), limits, bucket))
        principals = [k.principal for k in self._keys]
        if len(set(principals)) != len(principals):
            raise ConfigError(f"two keys are called the same ({', '.join(sorted(principals))}); give each its own "
                              "name")
        self._by_principal = {k.principal: k for k in self._keys}

    @classmethod
    def from_keys(cls, keys: Iterable[str], rate_limit: float | None = None,
                  max_concurrency: int | None = None) -> "AccessPolicy":
        """Keys given in code (tests, benchmarks), each with the same limits, named by fingerprint."""
        limits = default_limits(rate_limit, max_concurrency)
        return cls([KeyEntry(check_key(key, f"key #{i + 1}"), None, limits, f"key #{i + 1}")
                    for i, key in enumerate(keys)])

    @classmethod
    def from_options(cls, api_keys: Sequence[str] | None, api_key_file: str | os.PathLike | None,
                     rate_limit: float | None = None, max_concurrency: int | None = None,
                     environ: Mapping[str, str] | None = None) -> "AccessPolicy | None":
        """From the CLI's flags (see api_key_file.py); None when no key is configured anywhere."""
        limits = default_limits(rate_limit, max_concurrency)
        entries = configured_keys(api_keys, api_key_file, limits, environ)
        if not entries:
            if rate_limit is not None or max_concurrency is not None:
                raise ConfigError("--api-key-rate-limit and --api-key-max-concurrency limit keys, and no key is "
                                  "configured; add --api-key, MEGAINFER_API_KEY or --api-key-file")
            return None
        return cls(entries)

    @property
    def principals(self) -> list[str]:
        return [k.principal for k in self._keys]

    def authenticate(self, key: str | None) -> str | None:
        """The principal of `key`, or None if it is not a configured key. Constant time in the key:
        every configured digest is compared, whichever matches."""
        if not key:
            return None
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for state in self._keys:
            if hmac.compare_digest(digest, state.digest):
                found = state.principal
        return found

    def admit(self, principal: str) -> Admission:
        """Admits one generation request of `principal` (an authenticated one), or raises
        KeyLimitExceeded. The concurrency check comes first, so a refused request spends no rate."""
        state = self._by_principal[principal]
        with self._lock:
            limit = state.limits.max_concurrency
            if limit is not None and state.live >= limit:
                raise KeyLimitExceeded(f"key {principal!r} has {state.live} requests in flight, its limit "
                                       "(max_concurrency); send the next when one ends", None)
            wait = state.bucket.take() if state.bucket is not None else 0.0
            if wait > 0:
                raise KeyLimitExceeded(f"key {principal!r} is over its rate limit of {state.limits.rate_limit:g} "
                                       f"requests/s; retry in {wait:.2f} s", wait)
            state.live += 1
        return Admission(self._lock, state)

    def live(self, principal: str) -> int:
        """Generation requests of `principal` admitted and not yet ended."""
        with self._lock:
            return self._by_principal[principal].live
