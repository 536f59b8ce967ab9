"""One switch for fast inference: ``specvit.optimize(model, example_inputs)``.

It measures before it chooses: the candidates (eager; eager with oneDNN pre-packed weights;
``torch.compile(fullgraph=True)`` with and without Inductor freezing; with ``precision='bf16'`` also bf16
eager and compiled) each run once on the example inputs (the warm-up, where compilation happens), their
outputs are compared with eager's (fp32 within 1e-4 max abs; bf16 within 5% of eager's largest output
magnitude), the ones that agree are timed in alternating rounds (each round starting at the next candidate), each
candidate's speedup is the median over the rounds of its ratio to eager in the same round, and the fastest is
kept (eager unless another is ``MARGIN``, 3%, faster: closer than that, the machine's drift decides). Eager is a candidate, so
the result is never slower than eager on the shapes it was measured at: which candidate wins
depends on the machine (Inductor freezing gained on one of this project's CPUs and lost on another) and on
the batch size. ``model.optimize_report`` (or ``verbose=True``) gives the table of candidates, times,
speedups, max abs differences and warm-up seconds.

Without ``example_inputs`` the choice is made on the first call of each input shape, with that call's
arguments, and kept per shape.

The result is for inference only (eval mode, no gradients); call it under ``torch.no_grad()`` or
``torch.inference_mode()``; train, save and convert the original.

The module is ``specvit.inference`` (not ``specvit.optimize``) so that ``specvit.optimize`` stays the
function: importing a submodule named like a package attribute would replace that attribute.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from specvit.tuning import Candidate, OptimizeReport, Precision, choose, default_candidates

__all__ = ["GENERATION_TOKENS", "OptimizeReport", "optimize"]

GENERATION_TOKENS = 16
"""``for_='generation'`` times ``generate(prompt, GENERATION_TOKENS)``: from this many tokens on, ``generate``
packs float32 linears for oneDNN (``specvit.generate.PACK_FROM``), so fp32 eager is timed as it decodes."""

Shapes = tuple[tuple[int, ...], ...]


def _shapes(args: Sequence[Any]) -> Shapes:
    return tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))


def _describe(key: Shapes) -> str:
    return ", ".join("x".join(map(str, k)) for k in key)


class _PerShape(nn.Module):
    """Chooses the fastest candidate on the first call of each input shape (with that call's arguments).

    Args:
        model: the eval copy, the reference.
        select: ``select(args) -> (module, report)``.
        show: show the measuring's progress (None: when standard error is a terminal).
    """

    def __init__(self, model: nn.Module, select: Callable[[tuple[Any, ...]], Any], show: bool | None):
        super().__init__()
        self.model = model
        self.select = select
        self.show = show
        self.chosen: dict[Shapes, nn.Module] = {}
        self.reports: dict[Shapes, OptimizeReport] = {}
        self.optimize_report: OptimizeReport | None = None

    def forward(self, *args: Any) -> Any:
        key = _shapes(args)
        if key not in self.chosen:
            from specvit.progress import stages

            with stages(f"optimize: first call at {_describe(key)}", 1, show=self.show) as step:
                step("measuring the candidates (compiles once per input shape)")
                self.chosen[key], self.reports[key] = self.select(args)
            self.optimize_report = self.reports[key]
        return self.chosen[key](*args)


def optimize(
    model: nn.Module,
    example_inputs: tuple[Any, ...] | None = None,
    for_: Literal["inference", "generation"] = "inference",
    *,
    precision: Precision = "fp32",
    compile: bool = True,
    repeat: int = 5,
    verbose: bool = False,
    progress: bool | None = None,
    candidates: Sequence[Candidate] | None = None,
    timer: Callable[[], float] = time.perf_counter,
) -> nn.Module:
    """The fastest measured way to run ``model`` for inference; the original is left unchanged.

    Args:
        model: a compiled specvit model (any ``nn.Module`` works).
        example_inputs: a tuple of forward arguments to measure with; the choice is made now and the chosen
            module returned (eager: the model's eval copy itself), with ``optimize_report`` attached. None:
            choose on the first call of each input shape instead (``optimize_report`` is the latest one,
            ``reports`` has them by shape).
        for_: what to optimise for: ``inference`` (the forward on ``example_inputs``) or ``generation`` (a
            decoder's ``generate``: ``example_inputs`` is ``(prompt,)``, (B, T0) token ids; each candidate's
            logits on the prompt are checked against eager's and ``generate(prompt, GENERATION_TOKENS)`` is
            timed; the module returned has ``generate``).
        precision: ``fp32`` (every candidate equals eager within 1e-4), ``bf16`` (bf16 candidates join,
            held to 5% of eager's largest output magnitude; chosen only if faster) or ``int8`` (bf16 and
            weight-only int8 candidates join, int8 held to 10%: :mod:`specvit.nn.quant`); for generation the
            bf16 and int8 candidates hold only their linears' weights so, activations in float32.
        compile: include the ``torch.compile(fullgraph=True)`` candidates (each costs a warm-up: compilation).
        repeat: timed rounds (the median speedup over them counts); 1-2 keeps tests cheap.
        verbose: print the report's table to standard error.
        progress: show progress on standard error while measuring (default: when it is a terminal).
        candidates: replace the default candidates (the first must be eager); for tests and experiments.
        timer: the clock used to time candidates.

    Returns:
        A module in eval mode, to call under ``torch.inference_mode()`` or ``torch.no_grad()``.

    Raises:
        ValueError: an unknown ``for_`` or ``precision``; for generation, a model without ``generate`` or
            no ``(prompt,)``.
    """
    if isinstance(example_inputs, str):  # the former signature: optimize(model, "inference")
        example_inputs, for_ = None, example_inputs
    if for_ not in ("inference", "generation"):
        raise ValueError(f"optimize supports for_='inference' or 'generation', not {for_!r}")
    if precision not in ("fp32", "bf16", "int8"):
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'int8', not {precision!r}")
    generation = for_ == "generation"
    if generation:
        _check_generation(model, example_inputs)
    base: nn.Module = copy.deepcopy(model).eval()
    for p in base.parameters():
        p.requires_grad_(False)
    cands = list(candidates) if candidates is not None else default_candidates(precision, compile, generation)
    timed = _generate if generation else None

    def select(args: tuple[Any, ...]) -> tuple[nn.Module, OptimizeReport]:
        chosen, report = choose(base, args, cands, repeat=repeat, timer=timer, timed=timed)
        report.shapes = _describe(_shapes(args))
        if verbose:
            print(report.table(), file=sys.stderr)
        return chosen, report

    if example_inputs is None:
        return _PerShape(base, select, progress)
    if not isinstance(example_inputs, tuple):
        raise TypeError(
            f"example_inputs must be a tuple of forward arguments, got {type(example_inputs).__name__}"
        )
    chosen, report = select(example_inputs)
    chosen.optimize_report = report  # type: ignore[assignment]
    return chosen


def _generate(module: nn.Module, args: Sequence[Any]) -> Any:
    return module.generate(args[0], GENERATION_TOKENS)  # type: ignore[operator]


def _check_generation(model: nn.Module, example_inputs: object) -> None:
    """``for_='generation'`` needs a model with ``generate`` and ``(prompt,)``."""
    if not callable(getattr(model, "generate", None)):
        raise ValueError(
            f"optimize(for_='generation') needs a model with generate (a decoder); {type(model).__name__} "
            "has none: use for_='inference'"
        )
    if not (
        isinstance(example_inputs, tuple)
        and len(example_inputs) == 1
        and isinstance(example_inputs[0], torch.Tensor)
        and example_inputs[0].dim() == 2
        and not example_inputs[0].is_floating_point()
    ):
        raise ValueError(
            "optimize(for_='generation') measures on example_inputs=(prompt,), a (B, T0) tensor of token ids, "
            f"got {type(example_inputs).__name__}"
        )
