"""Random LoRA adapters over tiny transformers models, saved by PEFT, and their references."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from safetensors.numpy import save_file

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_TARGETS = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def save_peft_adapter(base, path: Path, rank: int, seed: int, targets=ALL_TARGETS,
                      alpha: float = 16.0, rslora: bool = False, parameters=None):
    """A PEFT LoRA over a copy of `base`, A and B random (PEFT's own init zeroes B), saved
    into `path`; returned as the PyTorch reference. `parameters`: PEFT's
    `target_parameters` (a MoE's fused experts)."""
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                        init_lora_weights=False, target_parameters=parameters)
    model = get_peft_model(copy.deepcopy(base), config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(0.1 * torch.randn_like(parameter))
    model.save_pretrained(path)
    return model


def save_as_mlx_lm(peft_dir: Path, path: Path) -> None:
    """The PEFT adapter in `peft_dir` rewritten in mlx-lm's layout (A `[in, r]`, B `[r, out]`,
    the scale as a number)."""
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    from safetensors.numpy import load_file

    tensors = load_file(peft_dir / "adapter_model.safetensors")
    out = {}
    for key, value in tensors.items():
        module = key.removeprefix("base_model.model.")
        if ".lora_A." in module:
            out[module.replace(".lora_A.weight", ".lora_a")] = np.ascontiguousarray(value.T)
        else:
            out[module.replace(".lora_B.weight", ".lora_b")] = np.ascontiguousarray(value.T)
    path.mkdir(parents=True)
    save_file(out, path / "adapters.safetensors")
    keys = sorted({k.rsplit(".", 2)[-2] for k in out})
    (path / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "lora_parameters": {
            "rank": config["r"], "scale": config["lora_alpha"] / config["r"],
            "dropout": 0.0, "keys": keys}}))


def torch_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].numpy()


def torch_greedy(model, ids: list[int], max_new: int) -> list[int]:
    """Greedy continuation, one full forward per token (no cache: the plainest reference)."""
    tokens = list(ids)
    for _ in range(max_new):
        tokens.append(int(torch_logits(model, tokens)[-1].argmax()))
    return tokens[len(ids):]


def write_peft_files(path: Path, pairs: dict[str, tuple[np.ndarray, np.ndarray]],
                     rank: int, base_model: str | None = None) -> Path:
    """PEFT's files written by hand: `pairs` maps a module to (A `[r, in]`, B `[out, r]`);
    `base_model`: the base it names."""
    path.mkdir(parents=True)
    tensors = {}
    for module, (a, b) in pairs.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.astype(np.float32)
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.astype(np.float32)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "base_model_name_or_path": base_model,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in pairs})}))
    return path


def write_mlx_lm_files(path: Path, pairs: dict[str, tuple[np.ndarray, np.ndarray]],
                       rank: int) -> Path:
    """mlx-lm's files written by hand, scale 1: `pairs` maps a module to (A, B) as PEFT
    orders them, (`[r, in]`, `[out, r]`) or a SwitchLinear's (`[experts, r, in]`,
    `[experts, out, r]`, which mlx-lm stores as they are)."""
    path.mkdir(parents=True)
    tensors = {}
    for module, (a, b) in pairs.items():
        a, b = (a, b) if a.ndim == 3 else (a.T, b.T)
        tensors[f"{module}.lora_a"] = np.ascontiguousarray(a, np.float32)
        tensors[f"{module}.lora_b"] = np.ascontiguousarray(b, np.float32)
    save_file(tensors, path / "adapters.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "lora_parameters": {"rank": rank, "scale": 1.0}}))
    return path
