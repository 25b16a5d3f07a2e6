"""One backend process's share of the control layer (`backend.replicas`).

A replica is a backend process plus what the control layer keeps for it alone: its KV and
embed pools with their prefix cache and exports (`ResourceManager`), its batch scheduler
(one thread, one ZeroMQ socket, one batch in flight) and its reclaimer. Everything else —
users' quotas, the tokenizer and grammars, messaging, the key-value store, HTTP — is the
controller's and shared by all replicas. An instance lives on one replica
(`InstanceSession.replica`); handles are only ever resolved against that replica's pools,
so no id of one replica's pool can name another's page.
"""

from __future__ import annotations

from typing import Any

from pie import protocol as P
from pie.config import PieConfig
from pie.control.reclaimer import Reclaimer
from pie.control.resources import ResourceManager
from pie.control.scheduler import Scheduler


class Replica:
    def __init__(self, index: int, config: PieConfig, endpoint: str, handshake: P.HandshakeReply,
                 secret: bytes | None = None):
        control = config.control
        self.index = index
        self.endpoint = endpoint
        self.resources = ResourceManager(
            handshake.num_kv_pages, handshake.num_embeds, control.alloc_wait_ms / 1000,
            prefix_cache_page_size=handshake.page_size if control.prefix_cache else 0,
            num_host_pages=handshake.num_host_kv_pages)
        self.scheduler = Scheduler(endpoint, control, handshake.max_batch_tokens,
                                   self.resources.prefix_cache, secret,
                                   prompt_hold=control.holds_prompts(handshake.device))
        self.reclaimer = Reclaimer(self.resources, self.scheduler, control.kv_pressure, handshake.page_size)
        self.live = 0  # instances placed here and not yet closed (placement's load)
        self.launched = 0  # instances ever placed here
        self.failure: str | None = None  # why its backend is down, while it is restarted

    @property
    def serving(self) -> bool:
        return self.failure is None

    def fail(self, reason: str) -> None:
        """Its backend died: every call waiting or in flight on it fails with `reason`, its
        exports (pages of the dead backend) go; new launches are placed elsewhere."""
        self.failure = reason
        self.scheduler.fail_all(reason)
        self.resources.drop_exports()

    def recover(self) -> None:
        """A new backend serves the endpoint; the pools were emptied as its instances ended."""
        self.scheduler.recover()
        self.failure = None

    def pools(self, user: str | None) -> dict[str, Any]:
        """Pool occupancy: cached pages nobody holds count as free (an allocation takes them)."""
        resources, cache = self.resources, self.resources.prefix_cache
        with resources.lock:
            pools = {"kv_pages_free": resources.pages.available + (cache.evictable() if cache else 0),
                     "kv_pages_total": resources.pages.size,
                     "embeds_free": resources.embeds.available,
                     "embeds_total": resources.embeds.size}
        pools["exports"] = resources.exports_of(user)
        pools["prefix_cache"] = cache.stats() if cache is not None else None
        pools["reclaim"] = self.reclaimer.stats()
        return pools

    def stats(self, user: str | None) -> dict[str, Any]:
        return {"replica": self.index, "status": "ok" if self.serving else "failed",
                **({"reason": self.failure} if self.failure else {}),
                **({"endpoint": self.endpoint} if user is None else {}),  # admins only
                "instances": self.live, "launched": self.launched,
                "scheduler": self.scheduler.snapshot_stats(), "resources": self.pools(user)}
