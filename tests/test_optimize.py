"""The inference switch measures before it chooses: the fastest candidate whose outputs agree with eager,
never slower than eager, a report of what it tried; the original untouched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import specvit
from specvit import tuning
from specvit.inference import optimize
from specvit.nn.packed import PackedLinear
from specvit.tuning import Candidate, default_candidates, prepack

ROOT = Path(__file__).resolve().parents[1]


def _vit() -> specvit.SpecModel:
    torch.manual_seed(0)
    model = specvit.build_model(
        ROOT / "specs" / "vit_tiny_patch16_224.yaml", overrides={"encoder.depth": 2}
    ).eval()
    torch.nn.init.normal_(model.head.fc.weight, std=0.05)  # type: ignore[union-attr]
    return model


class Clock:
    """A fake timer: the fake candidates advance it by their cost, so timings are exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Costs(nn.Module):
    """Doubles its input, costing ``cost`` fake seconds per call; ``error`` is added to the output."""

    def __init__(self, clock: Clock, cost: float, error: float = 0.0, fail: bool = False) -> None:
        super().__init__()
        self.clock, self.cost, self.error, self.fail = clock, cost, error, fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("cannot compile this")
        self.clock.now += self.cost
        return 2 * x + self.error


def _fake(clock: Clock, **costs: tuple[float, float]) -> list[Candidate]:
    return [Candidate(name, lambda m, c=c, e=e: Costs(clock, c, e)) for name, (c, e) in costs.items()]


def test_the_fastest_candidate_with_right_outputs_is_chosen() -> None:
    clock = Clock()
    cands = _fake(clock, eager=(3.0, 0.0), medium=(2.0, 5e-5), wrong=(1.0, 1e-3))
    cands.append(Candidate("broken", lambda m: Costs(clock, 0.5, fail=True)))
    fast = optimize(Costs(clock, 3.0), (torch.ones(2),), candidates=cands, timer=clock, repeat=3)
    report = fast.optimize_report
    assert isinstance(fast, Costs) and fast.cost == 2.0  # the chosen module is returned itself
    assert report.chosen == "medium" and report.speedup == pytest.approx(1.5)
    rows = {t.name: t for t in report.trials}
    assert rows["eager"].seconds == 3.0 and rows["medium"].seconds == 2.0
    assert (
        rows["medium"].max_abs_diff == pytest.approx(5e-5, rel=1e-2) and rows["medium"].warmup_seconds == 2.0
    )
    assert (
        rows["wrong"].seconds is None
        and rows["wrong"].rejected == "outputs differ from eager by 1.0e-03 > 1.0e-04"
    )
    assert rows["broken"].rejected == "RuntimeError: cannot compile this"
    table = report.table().splitlines()
    assert table[0] == "specvit.optimize at input shapes 2"
    assert table[2].split() == ["eager", "3000.00", "ms", "1.00x", "0.0e+00", "3.00", "s", "slower"]
    assert table[3].split()[:4] == ["medium", "2000.00", "ms", "1.50x"] and table[3].endswith("chosen")
    assert "rejected: outputs differ" in table[4] and "rejected: RuntimeError" in table[5]


@pytest.mark.parametrize(("cost", "chosen"), [(0.98, "eager"), (0.96, "candidate")])
def test_a_candidate_replaces_eager_only_beyond_the_margin(cost: float, chosen: str) -> None:
    clock = Clock()
    cands = _fake(clock, eager=(1.0, 0.0), candidate=(cost, 0.0))
    report = optimize(
        Costs(clock, 1.0), (torch.ones(3),), candidates=cands, timer=clock, repeat=2
    ).optimize_report
    assert tuning.MARGIN == 0.03 and report.chosen == chosen
    verdict = report.table().splitlines()[3]
    assert verdict.endswith("chosen" if chosen == "candidate" else "faster by less than the 3% margin")


class Speeding(Costs):
    """Costs ``cost`` fake seconds times ``rate`` to the power of the calls the machine made before: a machine
    that gets faster while it measures."""

    calls = 0

    def __init__(self, clock: Clock, cost: float, rate: float) -> None:
        super().__init__(clock, cost)
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += self.cost * self.rate**Speeding.calls
        Speeding.calls += 1
        return 2 * x


@pytest.mark.parametrize(("rotate", "chosen"), [(True, "eager"), (False, "same")])
def test_a_machine_speeding_up_does_not_choose_whichever_runs_later(
    rotate: bool, chosen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two equal candidates on a machine 4% faster at each call: eager stays. The control fixes the order of
    the rounds (as ``choose`` did): the candidate called second in every round measures 4% faster."""
    if not rotate:
        monkeypatch.setattr(tuning, "_rounds", lambda names, repeat: [names] * repeat)
    clock = Clock()
    monkeypatch.setattr(Speeding, "calls", 0)
    cands = [Candidate(n, lambda m: Speeding(clock, 1.0, 0.96)) for n in ("eager", "same")]
    fast = optimize(Costs(clock, 1.0), (torch.ones(3),), candidates=cands, timer=clock, repeat=2)
    assert fast.optimize_report.chosen == chosen


def test_without_a_margin_the_fastest_is_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning, "MARGIN", 0.0)  # control: the 2% faster candidate of the test above
    clock = Clock()
    cands = _fake(clock, eager=(1.0, 0.0), candidate=(0.98, 0.0))
    fast = optimize(Costs(clock, 1.0), (torch.ones(3),), candidates=cands, timer=clock, repeat=2)
    assert fast.optimize_report.chosen == "candidate"


def test_eager_is_kept_when_nothing_beats_it() -> None:
    clock = Clock()
    cands = _fake(clock, eager=(1.0, 0.0), slower=(1.5, 0.0))
    fast = optimize(Costs(clock, 1.0), (torch.ones(3),), candidates=cands, timer=clock, repeat=2)
    assert fast.optimize_report.chosen == "eager" and fast.optimize_report.speedup == 1.0
    with pytest.raises(ValueError, match="first candidate must be 'eager'"):
        optimize(Costs(clock, 1.0), (torch.ones(3),), candidates=cands[1:], timer=clock)


def test_without_examples_it_chooses_per_input_shape(capsys: pytest.CaptureFixture[str]) -> None:
    clock = Clock()
    cands = _fake(clock, eager=(1.0, 0.0), fast=(0.5, 0.0))
    fast = optimize(Costs(clock, 1.0), candidates=cands, timer=clock, repeat=1, progress=False, verbose=True)
    for shape in [(2,), (2,), (4, 3)]:
        torch.testing.assert_close(fast(torch.ones(shape)), 2 * torch.ones(shape))
    assert sorted(fast.reports) == [((2,),), ((4, 3),)]  # type: ignore[arg-type]
    assert fast.optimize_report.shapes == "4x3"
    assert capsys.readouterr().err.count("specvit.optimize at input shapes") == 2


def test_compiled_candidates_equal_eager_within_1e4() -> None:
    model = _vit()
    x = torch.randn(2, 3, 224, 224)
    cands = [c for c in default_candidates("fp32", compile=True) if c.name in ("eager", "compile + freezing")]
    fast = optimize(model, (x,), candidates=cands, repeat=1)
    rows = {t.name: t for t in fast.optimize_report.trials}
    assert rows["compile + freezing"].rejected is None
    assert rows["compile + freezing"].max_abs_diff < 1e-4  # 1.4e-6 seen (AMD EPYC)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), model(x), atol=1e-4, rtol=0)
    assert all(p.requires_grad for p in model.parameters())  # the original is left as it was
    assert model.training is False


def test_default_candidates() -> None:
    names = [c.name for c in default_candidates("fp32", compile=True)]
    assert names == ["eager", "eager, oneDNN pre-packed", "compile", "compile + freezing"]
    names = [c.name for c in default_candidates("bf16", compile=False)]
    assert names == ["eager", "eager, oneDNN pre-packed", "bf16"]


def test_prepacked_linears_equal_eager() -> None:
    model = _vit()
    packed = prepack(model)
    assert isinstance(packed.head.fc, PackedLinear) and isinstance(model.head.fc, nn.Linear)  # type: ignore[union-attr]
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert (packed(x) - model(x)).abs().max().item() < 1e-5


def test_bf16_is_close_and_returns_float32() -> None:
    model = _vit()
    bf16 = next(c for c in default_candidates("bf16", compile=False) if c.name == "bf16")
    fast = bf16.build(model)
    x = torch.randn(2, 3, 224, 224)
    with torch.inference_mode():
        got, want = fast(x), model(x)
    assert got.dtype == torch.float32
    assert float((got - want).norm() / want.norm()) < 3e-2  # 7.5e-3 seen (bf16 keeps 8 bits: 3.9e-3 per op)
    assert next(model.parameters()).dtype == torch.float32
    chosen = optimize(model, (x,), precision="bf16", compile=False, repeat=1)
    assert [t.name for t in chosen.optimize_report.trials] == ["eager", "eager, oneDNN pre-packed", "bf16"]
    assert all(t.rejected is None for t in chosen.optimize_report.trials)


def test_token_inputs_stay_integers_in_bf16() -> None:
    torch.manual_seed(0)
    lm = specvit.build_model(
        ROOT / "specs" / "gpt2_small.yaml", overrides={"decoder.depth": 1, "decoder.input.vocab": 100}
    ).eval()
    fast = optimize(lm, precision="bf16", compile=False, repeat=1, progress=False)
    tokens = torch.randint(0, 100, (2, 7))
    with torch.inference_mode():
        assert fast(tokens).shape == (2, 7, 100)
    assert [t.rejected for t in fast.optimize_report.trials] == [None, None, None]  # type: ignore[union-attr]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="for_='inference'"):
        optimize(_vit(), for_="training")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="precision must be"):
        optimize(_vit(), precision="fp8")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="example_inputs must be a tuple"):
        optimize(_vit(), torch.ones(1))  # type: ignore[arg-type]


def test_progress_once_per_input_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib

    import specvit.progress

    shown: list[tuple[str, bool | None]] = []

    @contextlib.contextmanager
    def stages(title: str, total: int, show: bool | None = None):  # type: ignore[no-untyped-def]
        shown.append((title, show))
        yield lambda text: None

    monkeypatch.setattr(specvit.progress, "stages", stages)
    clock = Clock()
    wrapped = optimize(
        Costs(clock, 1.0), candidates=_fake(clock, eager=(1.0, 0.0)), timer=clock, progress=False
    )
    for shape in [(2, 3), (2, 3), (4, 3), (2, 3)]:
        torch.testing.assert_close(wrapped(torch.ones(shape)), 2 * torch.ones(shape))
    assert shown == [("optimize: first call at 2x3", False), ("optimize: first call at 4x3", False)]
