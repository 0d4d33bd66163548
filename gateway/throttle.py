"""AuthThrottle: wrong API keys slowed down per client address and per key, for the bearer API and the dashboard's
login alike; and the minimum strength of the configured keys, checked at start.

400 wrong keys in 1.3 s at the login and 400 in 0.8 s at the API went unanswered (issue #34): nothing made
guessing slow. Each client address (an IPv6 address by its /64: one host holds the whole prefix) and each key
tried gets a bucket of `burst` failures that refills over `window_s`; once empty, that address or key is
answered 429 with Retry-After before its key is even compared, so a right guess from a throttled address
learns nothing either. Only failures take from a bucket: a client with a right key never meets the throttle.
The buckets are per gateway process, in memory (no Redis round trip on any request), and at most
MAX_TRACKED of them are kept: the oldest go first.
"""

from __future__ import annotations

import ipaddress
import math
import threading
import time
from collections import OrderedDict

from gateway.settings import owner_id

MAX_TRACKED = 100_000
MIN_KEY_CHARS = 20
MIN_KEY_DISTINCT = 6


def client_of(address: str | None) -> str:
    """The throttle's name for a client address: IPv4 as it is, IPv6 by its /64."""
    if not address:
        return "addr:unknown"
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return f"addr:{address[:64]}"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return f"addr:{ip.ipv4_mapped}"
        return f"addr:{ipaddress.ip_network(f'{ip}/64', strict=False)}"
    return f"addr:{ip}"


def key_of(owner: str) -> str:
    """The throttle's name for a key tried, by its owner id (a hash, settings.owner_id): never the key."""
    return f"key:{owner}"


class AuthThrottle:
    def __init__(self, burst: int, window_s: float) -> None:
        self.burst = float(burst)
        self.rate = burst / window_s  # failures forgiven per second
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # name -> (failures left, at)
        self._lock = threading.Lock()

    def _left(self, name: str, now: float) -> float:
        left, at = self._buckets.get(name, (self.burst, now))
        return min(self.burst, left + (now - at) * self.rate)

    def retry_after(self, *names: str) -> int:
        """0 when each of `names` may fail once more; else the whole seconds until all of them may."""
        now = time.monotonic()
        with self._lock:
            short = max((1.0 - self._left(n, now) for n in names), default=0.0)
        return 0 if short <= 0 else max(1, math.ceil(short / self.rate))

    def failed(self, *names: str) -> None:
        """One failure more for each of `names`."""
        now = time.monotonic()
        with self._lock:
            for name in names:
                self._buckets[name] = (self._left(name, now) - 1.0, now)
                self._buckets.move_to_end(name)
            while len(self._buckets) > MAX_TRACKED:
                self._buckets.popitem(last=False)


def check_key_strength(keys: list[str]) -> None:
    """ValueError naming each configured key (by its place and owner id, never its text) too weak to serve."""
    weak = [f"key {i} ({owner_id(k)}): {len(k)} characters, {len(set(k))} different"
            for i, k in enumerate(keys, 1) if len(k) < MIN_KEY_CHARS or len(set(k)) < MIN_KEY_DISTINCT]
    if weak:
        raise ValueError(f"TOKENBUS_GATEWAY_API_KEYS has {len(weak)} key(s) too easy to guess ({'; '.join(weak)}): "
                         f"each key needs at least {MIN_KEY_CHARS} characters with at least {MIN_KEY_DISTINCT} "
                         "different ones; make keys with e.g. `echo sk-$(openssl rand -hex 24)`")
