"""Counter totals out of a server's Prometheus `/metrics` text, for the benches that read a
server's own counts before and after a run."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families


def counter_totals(metrics_text: str, names: Iterable[str]) -> dict[str, float]:
    """Each named counter's total (summed over its labels), for the names the text has."""
    wanted = set(names)
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name in wanted:
            totals[family.name] = totals.get(family.name, 0.0) + sum(
                s.value for s in family.samples if s.name.endswith("_total"))
    return totals
