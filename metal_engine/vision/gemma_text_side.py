"""What Gemma's text model must do with the soft tokens of metal_engine.vision's Gemma towers
(the runner's part; transformers' Gemma3Model / Gemma4Model do it so):

Prompt. Each image is `boi, image_token_id x num_tokens, eoi` (`ImageTokens.around`). Gemma 3's
processor writes "\\n\\n" (text, tokenized as such) before boi and after eoi, replacing the
`<start_of_image>` the chat template puts where the image goes; Gemma 4's replaces the
template's image token with the bare `boi ... eoi`.

Embeddings. The tower's rows replace the embeddings of the image placeholders, in prompt
order, *after* the `sqrt(hidden)` embedding scale (the rows themselves are not scaled). The
placeholder id itself is never looked up: Gemma 3 looks up 0 instead when the id is past the
vocabulary, Gemma 4 looks up `pad_token_id`. Gemma 4's per-layer embeddings (PLE) take their
token part from `pad_token_id` at image positions, and their projection part from the merged
embeddings (image rows included).

Attention. In prefill, the placeholders of one image (a maximal run of them, `image_blocks`;
boi and eoi are text) see each other both ways: mask = causal OR same image, and on sliding
layers that AND `key > query - window`. Gemma 3 does it on every layer; Gemma 4 only when its
text config says `use_bidirectional_attention: "vision"`, and then only on sliding layers
(`bidirectional_layers`). Since later tokens of an image are seen by earlier ones, a prefill
chunk must hold an image whole (transformers passes the image tokens with each prefill chunk
from the start of the sequence). Decode steps are plain causal.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from metal_engine.vision.gemma_config import gemma_family


def image_blocks(token_ids: np.ndarray, image_token_id: int) -> np.ndarray:
    """Per position of one sequence, the index of the image its placeholder belongs to
    (0, 1, ... in order); -1 for text."""
    is_image = np.asarray(token_ids) == image_token_id
    starts = is_image & ~np.concatenate([[False], is_image[:-1]])
    return np.where(is_image, np.cumsum(starts) - 1, -1)


def bidirectional_layers(config: dict[str, Any]) -> Literal["all", "sliding", "none"]:
    """Which layers of a Gemma vision-language config.json (multimodal or converted) let an
    image's tokens see each other."""
    family = gemma_family(config)
    if family == "gemma3":
        return "all"
    text = config.get("text_config") or config
    if family == "gemma4" and text.get("use_bidirectional_attention") == "vision":
        return "sliding"
    return "none"
