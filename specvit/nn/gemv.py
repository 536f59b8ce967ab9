"""Products of a few rows with a weight, ``x @ w.T * scale + bias``, at the memory's read rate (decoding).

A decode step multiplies one row per sequence with every weight of the model, so its time is the bytes of
the weights over the rate memory is read at. torch's kernels read them well below that rate on CPU: MKL's
one-row product runs on one thread (42% of a 2-core AMD EPYC's streaming rate), the split product of
:mod:`specvit.nn.packed` reaches 67-80%, bfloat16 ``F.linear`` 60-71% and ``torch._weight_int8pack_mm``
about 35%. ``gemv.c`` next to this file streams each weight row once over torch's OpenMP threads, for
float32, bfloat16 and int8 (per-row scale) weights: 82-97%, 75-94% and 65-77% there over SmolLM-135M's
weight shapes (the decode rows of ``python -m benchmarks`` time whole steps). Where torch's CPU capability is
AVX512 it is built sixteen lanes wide: on a 2-core AVX-512 Xeon, one row reads float32 weights at 95-100% of
the sum's rate (MKL's one-row product 90-96% there), and eight rows run in 27 ms where the AVX2 build took
34-38 ms and MKL 33-35 ms (SmolLM-135M's weights less the head, 15 ms at the read rate).

The kernel is built on first use with the C compiler (``$CC``, else ``gcc`` or ``cc``) into a cache folder
(``$XDG_CACHE_HOME/specvit``, else ``~/.cache/specvit``), named by a hash of its source and flags; about a
second, once per machine. It needs Linux on an x86-64 CPU with AVX2 and FMA (torch's CPU capability AVX2 or
AVX512) and a compiler with OpenMP; anywhere else, or with ``SPECVIT_NATIVE=0``, :func:`available` is False
and the callers keep torch's kernels. Which kernel serves a call is measured once per process by the callers
(:func:`specvit.nn.packed.few_rows_path`).

The same library holds the elementwise steps of a decode layer around its products (:func:`rms_norm`,
:func:`swiglu`, :func:`rope_half`), one call each where torch runs several ops of a few microseconds each
(:mod:`specvit.nn.decoding` runs them while ``generate`` steps), and runs a whole decode step as one program
of these steps (:class:`Op`, :func:`run_program`; :mod:`specvit.nn.program` writes the programs).

Dim legend: M input rows (at most ``MAX_ROWS``), N outputs (the weight's rows), K inputs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "MAX_ROWS",
    "Gemv",
    "Op",
    "available",
    "gemv",
    "op",
    "rms_norm",
    "rope_half",
    "run_program",
    "swiglu",
]

MAX_ROWS = 8
"""The most input rows one call takes (``gemv.c``'s MAX_ROWS): each weight row is multiplied with all of them
while it is in the L1 cache."""

SOURCE = Path(__file__).with_name("gemv.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
"""``-ffp-contract=off``: a product and a sum stay two roundings, as in torch's ops (:func:`rms_norm`,
:func:`rope_half` equal them; the products' fused multiply-adds are written out)."""
AVX512_FLAGS = ("-mavx512f",)
"""Added where torch's CPU capability is AVX512: ``gemv.c`` then runs sixteen lanes wide."""
_KERNELS = {
    torch.float32: "specvit_gemv_f32",
    torch.bfloat16: "specvit_gemv_bf16",
    torch.int8: "specvit_gemv_i8",
}


def _cache_dir() -> Path:
    """Where built kernels are kept: ``$XDG_CACHE_HOME/specvit`` or ``~/.cache/specvit``."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "specvit"


def _unsupported() -> str | None:
    """Why the kernel cannot run here, or None."""
    if os.environ.get("SPECVIT_NATIVE", "1") == "0":
        return "SPECVIT_NATIVE=0"
    if not sys.platform.startswith("linux") or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{sys.platform} {platform.machine()} (needs Linux on x86-64)"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "the CPU has no AVX2"
    return None


def _build() -> Path | None:
    """The kernel's shared library, built into the cache folder if it is not there; None without a compiler
    or when the build fails."""
    source = SOURCE.read_bytes()
    flags = FLAGS + (AVX512_FLAGS if torch.backends.cpu.get_cpu_capability() == "AVX512" else ())
    digest = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    target = _cache_dir() / f"gemv-{digest}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then renamed: never half
            built = Path(tmp) / target.name
            subprocess.run(
                [compiler, *flags, str(SOURCE), "-o", str(built)],
                check=True,
                capture_output=True,
                timeout=300,
            )
            os.replace(built, target)
    except (OSError, subprocess.SubprocessError):
        return None
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot run (see :func:`_unsupported`) or be built."""
    if _unsupported() is not None:
        return None
    path = _build()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))  # its libgomp is torch's, loaded already: one thread pool
    except OSError:
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    arguments: dict[str, list[type]] = {name: [pointer] * 5 + [size] * 3 for name in _KERNELS.values()}
    arguments["specvit_rms_norm_f32"] = [pointer] * 3 + [size] * 2 + [ctypes.c_float] * 2
    arguments["specvit_rope_half_f32"] = [pointer] * 4 + [size] * 6
    arguments["specvit_swiglu_f32"] = [pointer] * 2 + [size] * 2
    arguments["specvit_program"] = [pointer, size, size]
    for name, types in arguments.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = types, None
    return lib


def available() -> bool:
    """Whether :func:`gemv` can run on this machine (builds the kernel on the first call)."""
    return _library() is not None


def _address(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class Gemv:
    """``(x @ weight.T) * scale + bias`` in float32 for a few rows, the weight read once per call.

    It holds the weight (and float32 copies of the scale and bias) and reads the weight's memory at each call:
    updates made in place are seen; a weight replaced by another tensor is not. It holds tensors and the
    kernel's name only, so a module holding one copies, pickles and loads as usual.

    Args:
        weight: (N, K) float32, bfloat16 or int8, contiguous, on the CPU.
        scale: (N,) per-row scale (int8 weights), or None.
        bias: (N,), or None.

    Raises:
        RuntimeError: the kernel is not available here (check :func:`available` first).
        ValueError: a weight it does not take, or a scale or bias of another length.
    """

    def __init__(self, weight: Tensor, scale: Tensor | None = None, bias: Tensor | None = None) -> None:
        if _library() is None:
            raise RuntimeError(
                f"specvit's gemv kernel is not available here: {_unsupported() or 'no C compiler'}"
            )
        if weight.dim() != 2 or weight.dtype not in _KERNELS or not weight.is_contiguous():
            raise ValueError(
                f"gemv takes a contiguous 2-D float32, bfloat16 or int8 weight, got a {weight.dtype} weight of "
                f"shape {list(weight.shape)}"
            )
        if weight.device.type != "cpu":
            raise ValueError("gemv runs on the CPU")
        self.n, self.k = weight.shape
        extras = [None if t is None else t.detach().to(torch.float32).contiguous() for t in (scale, bias)]
        if any(t is not None and t.shape != (self.n,) for t in extras):
            raise ValueError(f"scale and bias must have shape ({self.n},)")
        self.weight, (self.scale, self.bias) = weight.detach(), extras
        self.kernel = _KERNELS[weight.dtype]

    def __call__(self, x: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """(..., K) inputs, at most ``MAX_ROWS`` rows, on the CPU (cast to float32) -> (..., N) ``dtype``
        (summed in float32; a float32 result is not cast: even a cast that returns its tensor costs a
        microsecond, and a decode step makes ~100 calls)."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        m = x.numel() // self.k  # the rows of x viewed as (M, K): no reshape, a decode step makes ~100 calls
        if m > MAX_ROWS or not x.is_cpu or x.shape[-1] != self.k:
            raise ValueError(
                f"gemv takes at most {MAX_ROWS} rows of {self.k} on the CPU, got {list(x.shape)} on {x.device}"
            )
        out = torch.empty((*x.shape[:-1], self.n))  # (..., N)
        kernel = getattr(_library(), self.kernel)
        weight, scale, bias = self.weight.data_ptr(), _address(self.scale), _address(self.bias)
        kernel(x.data_ptr(), weight, scale, bias, out.data_ptr(), m, self.n, self.k)
        return out if dtype == torch.float32 else out.to(dtype)


def gemv(x: Tensor, weight: Tensor, scale: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """``(x @ weight.T) * scale + bias`` in float32, the weight read once: ``Gemv(weight, scale, bias)(x)``.

    Args:
        x: (..., K) floating inputs, at most ``MAX_ROWS`` rows (cast to float32).
        weight: (N, K) float32, bfloat16 or int8, contiguous, on the CPU.
        scale: (N,) per-row scale (int8 weights), or None.
        bias: (N,), or None.

    Returns:
        (..., N) float32.
    """
    return Gemv(weight, scale, bias)(x)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, offset: float = 0.0) -> Tensor:
    """RMSNorm over the last dim, ``x / sqrt(mean(x^2) + eps) * (offset + weight)``, in one call: what
    ``F.rms_norm(x, (D,), offset + weight, eps)`` computes (the sum of squares in another order).

    Args:
        x: (..., D) float32, contiguous, on the CPU.
        weight: (D,) float32, contiguous, or None.
        eps: added to the mean square.
        offset: added to the weight (Gemma's ``1 + w``).

    Returns:
        (..., D) float32.
    """
    lib = _library()
    assert lib is not None, "check available() first"
    y = torch.empty_like(x)  # (..., D)
    d = x.shape[-1]
    w = None if weight is None else weight.data_ptr()
    lib.specvit_rms_norm_f32(x.data_ptr(), w, y.data_ptr(), x.numel() // d, d, eps, offset)
    return y


def swiglu(h: Tensor) -> Tensor:
    """``silu(gate) * value`` of a packed projection ``h = (gate, value)``, in one call with an exp of its own:
    the silu within 3 ulp of the exact value, as torch's is within 2.3 (``gemv.c``).

    Args:
        h: (..., 2F) float32, contiguous, on the CPU: the gate's F channels, then the value's.

    Returns:
        (..., F) float32.
    """
    lib = _library()
    assert lib is not None, "check available() first"
    f = h.shape[-1] // 2
    out = h.new_empty((*h.shape[:-1], f))  # (..., F)
    lib.specvit_swiglu_f32(h.data_ptr(), out.data_ptr(), h.numel() // (2 * f), f)
    return out


def rope_half(t: Tensor, cos: Tensor, sin: Tensor, heads: int, head_dim: int) -> Tensor:
    """A copy of the packed projection t with the first ``heads`` heads rotated by rotate-half RoPE, in one
    call: equal to :func:`~specvit.nn.position.apply_rope` on those heads.

    Args:
        t: (..., L, width) float32, contiguous, on the CPU: heads of ``head_dim`` from channel 0 on.
        cos: (L, r) float32 contiguous table, r even and at most ``head_dim``: the first r channels rotate.
        sin: the same for the sines.
        heads: the heads rotated (queries and keys).
        head_dim: hd.

    Returns:
        (..., L, width) float32.
    """
    lib = _library()
    assert lib is not None, "check available() first"
    out = torch.empty_like(t)  # (..., L, width)
    (length, r), width = cos.shape, t.shape[-1]
    rows = t.numel() // width
    lib.specvit_rope_half_f32(
        t.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), rows, length, width, heads, head_dim, r
    )
    return out


OPS = ("embed", "norm", "gemv", "add", "glu", "attend", "act", "position")
"""The ops of a program, by their code in ``gemv.c`` (its ``OP_`` enum, which says what each reads)."""
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
"""A product's weight type, by its code in ``gemv.c``."""


class Op(ctypes.Structure):
    """One op of a native program: ``gemv.c``'s ``Op``, its code, sizes, floats and buffers."""

    _fields_ = [
        ("code", ctypes.c_int64),
        ("n", ctypes.c_int64 * 8),
        ("f", ctypes.c_float * 2),
        ("p", ctypes.c_void_p * 8),
    ]


def op(name: str, buffers: list[Tensor | None], sizes: list[int], floats: tuple[float, ...] = ()) -> Op:
    """The op ``name`` of :data:`OPS` over ``buffers`` (contiguous CPU tensors, None for a NULL pointer; the
    caller keeps them alive while a program holds their addresses), with its sizes and floats."""
    return Op(OPS.index(name), (ctypes.c_int64 * 8)(*sizes), (ctypes.c_float * 2)(*floats),
              (ctypes.c_void_p * 8)(*(_address(b) for b in buffers)))  # fmt: skip


def run_program(ops: ctypes.Array[Op], position: int) -> None:
    """Run ``ops`` in order, the step's token at ``position`` (its keys and values written there).

    Args:
        ops: the program (:func:`op`).
        position: the absolute position of the step's tokens.
    """
    lib = _library()
    assert lib is not None, "check available() first"
    lib.specvit_program(ops, len(ops), position)
