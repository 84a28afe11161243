"""The vision encoder's share of a run, from the server's `/metrics`.

metal-serve counts the images its vision encoder ran for and the wall time it took
(`metal_serve_images_encoded_total`, `metal_serve_encoder_seconds_total`); read before and
after a run, the difference is the run's: its encoder time per image. A server that publishes
neither (another server, a model without vision) gives None.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from server.bench.counters import counter_totals

IMAGES = "metal_serve_images_encoded"
SECONDS = "metal_serve_encoder_seconds"


@dataclass(frozen=True)
class EncoderCounts:
    """Images the encoder ran for, and its seconds for them."""

    images: float = 0.0
    seconds: float = 0.0

    def __sub__(self, other: EncoderCounts) -> EncoderCounts:
        return EncoderCounts(self.images - other.images, self.seconds - other.seconds)

    @property
    def ms_per_image(self) -> float | None:
        return self.seconds * 1000.0 / self.images if self.images else None

    def to_json(self) -> dict:
        return {"images": self.images, "seconds": self.seconds,
                "ms_per_image": self.ms_per_image}  # fmt: skip


async def encoder_counts(client: httpx.AsyncClient) -> EncoderCounts | None:
    """The server's counters now (`client` has its base URL); None where it has none."""
    try:
        response = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    totals = counter_totals(response.text, (IMAGES, SECONDS))
    if IMAGES not in totals or SECONDS not in totals:
        return None
    return EncoderCounts(totals[IMAGES], totals[SECONDS])
