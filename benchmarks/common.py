"""What every benchmark section shares: rows, timing, peak memory, the machine's description."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specvit.interop.compat import torchvision_ops

__all__ = [
    "MALLOC_KEEP",
    "NOTES",
    "TARGETS",
    "Row",
    "cpu_info",
    "fmt_time",
    "pair_spread",
    "target",
    "timeit",
    "timeit_pair",
    "timeit_pairs",
]

# transformers and timm import torchvision, whose C++ ops do not load with the CPU-only torch wheel: specvit's
# hook defines the two op schemas its import needs (as in tests/conftest.py; `import specvit` installs it too).
torchvision_ops()

# Timed runs keep freed memory in the process (glibc's malloc otherwise returns every large block to the
# kernel, and the next step page-faults it back in zeroed): page faults took 10-25% of a training step on
# this project's VMs and varied by more than the differences measured. Both sides of every row run with it.
MALLOC_KEEP = {"MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**36)}

NOTES: list[str] = []
TARGETS: list[Callable[[float], str]] = []  # each takes the fp32 GEMM ceiling and returns a verdict line


@dataclass
class Row:
    """One benchmark row: specvit's time, the peer's, what they did, and optionally peak memory (bytes)."""

    section: str
    what: str
    ours: float
    peer: float | None
    peer_name: str
    flops: int | None = None
    ours_mem: int | None = None
    peer_mem: int | None = None

    def ratio(self) -> str:
        return f"{self.ours / self.peer:.2f}" if self.peer else "-"

    def mem(self) -> str:
        if self.ours_mem is None:
            return "-"
        text = f"{self.ours_mem / 2**20:.0f} MiB"
        if self.peer_mem:
            text += f" vs {self.peer_mem / 2**20:.0f} MiB ({self.ours_mem / self.peer_mem:.2f})"
        return text


def target(name: str, met: bool, detail: str) -> None:
    """Record a target of the performance issue with whether this run met it."""
    TARGETS.append(lambda ceiling: f"{'met' if met else 'MISSED'}: {name}: {detail}")


def fmt_time(t: float) -> str:
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.3f} s"


def timeit(fn: Callable[[], object], repeat: int, warmup: int = 1) -> float:
    """Median wall time of ``fn`` over ``repeat`` runs, after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timeit_pairs(
    a: Callable[[], object], b: Callable[[], object], repeat: int
) -> tuple[list[float], list[float]]:
    """The times of ``repeat`` pairs of ``a`` and ``b`` run alternately (one warm-up each), so a drift of the
    machine hits both: (a's times, b's times), pair i at index i."""
    a(), b()
    ta, tb = [], []
    for _ in range(repeat):
        for fn, times in ((a, ta), (b, tb)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return ta, tb


def timeit_pair(a: Callable[[], object], b: Callable[[], object], repeat: int) -> tuple[float, float]:
    """The medians of :func:`timeit_pairs`."""
    ta, tb = timeit_pairs(a, b, repeat)
    return statistics.median(ta), statistics.median(tb)


def pair_spread(ta: list[float], tb: list[float]) -> str:
    """The range of the ratios a/b of pairs run side by side: how far one pair can land from another, the
    noise a ratio of medians near 1.0 is read against."""
    ratios = [x / y for x, y in zip(ta, tb, strict=True)]
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


ISA = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_bf16": "AVX512-BF16",
    "avx512_vnni": "AVX512-VNNI",
    "amx_tile": "AMX",
    "amx_bf16": "AMX-BF16",
    "amx_int8": "AMX-INT8",
    "amx_fp16": "AMX-FP16",
}


def cpu_info(cpuinfo: str | None = None) -> dict[str, str]:
    """The CPU model and its matrix ISA extensions, from /proc/cpuinfo text (read if None).

    Returns:
        ``{"model": ..., "isa": "AVX2, AVX-512, AVX512-BF16, ..." or "none found"}``.
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    model = platform.processor() or platform.machine()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    found = [name for flag, name in ISA.items() if flag in flags]
    return {"model": model, "isa": ", ".join(found) or "none found"}


def environment() -> str:
    """The report's header: CPU model, ISA extensions, torch's CPU capability, threads, versions, GPU."""
    import transformers

    info = cpu_info()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return (
        f"- CPU: {info['model']}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}\n"
        f"- ISA extensions (/proc/cpuinfo): {info['isa']}; torch CPU capability: "
        f"{torch.backends.cpu.get_cpu_capability()}; oneDNN: {torch.backends.mkldnn.is_available()}\n"
        f"- GPU: {gpu}\n"
        f"- python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}"
    )
