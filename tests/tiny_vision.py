"""What the vision-serving tests share: the tiny Qwen checkpoints' image processor, random
pictures, and transformers' greedy tokens for a prompt with one image as the reference."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from tiny_models import IMAGE_TOKENS, QWEN_VISION
from transformers import Qwen2VLImageProcessorPil

IMAGE, START, END = (IMAGE_TOKENS[k] for k in ("image_token_id", "vision_start_token_id",
                                               "vision_end_token_id"))


def image_processor() -> Qwen2VLImageProcessorPil:
    """The tiny tower's processor: pictures resized to 64..256 pixels, 4 to 16 image tokens."""
    return Qwen2VLImageProcessorPil(
        patch_size=QWEN_VISION["patch_size"], merge_size=QWEN_VISION["spatial_merge_size"],
        temporal_patch_size=QWEN_VISION["temporal_patch_size"],
        size={"shortest_edge": 8 * 8, "longest_edge": 16 * 16})


def picture(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)
    return Image.fromarray(pixels)


def image_token_count(processor, image: Image.Image) -> int:
    """How many placeholder tokens transformers' processor gives `image`."""
    grid = processor(images=[image], return_tensors="pt")["image_grid_thw"]
    return int(grid.prod()) // QWEN_VISION["spatial_merge_size"] ** 2


def transformers_greedy(model, processor, ids: list[int], images: Image.Image | list[Image.Image],
                        max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens for `ids` (a placeholder per image) and `images`."""
    images = images if isinstance(images, list) else [images]
    pixels = processor(images=images, return_tensors="pt")
    counts = iter(image_token_count(processor, image) for image in images)
    expanded = torch.tensor([[t for token in ids
                              for t in ([IMAGE] * next(counts) if token == IMAGE else [token])]])
    with torch.no_grad():  # every token attended: none is padding, whatever its id
        out = model.generate(expanded, attention_mask=torch.ones_like(expanded),
                             pixel_values=pixels["pixel_values"],
                             image_grid_thw=pixels["image_grid_thw"],
                             mm_token_type_ids=(expanded == IMAGE).int(),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, expanded.shape[1]:].tolist()
