"""The Python side of every C entry point matches its C declaration, so the two cannot drift apart.

Each kernel library's sources are expanded by the C preprocessor with the flags they are built with
(so the functions made by macros, one per dtype, are checked like the others). Then every function
a module gave ``argtypes`` must take, in order, arguments of the kinds its C definition declares
and return what it returns; every ``ctypes.Structure`` passed to C must have the fields of its C
struct, in order, of the same kinds. The CUDA launch constants are read from the ``.cu`` source
itself (`cuda_kernels.CU_CONSTANTS`), and are checked here against it.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

from pagedinfer import envs
from pagedinfer.attention import cuda_kernels
from pagedinfer.kernels import abi, build, paged_decode, weight_types
from pagedinfer.kernels.sources import KERNELS_DIR, library_roots, translation_units
from pagedinfer.lora import delta
from pagedinfer.model import decode_step, fused_ops, moe_kernel, packed_linear

LIBRARIES = {  # a module's compiled library, and the root source it is built from
    "paged_decode": (paged_decode._library, paged_decode.SOURCE),
    "fused_ops": (fused_ops._library, fused_ops.SOURCE),
    "fused_ops_sampling": (fused_ops._sampling_library, fused_ops.SAMPLING_SOURCE),
    "packed_linear": (packed_linear._gemm_library, packed_linear.GEMM_SOURCE),
    "decode_step": (decode_step._library, decode_step.SOURCE),
    "lora_delta": (delta.library, delta.SOURCE),
    "moe_kernel": (moe_kernel._library, moe_kernel.SOURCE),
}
STRUCTS = {  # C struct -> its ctypes twin, and the source that declares it
    "refusal": (abi.Refusal, paged_decode.SOURCE),
    "gemm_segment": (packed_linear.GemmSegment, packed_linear.GEMM_SOURCE),
    "step_layer": (decode_step.StepLayer, decode_step.SOURCE),
    "step_meta": (decode_step.StepMeta, decode_step.SOURCE),
    "moe_expert": (moe_kernel.MoeExpert, moe_kernel.SOURCE),
    "moe_shape": (moe_kernel.MoeShape, moe_kernel.SOURCE),
}
_DEFINITION = re.compile(r"(?m)^([A-Za-z_][\w \t*]*?)\b(\w+)\s*\(([^()]*)\)\s*\{")
_CTYPE_KINDS = {
    ctypes.c_void_p: "ptr",
    ctypes.c_int: "i32",
    ctypes.c_int64: "i64",
    ctypes.c_float: "f32",
    ctypes.c_double: "f64",
    ctypes.c_uint: "u32",
}


def c_kind(declaration: str) -> str:
    """The ABI kind of a C parameter, field or return type ('const float *x' -> 'ptr')."""
    if "*" in declaration or "[" in declaration:
        return "ptr"
    words = set(re.findall(r"\w+", declaration))
    for kind, names in (
        ("void", {"void"}),
        ("i64", {"int64_t", "long", "size_t", "ptrdiff_t"}),
        ("u32", {"uint32_t", "unsigned"}),
        ("i32", {"int", "int32_t"}),
        ("f32", {"float"}),
        ("f64", {"double"}),
    ):
        if words & names:
            return kind
    raise AssertionError(f"no ABI kind for {declaration!r}")


def py_kind(t) -> str:
    """The ABI kind of a ctypes type; a nested structure by its C name, an array with its length."""
    if t is None:
        return "void"
    if isinstance(t, type) and issubclass(t, ctypes._Pointer):
        return "ptr"
    if isinstance(t, type) and issubclass(t, ctypes.Array):
        return f"{py_kind(t._type_)}[{t._length_}]"
    if isinstance(t, type) and issubclass(t, ctypes.Structure):
        return next(name for name, (twin, _) in STRUCTS.items() if twin is t)
    return _CTYPE_KINDS[t]


@cache
def expanded(source: Path) -> str:
    compiler = shutil.which(envs.c_compiler())
    flags = [f for f in build.FLAGS if f not in ("-shared", "-fPIC")]
    cmd = [compiler, "-E", "-P", *flags, "-fopenmp", "-I", str(KERNELS_DIR), str(source)]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def definitions(source: Path) -> dict[str, tuple[str, list[str]]]:
    """Every exported (not static) function defined in the library of root ``source`` (each of its
    translation units): name -> (result kind, argument kinds)."""
    found = {}
    text = "".join(expanded(unit) for unit in translation_units(source))
    for result, name, params in _DEFINITION.findall(text):
        if "static" in result or "inline" in result:
            continue
        kinds = [] if params.strip() in ("", "void") else [c_kind(p) for p in params.split(",")]
        found[name] = (c_kind(result), kinds)
    return found


def struct_fields(source: Path, name: str) -> list[tuple[str, str]]:
    """The fields of C struct ``name``: (field, kind), a field of another struct by its name, arrays with their length."""
    body = re.search(r"typedef\s+struct\s*\w*\s*\{([^{}]*)\}\s*" + name + r"\s*;", expanded(source))
    assert body, f"struct {name} not found in {source.name}"
    fields = []
    for declaration in body.group(1).split(";"):
        if not declaration.strip():
            continue
        first, *others = declaration.split(",")
        base, declarator = re.match(r"\s*(.*?)(\**\s*\w+\s*(?:\[\d+\])?)\s*$", first).groups()
        struct = base.strip() if base.strip() in STRUCTS else None  # a pointer to one: "ptr" below
        for one in (declarator, *others):
            stars, field, length = re.match(r"\s*(\**)\s*(\w+)\s*(?:\[(\d+)\])?\s*$", one).groups()
            kind = "ptr" if stars else struct or c_kind(base)
            fields.append((field, kind + (f"[{length}]" if length else "")))
    return fields


def registered(dll: ctypes.CDLL) -> dict[str, object]:
    """The functions of ``dll`` a module declared (``argtypes`` set)."""
    return {n: f for n, f in vars(dll).items() if isinstance(f, dll._FuncPtr) and f.argtypes is not None}


@pytest.mark.parametrize("module", sorted(LIBRARIES))
def test_every_declared_function_matches_its_c_definition(module):
    load, source = LIBRARIES[module]
    dll = load()
    if dll is None:
        pytest.skip("the C kernels are turned off (PAGEDINFER_CPU_KERNEL=0)")
    functions = registered(dll)
    assert functions, f"{module} declares no function"
    defined = definitions(source)
    for name, fn in functions.items():
        assert name in defined, f"{module} declares {name}, which {source.name} does not define"
        result, args = defined[name]
        assert [py_kind(t) for t in fn.argtypes] == args, f"{name}: argtypes differ from {source.name}"
        assert py_kind(fn.restype) == result or (result == "i32" and fn.restype is ctypes.c_int), name


@pytest.mark.parametrize("name", sorted(STRUCTS))
def test_structures_match_their_c_structs(name):
    twin, source = STRUCTS[name]
    python = [(field, py_kind(t)) for field, t in twin._fields_]
    assert python == struct_fields(source, name)


def test_cuda_launch_constants_come_from_the_cu_source():
    text = (KERNELS_DIR / "paged_attention.cu").read_text()
    assert "constexpr int NUM_THREADS = 128;" in text  # the parse below reads these lines
    assert cuda_kernels.CU_CONSTANTS["NUM_THREADS"] == 128
    assert cuda_kernels.CU_CONSTANTS["PREFILL_ROWS"] == (
        cuda_kernels.CU_CONSTANTS["NUM_WARPS"] * cuda_kernels.CU_CONSTANTS["ROWS_PER_WARP"]
    )
    assert set(cuda_kernels.CU_CONSTANTS) >= {"NUM_THREADS", "MAX_GROUP", "PREFILL_ROWS"}


def test_the_check_sees_a_drift():
    """A declaration one argument short, a field of the wrong kind or an array of the wrong length is caught."""
    defined = definitions(fused_ops.SOURCE)
    result, args = defined["silu_mul_f32"]
    assert result == "void" and args[:-1] != args and len(args) == 4

    class Wrong(ctypes.Structure):
        _fields_ = [(f, ctypes.c_int) for f, _ in decode_step.StepLayer._fields_]

    assert [(f, py_kind(t)) for f, t in Wrong._fields_] != struct_fields(decode_step.SOURCE, "step_layer")
    short = [
        (f, packed_linear.GemmSegment * 2 if f == "qkv" else t) for f, t in decode_step.StepLayer._fields_
    ]
    assert [(f, py_kind(t)) for f, t in short] != struct_fields(decode_step.SOURCE, "step_layer")


def test_the_weight_types_header_is_the_one_generated_from_the_table():
    """kernels/cpu_weight_types.h is what `python -m pagedinfer.kernels.weight_types` writes today."""
    assert (KERNELS_DIR / weight_types.HEADER).read_text() == weight_types.c_header()


def test_the_c_enum_and_traits_are_the_tables(tmp_path):
    """Compiled, the C header's enum values and fmt_* traits are the table's, type by type."""
    probe = tmp_path / "probe.c"
    calls = "fmt_group(K_{0}, 128), fmt_super(K_{0}), fmt_super_bytes(K_{0}), fmt_planes(K_{0}), "
    calls += "fmt_direct(K_{0}), fmt_zero(K_{0}), fmt_head_bytes(K_{0}), fmt_has_min(K_{0}, 0), fmt_has_min(K_{0}, 1)"
    lines = [
        f'    printf("{t.name} %d{" %d" * 9}\\n", K_{t.name}, {calls.format(t.name)});'
        for t in weight_types.WEIGHT_TYPES
    ]
    probe.write_text(
        '#include <stdio.h>\n#include "cpu_weight_types.h"\nint main(void) {\n' + "\n".join(lines) + "\n}\n"
    )
    compiler = shutil.which(envs.c_compiler())
    if compiler is None:
        pytest.skip("no C compiler")
    subprocess.run([compiler, "-I", str(KERNELS_DIR), str(probe), "-o", str(tmp_path / "probe")], check=True)
    printed = subprocess.run(
        [tmp_path / "probe"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    expected = []
    for t in weight_types.WEIGHT_TYPES:
        group = 0 if t.group is None else t.group or 128  # 128: the int4 group the probe passes
        minimum = [int(t.has_offset), int(t.has_offset or (t.direct and t.zero > 0))]  # read direct or not
        traits = [
            group,
            t.super_groups,
            t.super_bytes,
            t.planes,
            int(t.direct),
            t.zero,
            t.head_bytes,
            *minimum,
        ]
        expected.append(" ".join(map(str, [t.name, t.id, *traits])))
    assert printed == expected
    assert [t.id for t in weight_types.WEIGHT_TYPES] == list(range(len(weight_types.WEIGHT_TYPES)))
    assert {t.name: t.id for t in weight_types.WEIGHT_TYPES} == packed_linear.KINDS  # what the bindings pass


def test_a_library_is_its_root_and_the_units_whose_headers_it_includes():
    """The loader lists no sources: every cpu_*.c is a library's root, and the decode step's library links
    the GEMM, the chains and the experts' MLP it calls through their headers (not the attention unit it includes)."""
    units = [p.name for p in translation_units(decode_step.SOURCE)]
    assert units == ["cpu_decode_step.c", "cpu_moe.c", "cpu_gemm.c", "cpu_llama_ops.c"]
    assert [p.name for p in translation_units(packed_linear.GEMM_SOURCE)] == ["cpu_gemm.c"]
    roots = {p.name for p in library_roots()}
    assert roots == {p.name for p in KERNELS_DIR.glob("cpu_*.c")}
    assert {s.name for _, s in LIBRARIES.values()} == roots  # each library has its binding checked above
