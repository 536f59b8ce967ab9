"""The measurement behind ``specvit.optimize``: candidate ways to run a model, checked and timed here.

Each candidate builds a module from the model's eval copy. :func:`choose` runs every candidate once to warm
it up (compilation happens then), compares its outputs with eager's, times the ones that agree in alternating
rounds (median per candidate) and keeps the fastest. Eager is always a candidate, so the choice is never
slower than eager on the inputs it was measured with.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from specvit.nn.packed import pack_linears
from specvit.nn.quant import quantize_int8, weight_only

__all__ = [
    "Candidate",
    "OptimizeReport",
    "Trial",
    "WithoutOneDnn",
    "bf16_weights",
    "choose",
    "default_candidates",
    "int8_weights",
    "prepack",
]

FP32_ATOL = 1e-4
"""fp32 candidates must match eager within this max abs difference."""
BF16_RTOL = 5e-2
"""bf16 candidates must match eager within this fraction of eager's largest output magnitude: bf16 keeps 8
mantissa bits (3.9e-3 relative per rounding), and a deep model accumulates a few percent of its output scale."""
INT8_RTOL = 1e-1
"""int8-weight candidates (bf16 activations) must match eager within this fraction of eager's largest output
magnitude: per-channel int8 rounds each weight by up to half a step of max|row| / 127 (0.4% of the row's
largest weight), about bf16's relative rounding for the row's large weights but coarser for its small ones."""

Precision = Literal["fp32", "bf16", "int8"]

MARGIN = 0.03
"""How much faster than eager a candidate must measure to be chosen over it. Closer than that, the machine's
drift between the alternating rounds decides: on a 2-core VM ``torch.compile`` measured 1.01x eager, was
chosen, and re-timed at 0.98x. Eager then stays: no compilation, no recompiles."""


@dataclass(frozen=True)
class Candidate:
    """One way to run the model.

    Args:
        name: shown in the report.
        build: makes the runnable module from the model's eval copy (may share its parameters).
        precision: ``fp32`` candidates are held to ``FP32_ATOL``, ``bf16`` ones to ``BF16_RTOL``, ``int8``
            ones to ``INT8_RTOL``.
    """

    name: str
    build: Callable[[nn.Module], nn.Module]
    precision: Precision = "fp32"


@dataclass
class Trial:
    """What one candidate measured: median seconds per call, its speedup over eager (the median over the rounds
    of eager's time over its own in the same round), first-call seconds, max abs diff vs eager."""

    name: str
    seconds: float | None = None
    speedup: float | None = None
    warmup_seconds: float | None = None
    max_abs_diff: float | None = None
    rejected: str | None = None  # why it was not eligible (wrong outputs, an error)


@dataclass
class OptimizeReport:
    """The candidates tried, their measurements and the one chosen."""

    trials: list[Trial]
    chosen: str
    shapes: str = ""
    modules: dict[str, nn.Module] = field(default_factory=dict, repr=False)

    @property
    def speedup(self) -> float:
        """The chosen candidate's speedup over eager (:class:`Trial`'s; >= 1.0, eager's is 1.0)."""
        chosen = next(t for t in self.trials if t.name == self.chosen)
        assert chosen.speedup is not None
        return chosen.speedup

    def table(self) -> str:
        """A text table: candidate, median time, speedup over eager, max abs diff, warm-up, verdict."""
        head = f"{'candidate':<28} {'time':>10} {'speedup':>8} {'max abs diff':>13} {'warm-up':>9}  verdict"
        lines = [
            f"specvit.optimize at input shapes {self.shapes}" if self.shapes else "specvit.optimize",
            head,
        ]
        for t in self.trials:
            time_s = f"{t.seconds * 1e3:.2f} ms" if t.seconds is not None else "-"
            speed = f"{t.speedup:.2f}x" if t.speedup else "-"
            diff = f"{t.max_abs_diff:.1e}" if t.max_abs_diff is not None else "-"
            warm = f"{t.warmup_seconds:.2f} s" if t.warmup_seconds is not None else "-"
            lines.append(f"{t.name:<28} {time_s:>10} {speed:>8} {diff:>13} {warm:>9}  {self._verdict(t)}")
        return "\n".join(lines)

    def _verdict(self, t: Trial) -> str:
        """Chosen, rejected (why), faster than eager by less than the margin (eager kept), or slower."""
        if t.name == self.chosen:
            return "chosen"
        if t.rejected:
            return f"rejected: {t.rejected}"
        if self.chosen == "eager" and t.speedup and t.speedup > 1.0:
            return f"faster by less than the {MARGIN:.0%} margin"
        return "slower"

    def __str__(self) -> str:
        return self.table()


class Cast(nn.Module):
    """Runs ``model`` in ``dtype``: floating inputs are cast to it, floating outputs back to float32.

    Args:
        model: the model, already in ``dtype``.
        dtype: the compute dtype.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model = model
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        def cast(v: Any) -> Any:
            return v.to(self.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v

        out = self.model(*(cast(a) for a in args), **{k: cast(v) for k, v in kwargs.items()})
        return out.float() if isinstance(out, torch.Tensor) and out.is_floating_point() else out

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``generate``: it decodes from the weights in ``dtype`` (token ids in and out).

        Args:
            args: ``generate``'s positional arguments.
            kwargs: its keyword arguments.
        """
        return self.model.generate(*args, **kwargs)  # type: ignore[operator]


def prepack(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every fp32 ``nn.Linear`` replaced by a :class:`PackedLinear`."""
    packed = copy.deepcopy(model)
    pack_linears(packed)
    return packed


def _compiled(freezing: bool) -> Callable[[nn.Module], nn.Module]:
    def build(model: nn.Module) -> nn.Module:
        options: dict[str, str | int | bool | Callable[..., Any]] | None = (
            {"freezing": True} if freezing else None
        )
        return torch.compile(model, fullgraph=True, options=options)  # type: ignore[return-value]

    return build


class WithoutOneDnn(nn.Module):
    """Runs ``model`` (its forward and ``generate``) with oneDNN disabled: float32 linears go to MKL as stored,
    and ``generate`` packs none. Which is faster for one-token steps depends on the CPU: oneDNN's pre-packed
    weights were 1.6-2x faster on an AVX-512 EPYC, and measured slower than MKL on an AVX2 one.

    Args:
        model: the model.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.backends.mkldnn.flags(enabled=False):
            return self.model(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's ``generate`` with oneDNN disabled.

        Args:
            args: ``generate``'s positional arguments.
            kwargs: its keyword arguments.
        """
        with torch.backends.mkldnn.flags(enabled=False):
            return self.model.generate(*args, **kwargs)  # type: ignore[operator]


def bf16_weights(model: nn.Module) -> nn.Module:
    """A bf16 copy of ``model`` that takes and returns float32 (:class:`Cast`)."""
    return Cast(copy.deepcopy(model).to(torch.bfloat16), torch.bfloat16)


def int8_weights(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose linear layers hold weight-only int8 (:mod:`specvit.nn.quant`) and whose
    activations and other weights are bf16, taking and returning float32 (:class:`Cast`)."""
    return Cast(quantize_int8(copy.deepcopy(model)).to(torch.bfloat16), torch.bfloat16)


def bf16_weights_only(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose linear layers hold bfloat16 weights, activations in float32
    (:func:`specvit.nn.quant.weight_only`)."""
    return weight_only(copy.deepcopy(model), torch.bfloat16)


def int8_weights_only(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose linear layers hold weight-only int8 with per-row scales, activations in
    float32 (:func:`specvit.nn.quant.weight_only`)."""
    return weight_only(copy.deepcopy(model), torch.int8)


def default_candidates(precision: Precision, compile: bool, generation: bool = False) -> list[Candidate]:
    """Eager, oneDNN pre-packed weights, and with ``compile`` Inductor (fullgraph) with and without freezing
    (freezing folds the weights into the graph as constants and pre-packs them for oneDNN); with
    ``precision='bf16'`` also the bf16 casts of eager and of compiled Inductor; with ``'int8'`` also
    weight-only int8 and bf16 eager. ``generation``: the candidates ``generate`` runs well: eager (which packs
    its linears for oneDNN while decoding), eager with oneDNN off (MKL's products) and the smaller weights with
    float32 activations (a decode step's time is its weights' bytes; bf16 arithmetic on a CPU without it only
    adds conversions), no compilation (each new length would recompile)."""
    found = [Candidate("eager", lambda m: m)]
    if torch.backends.mkldnn.is_available() and not generation:
        found.append(Candidate("eager, oneDNN pre-packed", prepack))
    if torch.backends.mkldnn.is_available() and generation:
        found.append(Candidate("eager, MKL linears (no oneDNN)", WithoutOneDnn))
    compile = compile and not generation
    if compile:
        found += [Candidate("compile", _compiled(False)), Candidate("compile + freezing", _compiled(True))]
    if generation:
        if precision in ("bf16", "int8"):
            found.append(Candidate("bf16 weights", bf16_weights_only, "bf16"))
        if precision == "int8":
            found.append(Candidate("int8 weights", int8_weights_only, "int8"))
        return found
    if precision in ("bf16", "int8"):
        found.append(Candidate("bf16", bf16_weights, "bf16"))
        if compile and precision == "bf16":
            found.append(Candidate("bf16, compile", lambda m: _compiled(False)(bf16_weights(m)), "bf16"))
    if precision == "int8":
        found.append(Candidate("int8 weights, bf16", int8_weights, "int8"))
    return found


def _max_abs_diff(got: Any, want: Any) -> float:
    """Largest abs difference over the floating tensors of two outputs (inf when their structure differs)."""
    a, b = tree_leaves(got), tree_leaves(want)
    if len(a) != len(b):
        return float("inf")
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if isinstance(y, torch.Tensor):
            if not isinstance(x, torch.Tensor) or x.shape != y.shape:
                return float("inf")
            if y.is_floating_point():
                worst = max(worst, (x.double() - y.double()).abs().max().item() if y.numel() else 0.0)
            elif not torch.equal(x, y):
                return float("inf")
    return worst


def _scale(out: Any) -> float:
    leaves = [
        t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
    ]
    return max((t.abs().max().item() for t in leaves), default=0.0)


def choose(
    model: nn.Module,
    args: Sequence[Any],
    candidates: Sequence[Candidate],
    *,
    repeat: int = 5,
    timer: Callable[[], float] = time.perf_counter,
    timed: Callable[[nn.Module, Sequence[Any]], Any] | None = None,
) -> tuple[nn.Module, OptimizeReport]:
    """Check and time ``candidates`` on ``model(*args)``; return the fastest one that agrees with eager, eager
    itself unless it is at least ``MARGIN`` faster.

    Args:
        model: the eval-mode model; eager (``candidates`` named ``eager``) is its reference.
        args: forward arguments.
        candidates: the ways to try; the first must be ``eager``.
        repeat: timed rounds after the warm-up; each round calls every eligible candidate once, starting at
            the next one each round, and each candidate's speedup is the median over the rounds of eager's time
            over its own in the same round, so a drift of the machine's speed hits both alike.
        timer: the clock (seconds).
        timed: what is timed, ``timed(module, args)``, once more in the warm-up; None: ``module(*args)``.
            The outputs compared are always ``module(*args)``'s.

    Returns:
        The chosen module and the report.
    """
    if not candidates or candidates[0].name != "eager":
        raise ValueError("the first candidate must be 'eager', the reference")
    with torch.no_grad():
        reference = model(*args)
        scale = _scale(reference)
        trials, runners = _warm_up(model, args, candidates, reference, scale, timer)
        run = timed or (lambda module, a: module(*a))
        if timed is not None:
            for runner in runners.values():
                run(runner, args)
        times: dict[str, list[float]] = {name: [] for name in runners}
        for order in _rounds(list(runners), max(1, repeat)):
            for name in order:
                start = timer()
                run(runners[name], args)
                times[name].append(timer() - start)
    for t in trials:
        if t.name in times:
            t.seconds = statistics.median(times[t.name])
            t.speedup = statistics.median(e / s for e, s in zip(times["eager"], times[t.name], strict=True))
    chosen = max((t for t in trials if t.speedup is not None), key=lambda t: t.speedup or 0.0)
    if (chosen.speedup or 0.0) < 1 / (1 - MARGIN):
        chosen = next(t for t in trials if t.name == "eager")  # within the margin: the machine's drift
    return runners[chosen.name], OptimizeReport(trials, chosen.name, modules=runners)


def _rounds(names: list[str], repeat: int) -> list[list[str]]:
    """The order of the candidates in each timed round: each round starts one later, so no candidate always
    runs right after the same one, nor always first or last while the machine speeds up or slows down."""
    return [names[r % len(names) :] + names[: r % len(names)] for r in range(repeat)]


def _warm_up(
    model: nn.Module,
    args: Sequence[Any],
    candidates: Sequence[Candidate],
    reference: Any,
    scale: float,
    timer: Callable[[], float],
) -> tuple[list[Trial], dict[str, nn.Module]]:
    """Build and call each candidate once (its warm-up), keeping those whose outputs match the reference."""
    trials, runners = [], {}
    for cand in candidates:
        trial = Trial(cand.name)
        trials.append(trial)
        start = timer()
        try:
            runner = cand.build(model)
            out = runner(*args)
        except Exception as error:  # a candidate this machine or model cannot run is not chosen
            trial.rejected = (
                f"{type(error).__name__}: {str(error).splitlines()[0][:80] if str(error) else ''}"
            )
            continue
        trial.warmup_seconds = timer() - start
        trial.max_abs_diff = _max_abs_diff(out, reference)
        rtol = {"bf16": BF16_RTOL, "int8": INT8_RTOL}.get(cand.precision)
        bound = FP32_ATOL if rtol is None else rtol * max(scale, 1e-30)
        if not trial.max_abs_diff <= bound:
            trial.rejected = f"outputs differ from eager by {trial.max_abs_diff:.1e} > {bound:.1e}"
            continue
        runners[cand.name] = runner
    if "eager" not in runners:
        raise RuntimeError("eager, the reference, did not run: " + str(trials[0].rejected))
    return trials, runners
