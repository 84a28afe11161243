"""Prefix-cache hits per replica behind a router, read from each replica's `/metrics`.

A run through a router (docs/router.md) sends each request to one replica; how well the
router's policy keeps a conversation on the replica holding its prefix shows in the replicas'
own counters (`vllm:prefix_cache_queries` / `vllm:prefix_cache_hits`, in prompt tokens).
Snapshot them before the run, and the difference after it is the run's share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from server.bench.counters import counter_totals

QUERIES = "vllm:prefix_cache_queries"
HITS = "vllm:prefix_cache_hits"


@dataclass(frozen=True)
class PrefixCounts:
    """Prompt tokens looked up in one replica's prefix cache, and those found there."""

    queried: float = 0.0
    hits: float = 0.0

    def __sub__(self, other: PrefixCounts) -> PrefixCounts:
        return PrefixCounts(self.queried - other.queried, self.hits - other.hits)

    @property
    def rate(self) -> float:
        return self.hits / self.queried if self.queried else 0.0


def prefix_counts(base_url: str, timeout_s: float = 10.0) -> PrefixCounts:
    """The replica's counters now (summed over its engines)."""
    response = httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=timeout_s)
    response.raise_for_status()
    totals = counter_totals(response.text, (QUERIES, HITS))
    return PrefixCounts(totals.get(QUERIES, 0.0), totals.get(HITS, 0.0))


def snapshot(replica_urls: Sequence[str]) -> list[PrefixCounts]:
    return [prefix_counts(url) for url in replica_urls]


def since(replica_urls: Sequence[str], before: Sequence[PrefixCounts]) -> list[PrefixCounts]:
    """Each replica's counts since `before` (a `snapshot` of the same replicas)."""
    return [now - then for now, then in zip(snapshot(replica_urls), before, strict=True)]


def overall(counts: Sequence[PrefixCounts]) -> PrefixCounts:
    return PrefixCounts(sum(c.queried for c in counts), sum(c.hits for c in counts))


def format_replica_hits(replica_urls: Sequence[str], counts: Sequence[PrefixCounts]) -> str:
    """One line per replica and a total: prompt tokens queried, hit, and the hit rate."""
    rows = [(url, c) for url, c in zip(replica_urls, counts, strict=True)]
    rows.append(("all replicas", overall(counts)))
    width = max(len(name) for name, _ in rows)
    lines = [f"{'prefix cache':<{width}}  {'queried':>9}  {'hits':>9}  {'rate':>6}"]
    lines += [f"{name:<{width}}  {c.queried:>9.0f}  {c.hits:>9.0f}  {c.rate:>6.1%}"
              for name, c in rows]  # fmt: skip
    return "\n".join(lines)
