"""Gated DeltaNet over packed rows against transformers' qwen3_5 torch functions: the delta
rule (recurrent, chunked, dispatched over mixed batches), the causal conv with carried state,
and the whole layer, in one call and split into prefill chunks and decode rows."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten
from transformers import Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from metal_engine.loading.weights import split_fused
from metal_engine.models.gated_delta import (
    ONE_TAP_ROWS,
    GatedDeltaNet,
    GatedDeltaNetConfig,
    causal_conv1d,
)
from metal_engine.models.gated_delta_rule import (
    chunked_gated_delta_rule,
    gated_delta_rule,
    recurrent_gated_delta_rule,
)

TOL = dict(atol=1e-4, rtol=1e-4)
HK, HV, DK, DV = 2, 4, 16, 8  # two value heads per key head


def _rule_inputs(rng, total: int, num_seqs: int, hk: int = HK):
    """(q, k, v, g, beta) rows as numpy float32, and random initial states."""
    q, k = (rng.standard_normal((total, hk, DK), dtype=np.float32) for _ in range(2))
    v = rng.standard_normal((total, HV, DV), dtype=np.float32)
    g = -rng.uniform(0, 1.5, (total, HV)).astype(np.float32)
    beta = rng.uniform(0, 1, (total, HV)).astype(np.float32)
    state = rng.standard_normal((num_seqs, HV, DK, DV), dtype=np.float32)
    return (q, k, v, g, beta), state


def _torch_rule(fn, rows, state, normalize_qk: bool = True):
    """transformers' rule on one request's rows (numpy), from its state `[Hv, Dk, Dv]`."""
    batch = [torch.from_numpy(x)[None] for x in rows]
    out, final = fn(*batch[:3], g=batch[3], beta=batch[4],
                    initial_state=torch.from_numpy(state)[None], output_final_state=True,
                    use_qk_l2norm_in_kernel=normalize_qk)
    return out[0].numpy(), final[0].numpy()


def _mlx(rows):
    return [mx.array(x) for x in rows]


def _close(actual, expected):
    np.testing.assert_allclose(np.array(actual), expected, **TOL)


@pytest.mark.parametrize("hk, normalize_qk", [(HK, True), (HV, True), (HK, False)])
def test_recurrent_matches_transformers(hk, normalize_qk):
    rows, state = _rule_inputs(np.random.default_rng(0), 40, 1, hk)
    if not normalize_qk:  # unnormalized keys make the state grow: keep them small
        rows = (rows[0] * 0.2, rows[1] * 0.2, *rows[2:])
    ours = recurrent_gated_delta_rule(*_mlx(rows), [0, 40], mx.array(state),
                                      normalize_qk=normalize_qk)
    out, final = _torch_rule(hf.torch_recurrent_gated_delta_rule, rows, state[0], normalize_qk)
    _close(ours.out, out)
    _close(ours.state[0], final)


@pytest.mark.parametrize("length", [1, 63, 64, 150])
def test_chunked_matches_transformers(length):
    rows, state = _rule_inputs(np.random.default_rng(1), length, 1)
    ours = chunked_gated_delta_rule(*_mlx(rows), [0, length], mx.array(state))
    out, final = _torch_rule(hf.torch_chunk_gated_delta_rule, rows, state[0])
    _close(ours.out, out)
    _close(ours.state[0], final)


def test_chunked_matches_recurrent_over_a_batch():
    cu = np.array([0, 1, 70, 70, 77, 205])  # lengths 1, 69, 0, 7, 128
    rows, state = _rule_inputs(np.random.default_rng(2), cu[-1], len(cu) - 1)
    chunked = chunked_gated_delta_rule(*_mlx(rows), cu, mx.array(state))
    recurrent = recurrent_gated_delta_rule(*_mlx(rows), cu, mx.array(state))
    _close(chunked.out, np.array(recurrent.out))
    _close(chunked.state, np.array(recurrent.state))


def test_prefill_chunks_carrying_state_equal_the_whole():
    pieces = [1, 7, 63, 64, 65, 1, 1, 128]
    total = sum(pieces)
    rows, state = _rule_inputs(np.random.default_rng(3), total, 1)
    whole = gated_delta_rule(*_mlx(rows), [0, total], mx.array(state))
    outs, carried, start = [], mx.array(state), 0
    for n in pieces:
        piece = [mx.array(x[start:start + n]) for x in rows]
        out, carried = gated_delta_rule(*piece, [0, n], carried)
        outs.append(out)
        start += n
    _close(mx.concatenate(outs), np.array(whole.out))
    _close(carried, np.array(whole.state))


def test_packed_batch_equals_each_request_alone():
    lens = [1, 37, 1, 0, 130, 64, 1]
    cu = np.concatenate([[0], np.cumsum(lens)])
    rows, state = _rule_inputs(np.random.default_rng(4), cu[-1], len(lens))
    initial = mx.array(state)
    packed = gated_delta_rule(*_mlx(rows), cu, initial)
    np.testing.assert_array_equal(np.array(initial), state)  # the caller's states stay theirs
    for r, (start, end) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        if start == end:
            _close(packed.state[r], state[r])
            continue
        alone = [x[start:end] for x in rows]
        out, final = _torch_rule(hf.torch_chunk_gated_delta_rule, alone, state[r])
        _close(packed.out[int(start):int(end)], out)
        _close(packed.state[r], final)


def _torch_conv_update(x, weight, state):
    """transformers' cached conv on one request: `x [T, C]`, `state [K - 1, C]`."""
    conv_state = torch.from_numpy(state.T.copy())[None]
    out = hf.causal_conv1d_update(torch.from_numpy(x.T.copy())[None], conv_state,
                                  torch.from_numpy(weight[:, 0]), activation="silu")
    return out[0].T.numpy(), conv_state[0].T.numpy()


@pytest.mark.parametrize("lens", [[1, 2, 0, 9, 1], [1, ONE_TAP_ROWS + 6, 0, 1]])
def test_conv_packed_with_states_matches_transformers(lens):
    rng = np.random.default_rng(5)
    channels, kernel = 12, 4
    cu = np.concatenate([[0], np.cumsum(lens)])
    x = rng.standard_normal((cu[-1], channels), dtype=np.float32)
    weight = rng.standard_normal((channels, 1, kernel), dtype=np.float32)
    states = rng.standard_normal((len(lens), kernel - 1, channels), dtype=np.float32)
    out, new_states = causal_conv1d(mx.array(x), mx.array(weight), cu, mx.array(states))
    for r, (start, end) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        if start == end:
            _close(new_states[r], states[r])
            continue
        expected, expected_state = _torch_conv_update(x[start:end], weight, states[r])
        _close(out[int(start):int(end)], expected)
        _close(new_states[r], expected_state)


def test_conv_chunks_carrying_state_equal_the_whole():
    rng = np.random.default_rng(6)
    channels, kernel, pieces = 10, 4, [1, 2, 7, 1, 13]
    x = rng.standard_normal((sum(pieces), channels), dtype=np.float32)
    weight = rng.standard_normal((channels, 1, kernel), dtype=np.float32)
    whole = hf.causal_conv1d_fn(torch.from_numpy(x.T.copy())[None],
                                torch.from_numpy(weight[:, 0]), activation="silu")
    state, outs, start = mx.zeros((1, kernel - 1, channels)), [], 0
    for n in pieces:
        out, state = causal_conv1d(mx.array(x[start:start + n]), mx.array(weight), [0, n], state)
        outs.append(out)
        start += n
    _close(mx.concatenate(outs), whole[0].T.numpy())
    _close(state[0], x[-(kernel - 1):])


TINY = dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6)


def _randomize(layer: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(torch.randn_like(param) * (0.1 if name == "norm.weight" else 0.5))
        layer.norm.weight += 1.0
    return layer.eval()


def _weights(layer: torch.nn.Module) -> dict[str, mx.array]:
    return {name: mx.array(p.detach().numpy()) for name, p in layer.state_dict().items()}


@pytest.fixture(scope="module")
def layers():
    """(transformers' Qwen3_5GatedDeltaNet with random weights, ours with the same weights)."""
    config = Qwen3_5TextConfig(**TINY)
    theirs = _randomize(hf.Qwen3_5GatedDeltaNet(config, layer_idx=0))
    ours = GatedDeltaNet(GatedDeltaNetConfig.from_hf(config.to_dict()))
    ours.load_weights(list(_weights(theirs).items()))
    return theirs, ours


def _hidden(rng, total: int) -> np.ndarray:
    return rng.standard_normal((total, TINY["hidden_size"]), dtype=np.float32)


def test_layer_matches_transformers(layers):
    theirs, ours = layers
    x = _hidden(np.random.default_rng(7), 90)
    with torch.no_grad():
        expected = theirs(torch.from_numpy(x)[None])[0].numpy()
    out, _, _ = ours(mx.array(x), [0, 90], *ours.zero_states(1))
    _close(out, expected)


def test_layer_split_into_chunks_and_batched_carries_state(layers):
    """Two requests: one prefills in awkward chunks then decodes, packed beside the other."""
    theirs, ours = layers
    rng = np.random.default_rng(8)
    first, second = _hidden(rng, 80), _hidden(rng, 71)
    with torch.no_grad():
        expected = [theirs(torch.from_numpy(x)[None])[0].numpy() for x in (first, second)]
    # Rows each step schedules for (first, second); the second starts one step late.
    steps = [(1, 0), (7, 64), (63, 5), (6, 1), (1, 1), (1, 0), (1, 0)]
    conv, recurrent = ours.zero_states(2)
    outs, done = ([], []), [0, 0]
    for counts in steps:
        scheduled = zip((first, second), done, counts, strict=True)
        x = np.concatenate([seq[d:d + n] for seq, d, n in scheduled])
        cu = np.concatenate([[0], np.cumsum(counts)])
        out, conv, recurrent = ours(mx.array(x), cu, conv, recurrent)
        for r in range(2):
            outs[r].append(np.array(out[int(cu[r]):int(cu[r + 1])]))
            done[r] += counts[r]
    assert done == [80, 71]
    for r in range(2):
        _close(np.concatenate(outs[r]), expected[r])


def test_layer_in_bfloat16_is_as_close_to_float32_as_transformers(layers):
    theirs, ours = layers
    x = _hidden(np.random.default_rng(10), 69)
    with torch.no_grad():
        expected = theirs(torch.from_numpy(x)[None])[0].numpy()
        low_theirs = copy.deepcopy(theirs).to(torch.bfloat16)
        their_low = low_theirs(torch.from_numpy(x)[None].bfloat16())[0].float().numpy()
    low = GatedDeltaNet(ours.cfg)
    low.load_weights([(n, p.astype(mx.bfloat16)) for n, p in tree_flatten(ours.parameters())])
    step = low(mx.array(x).astype(mx.bfloat16), [0, 69], *low.zero_states(1, mx.bfloat16))
    assert step.out.dtype == step.conv_state.dtype == mx.bfloat16
    assert step.recurrent_state.dtype == mx.float32
    ours_error = np.abs(np.array(step.out.astype(mx.float32)) - expected).mean()
    assert ours_error < 1.2 * np.abs(their_low - expected).mean()


def test_qwen3_next_layer_with_unfused_projections_matches_transformers():
    config = Qwen3NextConfig(**TINY)
    theirs = _randomize(Qwen3NextGatedDeltaNet(config, layer_idx=0))
    cfg = GatedDeltaNetConfig.from_hf(config.to_dict())
    ours = GatedDeltaNet(cfg)
    # As conversion splits them, under a layer's path (the split names the owner module).
    split = [part for name, tensor in _weights(theirs).items()
             for part in split_fused(f"layer.{name}", tensor, cfg)]
    ours.load_weights([(name.removeprefix("layer."), tensor) for name, tensor in split])
    x = _hidden(np.random.default_rng(9), 20)
    with torch.no_grad():
        expected = theirs(torch.from_numpy(x)[None])[0].numpy()
    out, _, _ = ours(mx.array(x), [0, 20], *ours.zero_states(1))
    _close(out, expected)
