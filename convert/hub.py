"""Hugging Face hub repo ids (`org/name`) as model references, resolved through
`huggingface_hub`: its cache, `HF_TOKEN` and `HF_HUB_OFFLINE` apply as in every hub tool."""

from __future__ import annotations

import re
from pathlib import Path

# Only what a model dir needs: pickle checkpoints (*.bin, *.pt) are never fetched, or read.
SNAPSHOT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_repo_id(reference: str) -> bool:
    """`org/name` that is not a local path."""
    return REPO_ID.fullmatch(reference) is not None and not Path(reference).exists()


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot dir of `repo_id` at `revision` (default: main), fetched into the hub
    cache unless it is there or downloads are off."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    at = f" at revision {revision!r}" if revision else ""
    try:
        path = Path(snapshot_download(repo_id, revision=revision,
                                      allow_patterns=SNAPSHOT_PATTERNS))
    except LocalEntryNotFoundError as exc:
        raise FileNotFoundError(
            f"{repo_id}{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            "could not be downloaded (HF_HUB_OFFLINE is set or the hub is unreachable); fetch "
            "it once with network access"
        ) from exc
    except HfHubHTTPError as exc:
        raise ValueError(
            f"could not fetch {repo_id}{at} from the Hugging Face hub: {exc}. For a gated or "
            "private repo, set HF_TOKEN"
        ) from exc
    if not any(path.glob("*.safetensors")):
        raise ValueError(
            f"{repo_id}{at} has no safetensors weights. metal-serve never loads pickle "
            "checkpoints (*.bin/*.pt), which can run code when loaded: pick a repo with "
            "safetensors (e.g. an mlx-community conversion), or re-save the model as "
            "safetensors and run `metal-serve convert DIR --out OUT`"
        )
    return path
