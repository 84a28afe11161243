"""Host-side (numpy) tables of the Qwen vision tower that depend only on the images' patch
grids: where each patch sits, how the learned position grid is resampled for it, and which rows
attend to each other.

Patch rows follow the image processor's merge-block order: image by image, frame by frame,
then (block_row, block_col, row_in_block, col_in_block) with merge x merge patches per block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Grid = tuple[int, int, int]  # (t, h, w) in patches


def merge_block_coords(height: int, width: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of every patch of one `height` x `width` frame, in merge-block order."""
    if height % merge or width % merge:
        raise ValueError(f"a {height}x{width} patch grid does not split into {merge}x{merge} "
                         "merge blocks; preprocess the image with the checkpoint's processor")
    rows, cols = np.meshgrid(np.arange(height), np.arange(width), indexing="ij")
    shape = (height // merge, merge, width // merge, merge)
    return (rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1),
            cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1))


def rotary_positions(grids: Sequence[Grid], merge: int) -> np.ndarray:
    """[num_patches, 2] (row, col) of every patch: the 2-D rotary embedding's positions."""
    return np.concatenate([np.tile(np.stack(merge_block_coords(h, w, merge), axis=-1), (t, 1))
                           for t, h, w in grids])


def position_interpolation(grids: Sequence[Grid], side: int,
                           merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear resampling (corners aligned) of the `side` x `side` learned position grid to each
    frame's patch grid: per patch the 4 flat indices into the table [num_patches, 4] (int32) and
    their weights [num_patches, 4] (float32)."""
    indices, weights = [], []
    for t, h, w in grids:
        rows, cols = merge_block_coords(h, w, merge)
        row_taps, row_weights = _axis_taps(rows, h, side)
        col_taps, col_weights = _axis_taps(cols, w, side)
        flat = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
        weight = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
        indices.append(np.tile(flat, (t, 1)))
        weights.append(np.tile(weight, (t, 1)))
    return (np.concatenate(indices).astype(np.int32),
            np.concatenate(weights).astype(np.float32))


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """The two source taps of each target `index` on an axis of `size` resampled from `side`,
    and their linear weights; the first and last targets land on the first and last source."""
    source = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(source)
    taps = floor.astype(np.int64)[:, None] + np.arange(2)
    weights = np.clip(1 - np.abs(source[:, None] - taps), 0, None).astype(np.float32)
    return np.clip(taps, 0, side - 1), weights


def attention_segments(grids: Sequence[Grid]) -> list[tuple[int, int]]:
    """[start, end) of each frame's rows: patches attend only within their own frame.

        grids (1,2,4), (1,4,4):  rows [0, 8) | [8, 24)
    """
    lengths = [h * w for t, h, w in grids for _ in range(t)]
    ends = np.cumsum(lengths).tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))
