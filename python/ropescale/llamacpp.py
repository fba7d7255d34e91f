"""The llama.cpp adapter: a GGUF file that carries a ropescale table exactly, as llama.cpp reads it (issue 45).

llama.cpp (and Ollama, LM Studio on top of it) reads a model's rope from GGUF metadata. Its CPU kernel
(``ggml/src/ggml-cpu/ops.cpp``, ``ggml_rope_cache_init`` and ``rope_yarn``, llama-cpp-python 0.3.36) computes, for
a position ``p`` and pair ``i``, ``theta_i = p * ts^i`` by a float32 chain (``theta *= ts`` from ``theta = p``,
``ts = powf(freq_base, -2 / n_rot)``), divides it by ``rope_freqs[i]`` where the model has that tensor, multiplies
it by ``freq_scale`` and, for ``rope.scaling.type = yarn`` only, blends it; cos and sin are times
``attn_factor`` (``rope.scaling.attn_factor``, for every type). Under ``rope.scaling.type = none``
(``src/llama-context.cpp``: ``freq_scale = 1``, ``ext_factor = 0``) the angle is ``theta_i / rope_freqs[i]``,
so ``rope_freqs[i] = ts^i / t_i`` makes any static table ``t`` llama.cpp's, with ``ts^i`` the same float32 chain
(from 1) as the kernel's: the difference left is llama.cpp's own rounding of its chain.

:func:`extend` writes that GGUF: the metadata and tensors of the source byte for byte (the quantised ones never
dequantised, as the gguf package's ``gguf_new_metadata`` script copies them), with ``rope.scaling.type = none``,
``rope_freqs.weight``, ``rope.scaling.attn_factor``, ``context_length`` the served length, and ropescale's record
of the method (``ropescale.method``). A LongRoPE with distinct short and long factors is written as llama.cpp's own
``rope.scaling.type = longrope`` with both tables (``rope_factors_short/long.weight``, the same divisors) and
``rope.scaling.original_context_length``: llama.cpp then takes the long table whenever its context size (``-c``)
exceeds the original length, for every prompt, where transformers takes it only for a sequence longer than that (the
same rule as stock vLLM's). Methods llama.cpp cannot run (a table that follows the length, a raw-key
attention) are refused by name before anything is written; the destination is written beside itself and renamed
into place, so it is never left half-written.
"""

from __future__ import annotations

import decimal
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import files, scaling

__all__ = ["ROPE_FREQS", "ROPE_FACTORS_LONG", "ROPE_FACTORS_SHORT", "ARCHITECTURES", "NATIVE_ONLY_ARCHITECTURES",
           "CONVERTER_ENV", "find_converter", "run_converter",
           "from_transformers", "GGUFWritten", "GGUFPlan", "chain", "check_from_transformers", "plan_extend", "powf",
           "theta_scale", "effective_inv_freq", "extend", "rope_freqs_for",
           "read_rope", "rewrite"]

#: The tensor llama.cpp divides each pair's angle by (``LLM_TENSOR_ROPE_FREQS``), float32, ``n_rot / 2`` values.
ROPE_FREQS = "rope_freqs.weight"
#: The GGUF architectures whose llama.cpp model loads ``rope_freqs`` into every layer's rotation (``src/models``:
#: ``create_tensor(tn(LLM_TENSOR_ROPE_FREQS, ...), {n_rot/2}, TENSOR_NOT_REQUIRED)`` and ``get_rope_factors``) and
#: that ropescale's tests run through llama.cpp: another is refused by name.
ARCHITECTURES = ("llama",)
#: GGUF architectures whose llama.cpp model has no ``rope_freqs`` (Qwen 2 and 3, GLM-4: ``src/models/qwen2.cpp``,
#: ``qwen3.cpp``, ``glm4.cpp``): only llama.cpp's own rope types run exactly there, and are written as its keys
#: (:func:`_native`).
NATIVE_ONLY_ARCHITECTURES = ("qwen2", "qwen3", "glm4")
#: LongRoPE's two tables under ``rope.scaling.type = longrope`` (llama arch: ``LLM_TENSOR_ROPE_FACTORS_SHORT/LONG``),
#: divisors as ``rope_freqs``; llama.cpp takes the long one when the context size (``n_ctx`` per sequence, not the
#: prompt's length) exceeds ``rope.scaling.original_context_length``.
ROPE_FACTORS_SHORT = "rope_factors_short.weight"
ROPE_FACTORS_LONG = "rope_factors_long.weight"
#: The key ropescale records the method under (JSON, ``scaling.to_hf`` form with the base).
METHOD_KEY = "ropescale.method"
#: llama.cpp's ``rope.scaling.type`` values (its own names, ``llama_rope_scaling_type``; this table is the one place
#: ropescale spells them): plain RoPE, its linear and YaRN tables, LongRoPE's two tables switched by the context size.
SCALING_TYPES = {"plain": "none", "linear": "linear", "yarn": "yarn", "two_tables": "longrope"}
#: The method each of llama.cpp's own types computes on a model without ``rope_freqs`` (:func:`_native`): that class at
#: its defaults but for the factor and the original length (llama.cpp's yarn: betas 32 and 1, the truncated ramp).
NATIVE_METHODS = {scaling.Linear: SCALING_TYPES["linear"], scaling.YaRN: SCALING_TYPES["yarn"]}


@dataclass(frozen=True)
class GGUFRope:
    """What a GGUF says of its rope (:func:`read_rope`)."""

    architecture: str
    base: float
    rotary_dim: int  # n_rot
    context_length: int
    scaling_type: str  # rope.scaling.type ("linear" when absent, as llama.cpp reads it)
    scaling_factor: float  # rope.scaling.factor (0: absent)
    attn_factor: float  # rope.scaling.attn_factor (1: absent)
    has_rope_freqs: bool  # rope_freqs, or LongRoPE's factor tensors


@dataclass(frozen=True)
class GGUFWritten:
    """What :func:`extend` wrote."""

    path: Path
    rope_freqs: np.ndarray  # the table the written context uses (LongRoPE's long one)
    attn_factor: float
    context_length: int
    copied_tensors: int
    scaling_type: str = SCALING_TYPES["plain"]  # SCALING_TYPES["two_tables"]: LongRoPE's two tables
    tensors: tuple[str, ...] = (ROPE_FREQS,)  # the factor tensors added

    @property
    def two_tables(self) -> bool:
        """Whether llama.cpp switches between two tables by the context size (LongRoPE's)."""
        return self.scaling_type == SCALING_TYPES["two_tables"]


def _import_gguf():
    try:
        import gguf
    except ImportError as err:  # an optional dependency: pip install gguf
        raise ImportError("ropescale.llamacpp needs the gguf package (pip install gguf), which reads and writes "
                          "GGUF files") from err
    return gguf


def gguf_field(reader, key: str, default: Any = None) -> Any:
    """The value of GGUF key ``key`` (``default`` when the file has none)."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


def read_rope(path: str | Path):
    """``(reader, GGUFRope)`` of a GGUF file; a file the gguf package cannot read (truncated, not a GGUF) is a
    ValueError naming it."""
    gguf = _import_gguf()
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        reader = gguf.GGUFReader(path, "r")
    except (ValueError, IndexError, OSError, KeyError) as err:
        raise ValueError(f"{path} is not a GGUF file the gguf package can read (truncated or another format): "
                         f"{err}") from None
    arch = gguf_field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path}: no general.architecture")
    heads = gguf_field(reader, f"{arch}.attention.head_count")
    width = gguf_field(reader, f"{arch}.embedding_length")
    head_dim = gguf_field(reader, f"{arch}.attention.key_length") or (
        width // heads if isinstance(width, int) and isinstance(heads, int) and heads else None)
    rotary_dim = gguf_field(reader, f"{arch}.rope.dimension_count", head_dim)
    context = gguf_field(reader, f"{arch}.context_length")
    if not isinstance(rotary_dim, int) or not isinstance(context, int):
        raise ValueError(f"{path}: architecture {arch!r} has no rope dimension ({arch}.rope.dimension_count) or "
                         f"context length ({arch}.context_length)")
    rope = GGUFRope(arch, float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)), rotary_dim, context,
                    str(gguf_field(reader, f"{arch}.rope.scaling.type", SCALING_TYPES["linear"])),
                    float(gguf_field(reader, f"{arch}.rope.scaling.factor", 0.0) or 0.0),
                    float(gguf_field(reader, f"{arch}.rope.scaling.attn_factor", 1.0)),
                    any(t.name in (ROPE_FREQS, ROPE_FACTORS_SHORT, ROPE_FACTORS_LONG) for t in reader.tensors))
    return reader, rope


def powf(base: float, exponent: float) -> np.float32:
    """C's ``powf`` correctly rounded: ``base ** exponent`` for the float32 ``base`` and ``exponent``, rounded once to
    the nearest float32, the same on every CPU and platform.

    llama.cpp's kernel calls the C library's ``powf``. numpy's float32 ``power`` is not that function: on a CPU where
    numpy dispatches its AVX-512 loops (Intel, AMD Zen 4) ``10000 ** (-1/32)`` is one ulp off (0.74989426 against
    0.7498942), on an AVX2-only CPU it is the C library's, so the factors ropescale wrote followed the CPU that wrote
    them (issue 55). The nearest float32 is what glibc's ``powf`` (2.28 and later) returns but for rare inputs within
    its 0.82-ulp bound (measured, glibc 2.36: 0.07% of random bases and dimensions, none at the common bases, 1e4
    to 1.5e8, and n_rot 64 to 256); it is what every file ropescale writes uses, whatever machine writes it.

    The float64 ``pow`` (any libm's error is far below 2^-40) rounded to float32 is that nearest value unless it lies
    within 2^-40 of a float32 midpoint; there (about one input in 30000) the power is taken in decimal arithmetic at
    60 digits and the nearest of the three candidates picked exactly."""
    b, e = float(np.float32(base)), float(np.float32(exponent))
    if not (math.isfinite(b) and math.isfinite(e) and b > 0):
        raise ValueError(f"powf: the base must be a finite float32 > 0 and the exponent finite, got {base}, "
                         f"{exponent}")
    wide = math.pow(b, e)
    guess = np.float32(wide)
    if not np.isfinite(guess) or guess == 0:
        raise ValueError(f"powf: {base} ** {exponent} is outside float32's normal range")
    neighbours = (np.nextafter(guess, np.float32(0)), np.nextafter(guess, np.float32(np.inf)))
    if all(abs(wide - (float(guess) + float(n)) / 2) > wide * 2.0 ** -40 for n in neighbours):
        return guess
    with decimal.localcontext() as context:
        context.prec = 60
        exact = decimal.Decimal(b) ** decimal.Decimal(e)
        return min((neighbours[0], guess, neighbours[1]), key=lambda c: abs(decimal.Decimal(float(c)) - exact))


def theta_scale(base: float, rotary_dim: int) -> np.float32:
    """llama.cpp's ``theta_scale = powf(freq_base, -2.0f/n_dims)`` (``ggml_compute_forward_rope``): the exponent a
    float32 quotient, the power C's ``powf`` (:func:`powf`)."""
    return powf(base, np.float32(-2.0) / np.float32(rotary_dim))


def chain(base: float, rotary_dim: int) -> np.ndarray:
    """llama.cpp's per-pair frequencies ``ts^i`` as its kernel forms them: ``ts = powf(base, -2 / n_rot)`` and a float32
    product from 1 (``theta *= theta_scale``). Only IEEE float32 products besides :func:`powf`: the same bits on every
    CPU."""
    ts = theta_scale(base, rotary_dim)
    out = np.empty(rotary_dim // 2, dtype=np.float32)
    value = np.float32(1.0)
    for i in range(rotary_dim // 2):
        out[i] = value
        value = np.float32(value * ts)
    return out


def rope_freqs_for(inv_freq: torch.Tensor, base: float, rotary_dim: int) -> np.ndarray:
    """``rope_freqs`` for a table ``inv_freq`` (``n_rot / 2`` frequencies): ``ts^i / t_i`` in float64 from llama.cpp's
    float32 chain, rounded once to float32. A pair the table leaves unrotated (frequency 0) has no factor
    (llama.cpp would divide by it): refused."""
    table = inv_freq.detach().to("cpu", torch.float64).numpy()
    if table.shape != (rotary_dim // 2,):
        raise ValueError(f"rope_freqs_for: the table has {table.shape} frequencies, n_rot {rotary_dim} needs "
                         f"{rotary_dim // 2}")
    if not np.all(np.isfinite(table)) or np.any(table <= 0):
        raise ValueError("llama.cpp divides each angle by its factor: a table with a zero, negative or non-finite "
                         "frequency (a pair left unrotated) has none")
    return (chain(base, rotary_dim).astype(np.float64) / table).astype(np.float32)


def effective_inv_freq(base: float, rotary_dim: int, rope_freqs: np.ndarray | None, position: int) -> np.ndarray:
    """The frequencies llama.cpp's CPU kernel turns position ``position`` by under ``rope.scaling.type = none``:
    its float32 chain from ``position`` divided by the factors, over ``position`` (float64). For tests: the same
    arithmetic as ``ggml_rope_cache_init``."""
    ts = theta_scale(base, rotary_dim)
    theta = np.float32(position)
    out = np.empty(rotary_dim // 2, dtype=np.float64)
    for i in range(rotary_dim // 2):
        ff = np.float32(1.0) if rope_freqs is None else np.float32(rope_freqs[i])
        out[i] = float(np.float32(theta / ff)) / position
        theta = np.float32(theta * ts)
    return out


def _refusal(method: scaling.RopeScaling) -> str | None:
    """Why llama.cpp cannot run ``method`` from one GGUF (None: it can)."""
    name = type(method).__name__ + (" with Resonance" if method.resonance else "")
    if method.dynamic:
        return (f"{name} follows each sequence's length (a table per length, or per request): llama.cpp applies one "
                "static table from the GGUF. Write a static method for the length you serve (--method yarn --factor "
                "s), or serve this one with transformers (ropescale.hf) or vLLM (ropescale.vllm)")
    return None


def _check_destination(dst: Path) -> None:
    """``dst`` is a new file in a writable folder: FileExistsError (never overwritten) or ValueError."""
    if dst.exists() or dst.is_symlink():
        raise FileExistsError(f"{dst} exists: ropescale never overwrites a model (remove it, or pick another name)")
    files.check_new_path(dst, "the GGUF to write")


@dataclass(frozen=True)
class GGUFPlan:
    """What :func:`extend` would write (:func:`plan_extend`): every check made, nothing written."""

    reader: Any  # the source's gguf.GGUFReader
    replaced: dict  # key -> (value, GGUFValueType), as rewrite() takes them
    dropped: frozenset
    tensors: dict  # the factor tensors added (name -> float32 array)
    written: GGUFWritten  # what extend() returns once the file is written


def plan_extend(src: str | Path, dst: str | Path, method: scaling.RopeScaling, *, context_length: int | None = None
                ) -> GGUFPlan:
    """Every check :func:`extend` makes and everything it computes, nothing written (``extend --dry-run`` runs
    this, so that a dry run refuses what the run refuses). Raises ValueError and FileExistsError as extend does."""
    gguf = _import_gguf()
    src, dst = Path(src), Path(dst)
    _check_destination(dst)
    reader, rope = read_rope(src)
    if rope.architecture not in ARCHITECTURES + NATIVE_ONLY_ARCHITECTURES:
        raise ValueError(f"{src}: architecture {rope.architecture!r}: ropescale writes llama.cpp's per-pair rope "
                         f"factors for {', '.join(ARCHITECTURES)} (whose llama.cpp model reads rope_freqs) and "
                         f"llama.cpp's own linear and yarn for {', '.join(NATIVE_ONLY_ARCHITECTURES)} (tested "
                         "through llama.cpp on llama, qwen2 and glm4); not for this one")
    if rope.has_rope_freqs or rope.scaling_type not in (SCALING_TYPES["plain"], SCALING_TYPES["linear"]) \
            or rope.scaling_factor not in (0.0, 1.0) or rope.attn_factor != 1.0:
        raise ValueError(f"{src} already carries a rope scaling (rope.scaling.type {rope.scaling_type!r}, factor "
                         f"{rope.scaling_factor or 'none'}, attn_factor {rope.attn_factor}"
                         f"{', ' + ROPE_FREQS if rope.has_rope_freqs else ''}): extend the model it was scaled from")
    refusal = _refusal(method)
    if refusal is not None:
        raise ValueError(f"llama.cpp cannot run this method: {refusal}")
    method.check_rotary_dim(rope.rotary_dim)
    native = rope.architecture in NATIVE_ONLY_ARCHITECTURES
    if native:
        keys = _native(method, rope.architecture)  # refuses what llama.cpp's own types do not compute
    two_tables = method.two_tables
    if two_tables:  # llama.cpp's own LongRoPE: both tables, switched by the context size (module docstring)
        original_length = int(method.original_max_position)
        tensors = {name: rope_freqs_for(method.inv_freq(rope.rotary_dim, rope.base, seq_len=seq_len,
                                                        dtype=torch.float64), rope.base, rope.rotary_dim)
                   for name, seq_len in ((ROPE_FACTORS_SHORT, original_length), (ROPE_FACTORS_LONG,
                                                                                  original_length + 1))}
        factors = tensors[ROPE_FACTORS_LONG]
    else:
        table = method.inv_freq(rope.rotary_dim, rope.base, dtype=torch.float64)
        factors = rope_freqs_for(table, rope.base, rope.rotary_dim)
        tensors = {ROPE_FREQS: factors}
    attn_factor = float(method.attention_factor)
    if not (math.isfinite(attn_factor) and attn_factor > 0):
        raise ValueError(f"{type(method).__name__}: attention factor {attn_factor} is not a finite number > 0")
    original = int(getattr(method, "original_max_position", None) or rope.context_length)
    length = int(context_length if context_length is not None else
                 round(original * float(getattr(method, "factor", 1.0) or 1.0)))
    if length < 1:
        raise ValueError(f"context_length must be >= 1, got {length}")
    record = json.dumps({"rope_parameters": method.to_hf(rope.base), "context_length": length}, sort_keys=True)

    arch = rope.architecture
    written_type = SCALING_TYPES["two_tables" if two_tables else "plain"]
    replaced = {f"{arch}.rope.scaling.type": (written_type, gguf.GGUFValueType.STRING),
                f"{arch}.rope.scaling.attn_factor": (attn_factor, gguf.GGUFValueType.FLOAT32),
                f"{arch}.context_length": (length, gguf.GGUFValueType.UINT32),
                METHOD_KEY: (record, gguf.GGUFValueType.STRING)}
    if two_tables:  # the length llama.cpp switches at (n_ctx_orig_yarn)
        replaced[f"{arch}.rope.scaling.original_context_length"] = (original, gguf.GGUFValueType.UINT32)
    dropped = {f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear", f"{arch}.rope.scaling.original_context_length",
               f"{arch}.rope.scaling.yarn_beta_fast", f"{arch}.rope.scaling.yarn_beta_slow",
               f"{arch}.rope.scaling.yarn_ext_factor", f"{arch}.rope.scaling.yarn_log_multiplier"}
    if native:  # llama.cpp's own type: its keys, no factor tensor, its own temperature (attn_factor 1)
        dropped.add(f"{arch}.rope.scaling.attn_factor")
        del replaced[f"{arch}.rope.scaling.attn_factor"]
        replaced.update({f"{arch}.{key}": value for key, value in keys.items()})
        tensors = {}
    scaling_type = keys["rope.scaling.type"][0] if native else written_type
    return GGUFPlan(reader, replaced, frozenset(dropped), tensors,
                    GGUFWritten(dst, factors, attn_factor, length, len(reader.tensors), scaling_type, tuple(tensors)))


def extend(src: str | Path, dst: str | Path, method: scaling.RopeScaling, *, context_length: int | None = None,
           progress: bool = False) -> GGUFWritten:
    """Writes ``dst``: the GGUF ``src`` with ``method``'s table as llama.cpp reads it (module docstring).
    ``context_length``: the served length written as ``{arch}.context_length`` (default: the method's length,
    ``factor x`` the source's). Everything is checked (:func:`plan_extend`) before a byte is written; ``dst`` appears
    whole or not at all, with the mode a plain ``open`` gives (0666 less the umask). Raises ValueError (a file, an
    architecture or a method llama.cpp cannot take, a destination that cannot be written) and FileExistsError."""
    plan = plan_extend(src, dst, method, context_length=context_length)
    rewrite(plan.reader, dst, plan.replaced, plan.dropped, plan.tensors, progress=progress)
    return plan.written


def _native(method: scaling.RopeScaling, architecture: str) -> dict[str, tuple[Any, Any]]:
    """llama.cpp's own keys for ``method`` (an architecture with no ``rope_freqs``): a linear table (``type linear``,
    ``freq_scale = 1/s``), or YaRN as llama.cpp computes it (``type yarn``: betas 32 and 1, the truncated ramp, the
    attention factor ``0.1 ln s + 1``). Anything else is refused by name."""
    gguf = _import_gguf()
    llama_type = NATIVE_METHODS.get(type(method))
    lengths = {"original_max_position": method.original_max_position} if hasattr(method, "original_max_position") \
        else {}
    if llama_type is not None and method == type(method)(factor=method.factor, **lengths):
        keys = {"rope.scaling.type": (llama_type, gguf.GGUFValueType.STRING),
                "rope.scaling.factor": (float(method.factor), gguf.GGUFValueType.FLOAT32)}
        if lengths:
            keys["rope.scaling.original_context_length"] = (int(method.original_max_position),
                                                            gguf.GGUFValueType.UINT32)
        return keys
    name = type(method).__name__ + (" with Resonance" if method.resonance else "")
    raise ValueError(f"architecture {architecture!r}: llama.cpp's model has no per-pair rope factors "
                     "(rope_freqs), so only its own rope types run exactly: linear, and yarn with beta_fast 32, "
                     f"beta_slow 1, the truncated ramp and the 0.1 ln s + 1 attention factor. {name} "
                     f"({method.to_hf()}) is not one of them: serve it with transformers (ropescale.hf) or vLLM")


def rewrite(reader, dst: str | Path, replaced: dict[str, tuple[Any, Any]], dropped: set[str] | frozenset = frozenset(),
            added: dict[str, np.ndarray] | None = None, *, progress: bool = False) -> Path:
    """Writes ``dst``: the GGUF ``reader`` reads with the keys ``replaced`` (key -> (value, GGUFValueType)) set,
    ``dropped`` left out and the float32 tensors ``added`` appended; every other key and tensor byte for byte (the
    quantised tensors as they are). Written beside ``dst`` and renamed into place (:func:`files.atomic_file`):
    never half-written, mode 0666 less the umask."""
    gguf = _import_gguf()
    dst = Path(dst)
    added = added or {}
    arch = gguf_field(reader, "general.architecture")
    with files.atomic_file(dst) as part:  # removed on any exception, Ctrl-C included; 0666 less the umask
        writer = gguf.GGUFWriter(part, arch, endianess=reader.endianess)
        alignment = gguf_field(reader, "general.alignment")
        if isinstance(alignment, int):
            writer.data_alignment = alignment
        for field in reader.fields.values():
            if field.name == "general.architecture" or field.name.startswith("GGUF.") or field.name in dropped \
                    or field.name in replaced:
                continue
            kind = field.types[0]
            sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
        for key, (value, kind) in replaced.items():
            writer.add_key_value(key, value, kind)
        for tensor in reader.tensors:
            writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                                   tensor.tensor_type)
        for name, array in added.items():
            writer.add_tensor_info(name, array.shape, array.dtype, array.nbytes)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        tensors = reader.tensors
        if progress:
            from tqdm import tqdm

            tensors = tqdm(tensors, desc=f"writing {dst.name}", unit="tensor")
        for tensor in tensors:
            writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
        for array in added.values():
            writer.write_tensor_data(array)
        writer.close()
    return dst


#: Where :func:`find_converter` looks first: the path of llama.cpp's ``convert_hf_to_gguf.py``.
CONVERTER_ENV = "LLAMA_CPP_CONVERTER"
#: The transformers architectures ``from_transformers`` converts, and the GGUF architecture llama.cpp's converter
#: writes of each (one of ``ARCHITECTURES`` or ``NATIVE_ONLY_ARCHITECTURES``).
TRANSFORMERS_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                              "Glm4ForCausalLM": "glm4"}


def find_converter(given: str | Path | None = None) -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py``: ``given``, else ``$LLAMA_CPP_CONVERTER``, else on the PATH."""
    found = given or os.environ.get(CONVERTER_ENV) or shutil.which("convert_hf_to_gguf.py")
    if not found or not Path(found).is_file():
        raise ValueError(f"llama.cpp's convert_hf_to_gguf.py was not found{f' at {found}' if found else ''}: it "
                         "converts the model and its tokenizer (a llama.cpp checkout has it, or the llama-cpp-python "
                         f"sdist's vendor/llama.cpp); give --converter PATH or set {CONVERTER_ENV}")
    return Path(found)


def run_converter(script: str | Path, src: str | Path, out: str | Path, outtype: str, *, progress: bool = False,
                  launcher: tuple[str, ...] = (), timeout: float | None = None) -> None:
    """Runs llama.cpp's converter ``script`` on the directory ``src``, writing ``out`` (``outtype``), in a Python
    process of its own (``launcher``: what runs the script, ``python -m MODULE`` in place of ``python``; its output
    shown with ``progress``). A converter that fails or does not finish in ``timeout`` seconds is a ValueError with
    its last lines."""
    try:
        run = subprocess.run([sys.executable, *launcher, str(script), str(src), "--outfile", str(out), "--outtype",
                              outtype], capture_output=not progress, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ValueError(f"llama.cpp's converter did not finish on {src} in {timeout:.0f} s") from None
    if run.returncode != 0:
        tail = " | ".join(((run.stderr or "") + (run.stdout or "")).strip().splitlines()[-3:])
        raise ValueError(f"llama.cpp's converter failed on {src} (exit {run.returncode}): {tail}")


def check_from_transformers(src: str | Path, dst: str | Path, method: scaling.RopeScaling, *,
                            converter: str | Path | None = None) -> Path:
    """Every check :func:`from_transformers` makes before the converter runs (``extend DIR DST.gguf --dry-run``
    runs this): ``dst`` new in a writable folder, ``src`` an unscaled directory of a ``TRANSFORMERS_ARCHITECTURES``
    architecture, ``method`` one llama.cpp can run there (its own types only on a ``NATIVE_ONLY_ARCHITECTURES`` one),
    the converter found. Returns the converter's path. What only the converted file tells (its rotary
    dimension) is checked by :func:`extend` once it is written. Raises ValueError and FileExistsError."""
    src, dst = Path(src), Path(dst)
    _check_destination(dst)
    try:
        config = json.loads((src / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{src}: not a transformers model directory with a readable config.json ({err})") from None
    architectures = config.get("architectures") or []
    known = [TRANSFORMERS_ARCHITECTURES[a] for a in architectures if a in TRANSFORMERS_ARCHITECTURES]
    if not known:
        raise ValueError(f"{src}: architecture {architectures}: ropescale converts "
                         f"{', '.join(TRANSFORMERS_ARCHITECTURES)} only (GGUF architectures "
                         f"{', '.join(dict.fromkeys(TRANSFORMERS_ARCHITECTURES.values()))})")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if not scaling.RopeType.parse(rope_type).unscaled or config.get("ropescale") is not None:
        raise ValueError(f"{src} already carries a rope scaling (rope_type {rope_type!r}): convert the model it was "
                         "scaled from (llama.cpp's converter writes only the rope keys it knows), or check a converted "
                         "file with `ropescale verify FILE.gguf --engine llama.cpp --declared-by DIR`")
    refusal = _refusal(method)
    if refusal is not None:
        raise ValueError(f"llama.cpp cannot run this method: {refusal}")
    if known[0] in NATIVE_ONLY_ARCHITECTURES:
        _native(method, known[0])  # llama.cpp's own types only: refused before the converter runs
    return find_converter(converter)


def from_transformers(src: str | Path, dst: str | Path, method: scaling.RopeScaling, *,
                      converter: str | Path | None = None, outtype: str = "f16", context_length: int | None = None,
                      progress: bool = False) -> GGUFWritten:
    """Writes ``dst`` from the transformers directory ``src``: llama.cpp's own converter writes the UNSCALED model
    (weights and tokenizer, ``outtype``) beside ``dst``, then :func:`extend` writes ``method`` into it. ``src`` must
    carry no rope scaling: the converter writes only the rope keys it knows (Resonance, YaRN's betas for llama and
    ropescale's types are lost), so a scaled directory is refused, never converted (:func:`check_from_transformers`,
    before the converter runs). The unscaled intermediate is a private temporary (``tempfile``'s 0600), removed
    whatever happens; ``dst`` gets the umask's mode (:func:`extend`)."""
    src, dst = Path(src), Path(dst)
    script = check_from_transformers(src, dst, method, converter=converter)
    handle, part = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".unscaled.gguf", dir=dst.parent)
    os.close(handle)
    try:
        run_converter(script, src, part, outtype, progress=progress)
        return extend(part, dst, method, context_length=context_length, progress=progress)
    finally:  # Ctrl-C included
        Path(part).unlink(missing_ok=True)
