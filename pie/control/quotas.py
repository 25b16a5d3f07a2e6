"""Quotas: what one instance, and one user (auth token) across all its instances, may hold
at once — KV pages, embeds, queues, exports, live instances — and how fast it may send
messages and HTTP requests (config `quota.instance.*`, `quota.user.*`; 0 = no quota).

A count over quota fails the call at once with `out-of-resources` naming the key; a rate
over quota makes the caller wait (throttling loses nothing).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from pie.config import InstanceQuota, QuotaConfig
from pie.control.errors import ErrorKind, HostError

# What the count quotas count, with the words error messages use for them.
HELD = {"kv_pages": "kv pages", "embeds": "embeds", "queues": "queues", "exports": "exports",
        "subscriptions": "subscriptions", "instances": "live instances",
        "latency_queues": "latency queues"}
RATES = ("messages_per_s", "http_requests_per_s")
ANONYMOUS = "anonymous"  # the user of every client when the server has no auth tokens
PUBLIC = "public:"  # names with this prefix are shared by every user (read-only for others)


def fingerprint(token: str) -> str:
    """The user a token stands for, as quotas, listings, logs and /stats name it: never the
    token itself, and the key of its per-user overrides (quota.users.<fingerprint>)."""
    return "token-" + hashlib.sha256(token.encode()).hexdigest()[:8]


def namespace(user: str, name: str) -> tuple[str, str]:
    """Where `user`'s export, key or topic `name` lives: in the user's own namespace, or in
    the one every user shares for names that begin with `public:` (docs/security.md)."""
    return ("", name) if name.startswith(PUBLIC) else (user, name)


class RateLimit:
    """A token bucket holding one second's worth of calls (at least one), kept as the
    theoretical arrival time of the next call (GCRA): `reserve` books a slot, returns the wait."""

    def __init__(self, per_s: float):
        self.interval = 1 / per_s if per_s else 0.0
        self.tolerance = max(0.0, per_s - 1) * self.interval
        self.next_at = 0.0

    def reserve(self, now: float) -> float:
        if not self.interval:
            return 0.0
        due = max(self.next_at, now)
        self.next_at = due + self.interval
        return max(0.0, due - self.tolerance - now)


@dataclass
class Account:
    """One quota holder: an instance, or a user summed over its instances."""

    who: str  # "the instance", "user token-1a2b3c4d"
    key: str  # config table of its limits: "quota.instance" or "quota.user"
    quota: InstanceQuota
    held: Counter[str] = field(default_factory=Counter)
    rates: dict[str, RateLimit] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rates = {rate: RateLimit(getattr(self.quota, rate)) for rate in RATES}

    def check(self, what: str, count: int) -> None:
        limit = getattr(self.quota, what, 0)
        if limit and self.held[what] + count > limit:
            raise HostError(ErrorKind.OUT_OF_RESOURCES,
                            f"{self.who} holds {self.held[what]} {HELD[what]} and asks for {count} "
                            f"more: over its quota {self.key}.{what} = {limit}")


class Charges:
    """One instance's two accounts, charged and refunded together."""

    def __init__(self, book: QuotaBook, instance: Account, user: Account):
        self.book, self.instance, self.user = book, instance, user

    def charge(self, what: str, count: int = 1, user_count: int | None = None) -> None:
        """Charge `count` to the instance and `user_count` (default the same) to its user:
        they differ for KV pages, which a user is charged once however many of its
        instances and exports hold them (see ResourceManager)."""
        user_count = count if user_count is None else user_count
        with self.book.lock:
            self.instance.check(what, count)
            self.user.check(what, user_count)
            self.instance.held[what] += count
            self.user.held[what] += user_count

    def refund(self, what: str, count: int = 1, user_count: int | None = None) -> None:
        with self.book.lock:
            self.instance.held[what] -= count
            self.user.held[what] -= count if user_count is None else user_count

    def wait_s(self, rate: str) -> float:
        """Reserve the next call of `rate` in both accounts; how long the caller must wait."""
        now = time.monotonic()
        with self.book.lock:
            return max(self.instance.rates[rate].reserve(now), self.user.rates[rate].reserve(now))

    def close(self) -> None:
        """The instance ended: the user gets back what it still held. Exports are refunded by
        whoever removes them (a persistent one outlives the instance and stays charged)."""
        with self.book.lock:
            for what, count in self.instance.held.items():
                if what not in ("exports", "kv_pages"):  # both are settled by ResourceManager
                    self.user.held[what] -= count
                    self.instance.held[what] = 0


class QuotaBook:
    """Every user's account (users are the configured tokens, plus "anonymous")."""

    def __init__(self, config: QuotaConfig):
        self.config = config
        self.lock = threading.Lock()
        self.users: dict[str, Account] = {}

    def open(self, user: str) -> Charges:
        """Accounts for a new instance of `user`, with the user's quota overrides
        (quota.users.<fingerprint>) if any."""
        instance_quota, user_quota = self.config.for_user(user)
        overridden = user in self.config.resolved
        with self.lock:
            account = self.users.get(user)
            if account is None:
                key = f"quota.users.{user}.user" if overridden else "quota.user"
                account = self.users[user] = Account(f"user {user}", key, user_quota)
        key = f"quota.users.{user}.instance" if overridden else "quota.instance"
        return Charges(self, Account("the instance", key, instance_quota), account)

    def usage(self, user: str | None = None) -> dict[str, dict[str, int]]:
        """What each user holds now (for /stats); only `user`'s entry when one is given."""
        with self.lock:
            return {name: {what: account.held[what] for what in HELD}
                    for name, account in self.users.items() if user is None or name == user}
