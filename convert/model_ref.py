"""What `metal-serve serve <model>` loads for a model reference as users type it."""

from __future__ import annotations

from pathlib import Path

from convert.api import local_source
from convert.cache import ensure_converted, models_dir
from convert.fp8_weights import fp8_block
from convert.hf_source import open_hf_dir
from convert.hub import is_repo_id
from convert.mxfp4_experts import is_mxfp4_checkpoint
from metal_engine.loading.model_config import read_config_json
from metal_engine.loading.quantization import QuantizationConfig


def resolve_model(reference: str, revision: str | None = None, cache_dir: Path | None = None,
                  progress: bool = True) -> Path:
    """The model dir for `reference`:

    - a local dir: as it is (loading names anything wrong with it);
    - a hub repo id (`org/name`, at `revision`): its snapshot in the hub cache when the engine
      loads it as it is (an mlx-community quantized repo, or safetensors in the Hugging Face
      layout with a tokenizer.json and no per-expert tensors), else its conversion into the
      metal-serve cache;
    - a .gguf file: its conversion into the metal-serve cache, made on first use.
    """
    path = Path(reference).expanduser()
    if path.is_dir():
        return path
    if not path.exists() and not is_repo_id(reference):
        raise FileNotFoundError(
            f"model {reference} does not exist: pass a model dir, a .gguf file or a hub repo id "
            "(org/name); `metal-serve convert` makes a model dir"
        )
    source = local_source(reference, revision)
    if source.is_dir() and loads_as_is(source):
        return source
    name = reference.replace("/", "--") if source.is_dir() else source.stem
    return ensure_converted(source, models_dir(cache_dir) / name, progress)


def loads_as_is(folder: Path) -> bool:
    """Whether the engine loads `folder` without conversion. Raises ValueError for weights it
    can never load (pickle only, a foreign quantization scheme, an unsupported family)."""
    config = read_config_json(folder)
    if is_mxfp4_checkpoint(config):  # GPT-OSS as OpenAI publishes it: its experts re-laid
        return False
    if fp8_block(config) is not None:  # DeepSeek's FP8: dequantized at conversion
        return False
    if QuantizationConfig.from_config(config) is not None:
        return True
    source = open_hf_dir(folder)  # checks every tensor name and shape against the config
    # A MoE checkpoint stores one tensor per expert, which the engine loads only stacked.
    return (folder / "tokenizer.json").is_file() and source.config.moe is None
