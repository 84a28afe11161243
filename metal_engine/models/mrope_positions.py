"""Multimodal rope (M-RoPE) positions of a prompt with images, as transformers'
`get_rope_index` gives them for Qwen3-VL and Qwen3.5 (images only; no video).

Text tokens count up on all three axes (time, height, width). An image of `t x h x w`
merged tokens takes `start + (its t, h, w index)` on the three axes, and the text after it
goes on from `start + max(h, w)`. Tokens past the prompt (generated ones) sit at
`index + delta` on every axis:

    tokens:  a  b  [image, 1 x 2 x 2 merged]  c
    time:    0  1   2  2  2  2                4
    height:  0  1   2  2  3  3                4
    width:   0  1   2  3  2  3                4      delta = (4 + 1) - 7 = -2
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MropePositions:
    """One request's 3-D positions: its prompt's, and the shift of the tokens after it."""

    prompt: np.ndarray  # [3, num_prompt] int64: time, height, width of each prompt token
    delta: int  # token `i` past the prompt is at `i + delta` on all three axes

    def rows(self, start: int, stop: int) -> np.ndarray:
        """`[3, stop - start]` int64: positions of the request's tokens `start..stop-1`
        (prompt tokens from `prompt`, later ones shifted by `delta`)."""
        num_prompt = self.prompt.shape[1]
        inside = self.prompt[:, start:min(stop, num_prompt)]
        after = np.arange(max(start, num_prompt), stop, dtype=np.int64) + self.delta
        return np.concatenate([inside, np.broadcast_to(after, (3, len(after)))], axis=1)


def mrope_positions(token_ids: Sequence[int] | np.ndarray, image_token_id: int,
                    image_grids: Sequence[tuple[int, int, int]],
                    spatial_merge_size: int) -> MropePositions:
    """The 3-D positions of a prompt whose images are the runs of `image_token_id`, in order.

    `image_grids`: each image's `(t, h, w)` in patches before the spatial merge (the vision
    processor's `image_grid_thw`); image `k` has `t * h * w / spatial_merge_size**2` tokens.
    """
    ids = np.asarray(token_ids)
    image_rows = np.flatnonzero(ids == image_token_id)
    merged = [(t, h // spatial_merge_size, w // spatial_merge_size) for t, h, w in image_grids]
    counts = [t * h * w for t, h, w in merged]
    if sum(counts) != len(image_rows):
        raise ValueError(f"the prompt has {len(image_rows)} image tokens, its image grids "
                         f"{list(image_grids)} make {sum(counts)}")
    positions = np.empty((3, len(ids)), np.int64)
    next_position, text_from, taken = 0, 0, 0
    for image, ((t, h, w), count) in enumerate(zip(merged, counts, strict=True)):
        first = int(image_rows[taken])
        taken += count
        if image_rows[taken - 1] - first != count - 1:
            raise ValueError(f"image {image}'s {count} tokens are not contiguous "
                             f"from row {first}")
        positions[:, text_from:first] = next_position + np.arange(first - text_from)
        next_position += first - text_from
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij"))
        positions[:, first:first + count] = next_position + grid.reshape(3, -1)
        next_position += max(h, w)
        text_from = first + count
    positions[:, text_from:] = next_position + np.arange(len(ids) - text_from)
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return MropePositions(positions, delta)
