"""Speculative decoding's `mtp` method on the latent-attention families (DeepSeek V3,
GLM-4.7-Flash): their checkpoints keep the MTP layer after the stack
(`model.layers.{num_hidden_layers}.*`), which `convert` moves under `mtp.*`.

The reference is transformers' own `MtpModel` over the tiny model: its layer's weights are
written under DeepSeek's checkpoint names (its embedding and head repeated, as published
checkpoints hold them; experts one tensor each), the checkpoint converted, and the tests of
tests/test_spec_mtp.py run against it here.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from test_spec_mtp import (  # noqa: F401  (collected here, against this module's `with_head`)
    per_expert,
    test_each_first_draft_comes_from_the_heads_distribution,
    test_mtp_gives_the_same_greedy_tokens,
    test_the_engine_serves_a_models_own_head,
    test_the_head_computes_its_reference,
    test_the_memory_plan_counts_the_heads_weights,
)
from tiny_models import build_tiny_model
from transformers.modeling_layers import MtpModel

from metal_engine.loading.weights import load_model

FAMILIES = {"deepseek_v3": dict(num_mtp_layers=1),
            # transformers' GLM-4.7-Flash config names no MTP layer: say the head's kind
            "glm4_moe_lite": dict(num_mtp_layers=1, mtp_mlp_layer_types=["sparse"])}
SPARSE_LAYER = 1  # experts in both tiny configs


class MtpReference:
    """transformers' `MtpModel` (one layer) beside the model it drafts for."""

    def __init__(self, model, seed: int = 1) -> None:
        kept = {n: t.clone() for n, t in model.state_dict().items()}
        torch.manual_seed(seed)
        self.model = model
        self.mtp = MtpModel(model, 1).eval()
        model.load_state_dict(kept)  # the shared embedding and head as they were
        # The block starts as the model's sparse layer (its drafts then take some accepting)
        self.mtp.layers[0].mtp_block.load_state_dict(
            model.model.layers[SPARSE_LAYER].state_dict())
        with torch.no_grad():  # off the model's layer, norms off 1
            for parameter in self.mtp.layers.parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
            for name, buffer in self.mtp.layers.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.add_(0.5 * torch.randn_like(buffer))

    def tensors(self) -> dict[str, np.ndarray]:
        """The layer under DeepSeek's checkpoint names (layer N = num_hidden_layers)."""
        named = {n.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm."): t
                 for n, t in self.mtp.layers[0].state_dict().items()}
        named["embed_tokens.weight"] = self.model.model.embed_tokens.weight
        named["shared_head.head.weight"] = self.model.lm_head.weight
        layer = f"model.layers.{self.model.config.num_hidden_layers}"
        return {f"{layer}.{n}": t.detach().numpy().copy() for n, t in per_expert(named).items()}

    def logits(self, ids: list[int]) -> np.ndarray:
        """`[len(ids) - 1, V]`: row p predicts the token at p + 2 from position p."""
        tokens = torch.tensor([ids])
        with torch.no_grad():
            hidden = self.model.model(tokens).last_hidden_state[:, :-1]
            positions = torch.arange(len(ids) - 1)[None]
            out = self.mtp.forward_layer(0, hidden, positions, None, input_ids=tokens[:, 1:])
            return self.mtp._project_to_logits(out)[0].numpy()


def build_with_head(family: str, root: Path) -> tuple[MtpReference, Path]:
    """A tiny checkpoint of `family` with its MTP layer after the stack, converted."""
    from convert import convert_model

    source = root / "hf"
    reference = MtpReference(build_tiny_model(family, source, **FAMILIES[family]))
    weights = load_file(source / "model.safetensors")
    save_file({**weights, **reference.tensors()}, str(source / "model.safetensors"),
              metadata={"format": "pt"})
    return reference, convert_model(source, root / "converted", progress=False)


@pytest.fixture(scope="module", params=list(FAMILIES))
def with_head(request, tmp_path_factory):
    return build_with_head(request.param, tmp_path_factory.mktemp(request.param))


def test_conversion_keeps_the_layer_float_under_the_heads_names(with_head):
    """`mtp.*` as the head loads it (experts stacked, the repeated embedding and head
    dropped), the count in config.json; the model itself loads as without it."""
    _, path = with_head
    names = {n for f in path.glob("*.safetensors") for n in mx.load(str(f))}
    mtp = {n for n in names if n.startswith("mtp.")}
    assert {"mtp.enorm.weight", "mtp.hnorm.weight", "mtp.eh_proj.weight", "mtp.norm.weight",
            "mtp.layers.0.mlp.switch_mlp.gate_proj.weight"} <= mtp
    assert not any("embed_tokens" in n or "shared_head" in n or ".experts." in n for n in mtp)
    assert json.loads((path / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    model = load_model(path, mx.float32)
    assert len(model.model.layers) == model.config.num_hidden_layers


def test_a_checkpoint_without_the_layer_converts_as_before(tmp_path):
    from convert import convert_model

    build_tiny_model("deepseek_v3", tmp_path / "hf")
    path = convert_model(tmp_path / "hf", tmp_path / "converted", progress=False)
    names = {n for f in path.glob("*.safetensors") for n in mx.load(str(f))}
    assert not any(n.startswith("mtp.") for n in names)
    assert "mtp_num_hidden_layers" not in json.loads((path / "config.json").read_text())


def test_a_quantized_conversion_keeps_the_head_float(with_head, tmp_path):
    """`--quantize` packs the model's layers, not the head's (loaded as float)."""
    from convert import convert_model
    from metal_engine.drafting.mtp import load_mtp_head

    _, path = with_head
    quantized = convert_model(path.parent / "hf", tmp_path / "q8", progress=False, quantize=8,
                              group_size=32)
    names = {n for f in quantized.glob("*.safetensors") for n in mx.load(str(f))}
    assert any(n.endswith(".scales") for n in names)
    assert not any(n.startswith("mtp.") and n.endswith(".scales") for n in names)
    head = load_mtp_head(quantized, load_model(quantized, mx.float32), mx.float32)
    assert head.pool_shape() == (1, 40)
