"""The CPU host backend's ops: MLX's CPU backend, with numpy and compiled host loops where its
own ops are slow (cpu_math says why), and the host forward (host_forward.py) that runs whole
layers on numpy arrays. Each op takes numpy arrays (a host layer's) or MLX ones and returns
the kind it gets."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kernels_metal.cpu import attention as cpu_attention
from kernels_metal.cpu import host_forward, huge_pages
from kernels_metal.cpu import loops as cpu_loops
from kernels_metal.cpu import math as cpu_math
from kernels_metal.cpu import prefill as cpu_prefill
from kernels_metal.cpu.host_forward import HostLora, HostPlan, HostStack, to_device, to_host
from kernels_metal.cpu.layer_arrays import views
from kernels_metal.metadata import AttentionMetadata
from kernels_metal.ops import Activation, DispatchedKernels, Ops
from kernels_metal.reference import write_kv

# hidden_act -> act(gate) * up, of numpy or MLX arrays
GATED = {"silu": cpu_math.silu_mul, "gelu_pytorch_tanh": cpu_math.gelu_tanh_mul}


class HostOps(DispatchedKernels, Ops):
    name = "host"
    # One BLAS product per chosen expert: MLX's CPU gather_mm copies the (transposed)
    # stack out before multiplying, about twice as slow at one row (docs/benchmarks.md).
    expert_dispatch = "grouped"
    evaluates_while_building = True  # the numpy fast paths read the forward's arrays

    def __init__(self) -> None:
        self.plan = HostPlan()
        self.stack = HostStack()

    def linear(self, x, layer):
        if isinstance(x, np.ndarray):
            return cpu_math.host_linear(x, *views(layer))
        return cpu_math.linear(x, layer.get("weight"), layer.get("bias"))

    def linears(self, x, packed) -> list:
        if isinstance(x, np.ndarray):  # one product streams the weights faster
            y = self.linear(x, packed)
            return [y[:, columns] for columns in packed.columns]
        return super().linears(x, packed)

    def gated(self, x, packed, act: Activation):
        if isinstance(x, np.ndarray) and act == "silu":
            # gate and up of host rows as one packed product [rows, 2 * inner]
            return cpu_math.silu_mul_halves(self.linear(x, packed))
        return super().gated(x, packed, act)

    def _gate_up(self, x, packed):
        if hasattr(packed, "linears"):
            return self.linears(x, packed)
        y = packed(x)
        return (np if isinstance(y, np.ndarray) else mx).split(y, 2, axis=-1)

    def activation(self, act: Activation, gate, up):
        return GATED[act](gate, up)

    def silu(self, x):
        return x / (1 + cpu_math.exp(-x))

    def exp(self, x):
        return cpu_math.exp(x)

    def softcap(self, x, cap: float):
        return cpu_math.tanh_softcap(x, cap)

    def rms_norm(self, x, weight, eps: float):
        return cpu_math.rms_norm(x, weight, eps)

    def rope_step(self, rope, positions: mx.array, meta: AttentionMetadata):
        return HostRope(rope, positions, meta)

    def rope(self, x, step):
        if isinstance(x, np.ndarray):
            cos, sin = step.host_tables()
            out = np.empty(x.shape, np.float32)
            cpu_loops.rope(x, cos, sin, out)
            return out
        return step.tables(x)

    def attention_without_kernels(self, q, k_pool, v_pool, meta: AttentionMetadata,
                                  scale: float, window=None, softcap=None, sinks=None):
        return cpu_attention.attention_or_reference(q, k_pool, v_pool, meta, scale, window,
                                                    softcap, sinks)

    def chunk_attention(self, q, k, v, scale: float):
        """float32 chunks folded over blocks of their keys by cpu_prefill (BLAS products, a
        compiled softmax: MLX's own costs ~2x here, most of it in its softmax)."""
        if q.dtype != mx.float32:
            return super().chunk_attention(q, k, v, scale)
        heads, rows, _ = q.shape
        keys = k.shape[1]
        # Rows first, as views: each head's keys and values stay contiguous for BLAS.
        q_rows, k_rows, v_rows = (np.asarray(a).transpose(1, 0, 2) for a in (q, k, v))
        out = np.empty((rows, heads, v.shape[-1]), np.float32)
        chunk = cpu_prefill.Chunk(0, rows, keys - rows, np.empty((1, 0), np.int32))
        cpu_prefill.attend(q_rows, k_rows, v_rows, chunk, scale, None, None, None, out)
        return mx.swapaxes(mx.array(out), 0, 1)

    def dense_attention(self, q, k, v, scale: float):
        """float32 rows folded over blocks of their keys by cpu_prefill, every row seeing every
        key: MLX's softmax here computes each exp alone, ~16 ns an element (cpu_math)."""
        if q.dtype != mx.float32:
            return super().dense_attention(q, k, v, scale)
        batch, heads, rows, _ = q.shape
        out = np.empty((batch, rows, heads, v.shape[-1]), np.float32)
        sees_all = cpu_prefill.Chunk(0, rows, 0, np.empty((1, 0), np.int32),
                                     last_keys=np.full(rows, rows - 1))
        for b in range(batch):
            q_rows, k_rows, v_rows = (np.asarray(a[b]).transpose(1, 0, 2) for a in (q, k, v))
            cpu_prefill.attend(q_rows, k_rows, v_rows, sees_all, scale, None, None, None,
                               out[b])
        return mx.array(out).transpose(0, 2, 1, 3)

    def write_kv(self, pool, new, meta: AttentionMetadata):
        if isinstance(new, np.ndarray):  # into the (evaluated) float pool's buffer
            cpu_attention.write_rows(np.asarray(pool), new, meta.slot_mapping)
            return pool
        return write_kv(pool, new, meta)

    def grouped_experts(self, glu, x, experts, weights):
        """The weighted sum over each row's experts, one product per chosen expert over the
        rows that chose it (evaluates on the host)."""
        k = experts.shape[1]
        flat = np.asarray(experts).reshape(-1)
        order = np.argsort(flat, kind="stable")
        starts = np.flatnonzero(np.diff(flat[order], prepend=-1))
        x_host = np.asarray(x.astype(mx.float32))
        pair_weights = np.asarray(weights.astype(mx.float32)).reshape(-1)
        out = np.zeros_like(x_host)
        for pairs in np.split(order, starts[1:]):
            e, rows = int(flat[pairs[0]]), pairs // k
            xe = x_host[rows]
            gate, up = _expert(glu.gate_proj, xe, e), _expert(glu.up_proj, xe, e)
            h = np.asarray(glu.activate(mx.array(gate), mx.array(up)))
            np.add.at(out, rows, _expert(glu.down_proj, h, e) * pair_weights[pairs, None])
        return mx.array(out).astype(x.dtype)

    def run_layers(self, decoder, h, positions: mx.array, meta: AttentionMetadata, cache,
                   layers: range):
        """Each layer on the host or on MLX as the host plan says, all in one compiled call
        where the host stack can take them."""
        modules, pools = decoder.layers, decoder.pools
        on_host = self.plan.layers_on_host(modules, cache)
        lora = HostLora.of(decoder.adapters)
        if lora.active and not lora.served_by_steps(
                [modules[i] for i in layers if on_host[i]], len(h)):
            # Only the compiled layer steps add adapter deltas on the host.
            return super().run_layers(decoder, h, positions, meta, cache, layers)
        ropes = self.layer_ropes(decoder.ropes, positions, meta)
        if all(on_host[i] for i in layers):
            rope = ropes[layers[0]] if layers else None
            shared = rope is not None and all(ropes[i] is rope for i in layers)
            stacked = self.stack.step(to_host(h), [modules[i] for i in layers],
                                      [pools[i] for i in layers],
                                      rope.host_tables() if shared else None, meta, cache,
                                      lora)
            if stacked is not None:
                return to_device(stacked)
        for i in layers:
            if not on_host[i]:
                h = modules[i](to_device(h), ropes[i], meta, cache, pools[i])
                continue
            h = to_host(h)
            stepped = host_forward.layer_step(modules[i], h, ropes[i].host_tables(), meta, cache,
                                              pools[i], lora)
            h = modules[i](h, ropes[i], meta, cache, pools[i]) if stepped is None else stepped
        return to_device(h)

    def parameters_changed(self) -> None:
        self.plan.forget()

    def settle(self, parameters: list[mx.array]) -> None:
        huge_pages.collapse_later(np.asarray(p) for p in parameters if p.dtype == mx.float32)


class HostRope:
    """A step's rope of one kind as MLX tables for MLX layers and numpy `[rows, half]` ones
    for host layers, each built when first asked for."""

    def __init__(self, rope, positions: mx.array, meta: AttentionMetadata) -> None:
        self._rope, self._positions, self._meta = rope, positions, meta
        self._mlx = self._host = None

    def tables(self, x: mx.array) -> mx.array:
        """`x` turned (MLX arrays)."""
        if self._mlx is None:
            from kernels_metal.fast_rope import RotaryTables

            self._mlx = RotaryTables(self._rope, self._positions, self._meta)
        return self._mlx(x)

    def host_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """float32 (cos, sin), each `[total_q, rotary_dim / 2]`."""
        if self._host is None:
            rope = self._rope
            inv_freq = rope.row_frequencies(self._meta)
            inv_freq = rope.inv_freq[None, :] if inv_freq is None else inv_freq
            positions = to_host(self._positions)
            # 3-D (multimodal) positions: each frequency turns by its own axis.
            turned = positions[:, None] if positions.ndim == 1 else positions[rope.mrope_axes].T
            angles = turned.astype(np.float32) * inv_freq
            cos, sin = np.cos(angles), np.sin(angles)
            if rope.scale != 1.0:
                cos, sin = cos * rope.scale, sin * rope.scale
            self._host = (np.ascontiguousarray(cos, np.float32),
                          np.ascontiguousarray(sin, np.float32))
        return self._host


def _expert(linear, x: np.ndarray, e: int) -> np.ndarray:
    """x `[rows, in]` through expert `e` of a (quantized) SwitchLinear alone (float32)."""
    if "scales" not in linear:
        # Index the zero-copy view of the whole stack: an MLX slice would be copied out.
        out = cpu_math.host_linear(x, np.asarray(linear.weight)[e])
        return out if "bias" not in linear else out + np.asarray(linear.bias)[e]
    biases = linear.biases[e] if "biases" in linear else None
    weight = mx.dequantize(linear.weight[e], linear.scales[e], biases, linear.group_size,
                           linear.bits, mode=linear.mode)
    out = cpu_math.host_linear(x, np.asarray(weight.astype(mx.float32)))
    return out if "bias" not in linear else out + np.asarray(linear.bias[e].astype(mx.float32))
