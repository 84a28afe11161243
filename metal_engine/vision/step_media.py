"""What a step's images add to its packed rows: the tower's embeddings in the rows of image
placeholder tokens, the three-axis rope positions of a step that holds any such prompt, and
for a model whose image tokens see each other, how far each row sees.

A request's share of a step may hold part of an image (a chunk cut through it): it takes
that part's rows of the image's features, which the encoder cache keeps for the next chunk.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import mlx.core as mx
import numpy as np

from metal_engine.models.step_images import StepImages
from metal_engine.vision.encoder_cache import EncoderCache
from scheduler.media import ImageSpan, PromptMedia
from scheduler.output import ScheduledRequest


def step_images(scheduled: Sequence[ScheduledRequest], media: Mapping[str, PromptMedia],
                cu_seqlens: np.ndarray, encoder: EncoderCache) -> StepImages | None:
    """The step's image rows and their features (None: no row of this step is an image's)."""
    pieces = list(_image_pieces(scheduled, media, cu_seqlens))
    if not pieces:
        return None
    features = encoder.features([image for _, image, _, _ in pieces])
    rows = np.concatenate([np.arange(row, row + to - frm) for row, _, frm, to in pieces])
    embeds = mx.concatenate([f.embeds[frm:to] for f, (_, _, frm, to) in zip(features, pieces,
                                                                              strict=True)])
    num_deep = len(features[0].deepstack)
    deepstack = tuple(
        mx.concatenate([f.deepstack[layer][frm:to]
                        for f, (_, _, frm, to) in zip(features, pieces, strict=True)])
        for layer in range(num_deep))
    return StepImages(mx.array(rows.astype(np.int32)), embeds, deepstack)


def image_last_keys(scheduled: Sequence[ScheduledRequest], media: Mapping[str, PromptMedia],
                    cu_seqlens: np.ndarray, positions: np.ndarray) -> np.ndarray | None:
    """For a text model whose image tokens see each other in prefill: each row's last
    visible key (AttentionMetadata.last_keys), the image's last token for a row inside one,
    its own `positions` entry otherwise; None when no row of the step is an image's."""
    last_keys = None
    for row, image, frm, to in _image_pieces(scheduled, media, cu_seqlens):
        if last_keys is None:
            last_keys = positions.astype(np.int64)
        last_keys[row:row + to - frm] = image.offset + to - 1  # the chunk holds it whole
    return last_keys


def _image_pieces(scheduled: Sequence[ScheduledRequest], media: Mapping[str, PromptMedia],
                  cu_seqlens: np.ndarray) -> Iterator[tuple[int, ImageSpan, int, int]]:
    """Each part of an image the step's chunks hold: (its first packed row, the image, the
    part's first and end token within the image)."""
    for index, item in enumerate(scheduled):
        prompt_media = media.get(item.request_id)
        if prompt_media is None:
            continue
        start = item.start_position
        end = start + len(item.token_ids)
        for image in prompt_media.overlapping(start, end):
            first, last = max(start, image.offset), min(end, image.end)
            row = int(cu_seqlens[index]) + first - start
            yield row, image, first - image.offset, last - image.offset


def step_positions(scheduled: Sequence[ScheduledRequest], media: Mapping[str, PromptMedia],
                   positions: np.ndarray) -> np.ndarray:
    """The step's rope positions: three-axis rows where a row of the step sits at different
    time, height and width positions (an image's), else one axis, where a request's images
    shifted its later tokens."""
    if not any(getattr(media.get(s.request_id), "positions", None) is not None
               for s in scheduled):
        return positions
    parts, row = [], 0
    for item in scheduled:
        count = len(item.token_ids)
        prompt_media = media.get(item.request_id)
        if prompt_media is not None and prompt_media.positions is not None:
            start = item.start_position
            parts.append(prompt_media.positions.rows(start, start + count))
        else:
            parts.append(np.broadcast_to(positions[row:row + count], (3, count)))
        row += count
    three = np.concatenate(parts, axis=1).astype(np.int32)
    # Rows past the images (decodes, text) have three equal positions: one axis keeps the
    # step on the text path's rope.
    return three[0] if (three == three[0]).all() else three

