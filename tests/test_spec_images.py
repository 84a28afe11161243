"""Speculative decoding of prompts with images, on a tiny random Qwen3.5 vision-language
checkpoint with a multi-token-prediction head, converted as users do: greedy tokens with MTP
or n-gram drafts equal those without and transformers', and each MTP draft is drawn from the
head's distribution at the multimodal-rope positions of the model's rows (three axes in the
prompt, the images' delta past it), composed in PyTorch as test_spec_mtp composes the head.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from test_spec_mtp import FULL_ATTENTION_LAYER, Reference
from test_vision_serving import MAX_TOKENS, PROMPT, Picture, save_tokenizer
from tiny_models import build_tiny_model
from tiny_vision import IMAGE, image_processor, picture, transformers_greedy

from convert import convert_model
from metal_engine.config import EngineConfig
from metal_engine.engine_build import build_engine
from scheduler import SamplingParams
from scheduler.spec_decode.config import SpeculativeConfig

MTP = SpeculativeConfig(method="mtp", num_speculative_tokens=2)
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                          prompt_lookup_max=3)
# Text that repeats after the image, so that n-gram lookups find drafts.
LOOPING = [5, 9, 17, 5, 9, 17, 122, IMAGE, 123, 5, 9, 17, 5, 9]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers' vision-language model, its processor, the head's reference, our
    converted dir)."""
    root = tmp_path_factory.mktemp("qwen3_5-mtp")
    model = build_tiny_model("qwen3_5_text", root / "hf", vision=True)
    # The head's weights come from a text model of the same config: its layer class is the
    # language model's.
    reference = Reference(build_tiny_model("qwen3_5_text", root / "text"))
    weights = load_file(root / "hf" / "model.safetensors")
    save_file({**weights, **reference.tensors()}, str(root / "hf" / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((root / "hf" / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (root / "hf" / "config.json").write_text(json.dumps(config))
    processor = image_processor()
    processor.save_pretrained(root / "hf")
    save_tokenizer(root / "hf")
    return model, processor, reference, convert_model(root / "hf", root / "model",
                                                      progress=False)


def engine_of(model_dir, speculative=None):
    return build_engine(EngineConfig(model_dir=model_dir, max_model_len=256,
                                     kv_cache_memory=16 << 20, block_size=8,
                                     max_num_batched_tokens=16, speculative_config=speculative))


def serve(engine, prompts, params) -> dict[str, list[int]]:
    for request_id, (ids, media) in prompts.items():
        engine.add_request(request_id, ids, params, media=media)
    tokens = {request_id: [] for request_id in prompts}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    return tokens


def image_prompts(engine) -> dict:
    vision = engine.image_model
    return {"wide": vision.place(PROMPT, [Picture(picture(24, 10, 1))]),
            "looping": vision.place(LOOPING, [Picture(picture(9, 20, 2))]),
            "text": ([7, 8, 9, 10, 7, 8, 9], None)}


def test_greedy_tokens_with_drafts_equal_those_without(checkpoint):
    model, processor, _, model_dir = checkpoint
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = engine_of(model_dir)
    expected = serve(plain, image_prompts(plain), params)
    assert expected["wide"][:MAX_TOKENS] == transformers_greedy(
        model, processor, PROMPT, picture(24, 10, 1), MAX_TOKENS)
    for spec in (MTP, NGRAM):
        engine = engine_of(model_dir, spec)
        assert serve(engine, image_prompts(engine), params) == expected, spec.method
        assert engine.scheduler.drafter.stats.num_draft_tokens > 10


def head_distributions(model, processor, reference, ids: list[int], image, temperature):
    """softmax(logits / T) of the head in PyTorch at every position but the last of `ids` (a
    prompt with `image`, then its outputs), turned as the language model's full-attention
    layer turns that position (its multimodal rope)."""
    pixels = processor(images=[image], return_tensors="pt")
    tokens = torch.tensor([ids])
    inputs = dict(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
    captured = {}
    layer = model.model.language_model.layers[FULL_ATTENTION_LAYER]
    hook = layer.register_forward_pre_hook(lambda module, args, kwargs: captured.update(kwargs),
                                           with_kwargs=True)
    with torch.no_grad():
        model.model(tokens[:, :-1], mm_token_type_ids=(tokens[:, :-1] == IMAGE).int(),
                    **inputs)
        hook.remove()
        hidden = model.model(tokens, mm_token_type_ids=(tokens == IMAGE).int(),
                             **inputs).last_hidden_state[:, :-1]
        embeds = model.model.language_model.embed_tokens(tokens[:, 1:])
        x = reference.fc(torch.cat([reference.norms["pre_fc_norm_embedding"](embeds),
                                    reference.norms["pre_fc_norm_hidden"](hidden)], dim=-1))
        kwargs = {k: v for k, v in captured.items()
                  if k not in ("cache", "past_key_values", "use_cache")}
        out = reference.layer(x, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        logits = model.lm_head(reference.norms["norm"](out))[0]
    return torch.softmax(logits / temperature, dim=-1).numpy()


def test_each_mtp_draft_comes_from_the_head_at_the_multimodal_positions(checkpoint):
    """First drafts of a sampled request after an image: q equals the head's distribution at
    the fed token's position - 1, which in the prompt turns by three axes and past it by the
    index shifted by the image's delta (the index alone gives another q)."""
    model, processor, reference, model_dir = checkpoint
    engine = engine_of(model_dir, MTP)
    image = picture(24, 10, 1)
    ids, media = engine.image_model.place(PROMPT, [Picture(image)])
    assert media.positions.delta != 0
    drawn, draft = [], engine.runner.draft.draft

    def recording(out, *args):
        drafts = draft(out, *args)
        if drafts is not None:
            (item,) = [s for s in out.scheduled if s.draft_token_ids]
            drawn.append((item.start_position, np.array(drafts.probs)[0]))
        return drafts

    engine.runner.draft.draft = recording
    temperature = 0.8
    engine.add_request("r", ids, SamplingParams(max_tokens=24, temperature=temperature, seed=3,
                                                ignore_eos=True), media=media)
    outputs = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs += output.new_token_ids
    expected = head_distributions(model, processor, reference, [*ids, *outputs], image,
                                  temperature)
    assert len(drawn) > 5
    for position, q in drawn:
        np.testing.assert_allclose(q, expected[position - 1], atol=1e-4,
                                   err_msg=f"position {position}")


def test_a_looping_prompt_accepts_ngram_drafts_after_its_image(checkpoint):
    """n-gram drafts proposed from the text around the image are verified at the shifted
    positions: accepted drafts give the tokens the plain run gives."""
    _, _, _, model_dir = checkpoint
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = engine_of(model_dir)
    engine = engine_of(model_dir, replace(NGRAM, num_speculative_tokens=4))
    prompt = {"looping": image_prompts(plain)["looping"]}
    assert serve(engine, prompt, params) == serve(plain, prompt, params)
