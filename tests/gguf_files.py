"""Writing GGUF files in tests the way llama.cpp's converter does: its Q/K row order, tokenizer
metadata borrowed from the default model, and K-quant blocks."""

from __future__ import annotations

import functools

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from convert.default_model import default_gguf_path

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# K-quant block bytes, and where each block's float16 scale(s) sit: gguf cannot quantize to K
# types, so tests write random blocks with sane scales.
K_BLOCKS = {Q.Q4_K: (144, (0, 2)), Q.Q5_K: (176, (0, 2)), Q.Q6_K: (210, (208,))}


def llama_cpp_permute(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (interleaves the two rotary halves)."""
    half = rows.shape[0] // n_heads // 2
    return rows.reshape(n_heads, 2, half, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def stored_tensor(rng: np.random.Generator, shape: tuple[int, ...], qtype: Q):
    """(array to write, its raw qtype or None, the float32 values a correct reader recovers)."""
    weights = rng.standard_normal(shape).astype(np.float32)
    if qtype == Q.F32:
        return weights, None, weights
    if qtype == Q.F16:
        return weights.astype(np.float16), None, weights.astype(np.float16).astype(np.float32)
    if qtype in K_BLOCKS:
        size, scale_offsets = K_BLOCKS[qtype]
        blocks = rng.integers(0, 256, size=(shape[0], shape[1] // 256, size), dtype=np.uint8)
        for offset in scale_offsets:
            blocks[..., offset:offset + 2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
        if qtype != Q.Q6_K:  # the block's min scale (dmin) follows its scale
            blocks[..., 2:4] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
        raw = blocks.reshape(shape[0], -1)
        return raw, qtype, dequantize(raw, qtype)
    raw = quantize(weights, qtype)
    return raw, qtype, dequantize(raw, qtype)


@functools.cache
def default_tokenizer_metadata(vocab: int) -> tuple[str, list[str], list[int], list[str]]:
    """The default model's first `vocab` tokens and the merges among them (read once: slow)."""
    fields = GGUFReader(default_gguf_path()).fields
    tokens = fields["tokenizer.ggml.tokens"].contents(slice(0, vocab))
    known = set(tokens)
    merges = [m for m in fields["tokenizer.ggml.merges"].contents()
              if set(m.split(" ")) <= known and m.replace(" ", "") in known]
    types = fields["tokenizer.ggml.token_type"].contents(slice(0, vocab))
    return fields["tokenizer.ggml.pre"].contents(), tokens, types, merges


def copy_tokenizer_metadata(writer: GGUFWriter, vocab: int) -> None:
    pre, tokens, types, merges = default_tokenizer_metadata(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)


def finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
