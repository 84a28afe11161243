"""The kernel source `mx.fast.metal_kernel` builds around a body, character for character.

Mirrors `write_signature`, `write_template` and the kernel naming in MLX 0.32
(`mlx/backend/common/metal_kernel.cpp`), including its quirks: input shape/stride/ndim
buffers are bound only when the body mentions `x_shape`/`x_strides`/`x_ndim`, inputs with
fewer than 8 elements live in the `constant` address space, scalars bind by reference, and a
thread attribute becomes a parameter when its name occurs anywhere in the body.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

# Inputs with fewer elements are passed in the constant address space.
MAX_CONSTANT_ARRAY_SIZE = 8

# (attribute, type), in MLX's order.
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

_TYPE_STRINGS = {
    mx.float32: "float",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float64: "double",
    mx.complex64: "complex64_t",
    mx.bool_: "bool",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
}

TemplateValue = int | bool | mx.Dtype


def type_string(dtype: mx.Dtype) -> str:
    return _TYPE_STRINGS[dtype]


@dataclass(frozen=True)
class InputSpec:
    """What the generated source depends on for one input."""

    name: str
    dtype: mx.Dtype
    ndim: int
    size: int

    @property
    def in_constant_space(self) -> bool:
        return self.size < MAX_CONSTANT_ARRAY_SIZE


@dataclass(frozen=True)
class Parameter:
    """One kernel parameter in binding order: a buffer (input, its shape info, output) or an
    attribute. `kind` is 'input', 'shape', 'strides', 'ndim', 'output' or 'attribute'."""

    kind: str
    name: str
    ctype: str
    by_reference: bool = False
    input_index: int = -1


@dataclass(frozen=True)
class GeneratedKernel:
    name: str  # host name of the kernel function
    source: str  # exactly what MLX compiles after its utils preamble
    parameters: tuple[Parameter, ...]
    template_def: str  # e.g. "<float, 64>", "" when not a template


def shape_infos(input_names: list[str], body: str) -> list[tuple[bool, bool, bool]]:
    return [(f"{n}_shape" in body, f"{n}_strides" in body, f"{n}_ndim" in body)
            for n in input_names]


def attributes_in(body: str) -> list[tuple[str, str]]:
    return [(attr, ctype) for attr, ctype in METAL_ATTRIBUTES if attr in body]


def write_template(template: list[tuple[str, TemplateValue]]) -> str:
    parts = []
    for _, value in template:
        if isinstance(value, bool):
            parts.append("1" if value else "0")  # std::ostream << bool
        elif isinstance(value, int):
            parts.append(str(value))
        else:
            parts.append(type_string(value))
    return "<" + ", ".join(parts) + ">"


def _template_param_type(value: TemplateValue) -> str:
    if isinstance(value, bool):
        return "bool"
    return "int" if isinstance(value, int) else "typename"


def make_template_hash(template_def: str) -> str:
    out, i = [], 0
    while i < len(template_def):
        c = template_def[i]
        if c in "<>":
            out.append("_")
        elif c == "," and i + 1 < len(template_def) and template_def[i + 1] == " ":
            out.append("_")
            i += 1
        else:
            out.append(c)
        i += 1
    return "".join(out)[:-1]


def kernel_name(
    name: str, inputs: list[InputSpec], output_dtypes: list[mx.Dtype],
    template: list[tuple[str, TemplateValue]],
) -> str:
    result = "custom_kernel_" + name
    if template:
        result += "_" + make_template_hash(write_template(template))
    for spec in inputs:
        result += "_" + type_string(spec.dtype)
        if spec.ndim == 0:
            result += "s"
        elif spec.in_constant_space:
            result += "c"
    for dtype in output_dtypes:
        result += "_" + type_string(dtype)
    return result


def generate(
    name: str, input_names: list[str], output_names: list[str], body: str, header: str,
    inputs: list[InputSpec], output_dtypes: list[mx.Dtype],
    template: list[tuple[str, TemplateValue]] | None = None, atomic_outputs: bool = False,
) -> GeneratedKernel:
    """The full kernel source MLX would compile for this call, and its parameter list."""
    template = list(template or [])
    func = kernel_name(name, inputs, output_dtypes, template)
    infos = shape_infos(input_names, body)
    attributes = attributes_in(body)
    src = [header]
    if template:
        params = ", ".join(f"{_template_param_type(v)} {n}" for n, v in template)
        src.append(f"template <{params}>\n")
    src.append(f"[[kernel]] void {func}(\n")
    parameters: list[Parameter] = []
    index = 0
    for i, spec in enumerate(inputs):
        location = "constant" if spec.in_constant_space else "device"
        ref = "&" if spec.ndim == 0 else "*"
        ctype = type_string(spec.dtype)
        src.append(f"  const {location} {ctype}{ref} {spec.name} [[buffer({index})]],\n")
        parameters.append(Parameter("input", spec.name, ctype, spec.ndim == 0, i))
        index += 1
        if spec.ndim > 0:
            for used, suffix, stype, by_ref in (
                (infos[i][0], "shape", "int", False),
                (infos[i][1], "strides", "int64_t", False),
                (infos[i][2], "ndim", "int", True),
            ):
                if used:
                    decl = f"const constant {stype}{'&' if by_ref else '*'}"
                    src.append(f"  {decl} {spec.name}_{suffix} [[buffer({index})]],\n")
                    parameters.append(Parameter(suffix, f"{spec.name}_{suffix}", stype, by_ref, i))
                    index += 1
    for out_name, dtype in zip(output_names, output_dtypes, strict=True):
        ctype = type_string(dtype)
        shown = f"atomic<{ctype}>" if atomic_outputs else ctype
        src.append(f"  device {shown}* {out_name} [[buffer({index})]]")
        # MLX compares the buffer index (which counts shape buffers) with inputs + outputs.
        if index < len(inputs) + len(output_names) - 1 or attributes:
            src.append(",\n")
        else:
            src.append(") {\n")
        parameters.append(Parameter("output", out_name, ctype))
        index += 1
    for k, (attr, ctype) in enumerate(attributes):
        src.append(f"  {ctype} {attr} [[{attr}]]")
        src.append(",\n" if k < len(attributes) - 1 else ") {\n")
        parameters.append(Parameter("attribute", attr, ctype))
    src.append(body)
    src.append("\n}\n")
    template_def = write_template(template) if template else ""
    if template:
        full = func + template_def
        src.append(
            f'\ntemplate [[host_name("{func}")]] [[kernel]] decltype({full}) {full};\n'
        )
    return GeneratedKernel(func, "".join(src), tuple(parameters), template_def)
