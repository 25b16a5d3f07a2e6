"""The host-memory tier of the KV cache (`backend.num_host_kv_pages`): whole pages swapped
out of the device pool and back (`swap_kvpage`).

Why: a paused instance (waiting on a tool call, a message, a timer) holds device pages that
running instances need. APIServe (seed notes) chooses per paused request between keeping
its KV, discarding and recomputing it, and swapping it to host memory; swapping gave 1.6x
the request rate of discarding. This is the backend half: storage and copies. Which pages
go, and when, is the control layer's (issue 17).

A host page holds what a device page holds: keys and values of every layer, in the device
pool's layout, and the page's mask bits. On CUDA the host tensors are pinned, so copies
can overlap; on the CPU both tiers are RAM, and a swap is a copy that frees a page of the
pool the control layer manages.
"""

from __future__ import annotations

import time

import torch

from pie.backend.kv_cache import KvCache


class HostPages:
    def __init__(self, kv: KvCache, num_pages: int, gbps: float = 0.0):
        pin = kv.keys[0].device.type == "cuda"
        # empty, not zeros: a page is written before it is read, and on the CPU untouched
        # memory is not committed, so an unused tier costs no RAM.
        self.keys = [torch.empty(num_pages, *p.shape[1:], dtype=p.dtype, pin_memory=pin) for p in kv.keys]
        self.values = [torch.empty(num_pages, *p.shape[1:], dtype=p.dtype, pin_memory=pin) for p in kv.values]
        self.masked = torch.zeros(num_pages, kv.page_size, dtype=torch.bool)
        self.kv, self.num_pages = kv, num_pages
        self.page_bytes = sum(p[0].numel() * p.element_size() for p in kv.keys + kv.values)
        self.gbps = gbps  # backend.swap_gbps: 0 = unlimited
        self.link_free_at = 0.0  # time.monotonic() when the emulated link is next idle

    def through_link_at(self, pages: int) -> float:
        """When `pages` pages sent now are through an emulated link of `gbps` GB/s, one
        transfer at a time (`backend.swap_gbps`). The copy itself is done at once; the
        backend holds the swap's reply until then and computes meanwhile, as a GPU's copy
        engine overlaps its kernels, so the pages are the control layer's only then."""
        start = max(time.monotonic(), self.link_free_at)
        self.link_free_at = start + pages * self.page_bytes / (self.gbps * 1e9)
        return self.link_free_at

    def store(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy device pages to host pages (K, V and mask bits; the device pages keep theirs)."""
        kv, dst = self.kv, torch.tensor(host_pages)
        src = torch.tensor(device_pages, device=kv.keys[0].device)
        for host, pool in zip(self.keys + self.values, kv.keys + kv.values):
            host[dst] = pool[src].to("cpu")
        self.masked[dst] = kv.masked.view(-1, kv.page_size)[src].to("cpu")

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy host pages back into device pages."""
        kv, src = self.kv, torch.tensor(host_pages)
        device = kv.keys[0].device
        dst = torch.tensor(device_pages, device=device)
        for host, pool in zip(self.keys + self.values, kv.keys + kv.values):
            pool[dst] = host[src].to(device, non_blocking=True)
        kv.masked.view(-1, kv.page_size)[dst] = self.masked[src].to(device)
