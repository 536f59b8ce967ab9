"""The folding and tidying under ``specvit eject``, one rule at a time: each on a small source, executed against
the original where it computes something, with the input that shows the rule is needed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from specvit.codegen.functions import specialise_function
from specvit.codegen.lines import split_line
from specvit.codegen.text import _docstring, _summary
from specvit.codegen.tidy import dead_attributes, drop_attributes

ROOT = Path(__file__).resolve().parents[1]

MASK = textwrap.dedent(
    '''
    def visible(causal: bool, window: int | None, cached: int | None, n: int) -> tuple[int | None, str]:
        """The window a query sees, and which branch said so."""
        if cached is not None and causal:
            window = cached if window is None else min(window, cached)
            how = "cache"
        elif causal and window is None:
            how = "causal"
        else:
            how = "window"
        return window, how
    '''
)


def _run(source: str, name: str, *args: Any) -> Any:
    namespace: dict[str, Any] = {}
    exec(compile(source, "<test>", "exec"), namespace)
    return namespace[name](*args)


def test_a_name_a_branch_stores_is_still_its_constant_in_the_elif() -> None:
    """``window`` folds to None in the elif although the if's body stores it (olmo2's ejected mask read it
    unbound there), and the read after the if, which either branch may reach, finds it bound: the folded
    parameter is bound to its value first. The function computes what the original does, in every branch."""
    text = specialise_function(MASK, {"causal": True, "window": None}, {})
    assert "def visible(cached: int | None, n: int)" in text and "window is None" not in text
    assert '    else:\n        how = "causal"' in text  # the elif's test folded to True
    for cached in (None, 4):
        assert _run(text, "visible", cached, 3) == _run(MASK, "visible", True, None, cached, 3)
    assert text.count("    window = None\n") == 1
    with pytest.raises(UnboundLocalError):  # without it, the else's path reads window unbound
        _run(text.replace("    window = None\n", ""), "visible", None, 3)
    inner = MASK.replace("    return window, how", "    return how, how")  # no read after the if
    assert "window = None" not in specialise_function(inner, {"causal": True, "window": None}, {})


def test_isinstance_of_a_folded_constant_folds() -> None:
    source = textwrap.dedent(
        """
        def three(bias: bool | tuple[bool, bool, bool]) -> tuple[bool, bool, bool]:
            if isinstance(bias, bool):
                return (bias, bias, bias)
            q, k, v = bias
            return (q, k, v)
        """
    )
    text = specialise_function(source, {"bias": False}, {})
    assert text.splitlines()[1:] == ["    return (False, False, False)"]
    control = specialise_function(source, {}, {})  # not known: the test stays
    assert "isinstance(bias, bool)" in control and _run(control, "three", (True, False, True)) == (
        True,
        False,
        True,
    )


INIT = textwrap.dedent(
    """
    class Position:
        def __init__(self, dim: int, start: int = 0) -> None:
            self.dim, self.base, self.layout, self.start = dim, 10000.0, "interleaved", start  # all fixed
            self.scale = 2.0

        def forward(self, x: int) -> int:
            return x * self.dim
    """
)


def test_a_parallel_store_loses_only_its_dead_items() -> None:
    dead = dead_attributes([INIT])
    assert dead == {"base", "layout", "start", "scale"}
    text = drop_attributes(INIT, dead)
    assert (
        "        self.dim = dim  # all fixed\n" in text
        and "self.scale" not in text
        and "self.base" not in text
    )
    assert (
        drop_attributes(INIT, {"layout"}).count("self.dim, self.base, self.start = dim, 10000.0, start") == 1
    )
    namespace: dict[str, Any] = {}
    exec(compile(text, "<test>", "exec"), namespace)
    assert namespace["Position"](3).forward(2) == 6


def _ruff_format(text: str, tmp_path: Path) -> str:
    path = tmp_path / "x.py"
    path.write_text(text)
    config = ["--config", str(ROOT / "pyproject.toml")]
    subprocess.run(
        [sys.executable, "-m", "ruff", "format", *config, str(path)], check=True, capture_output=True
    )
    return path.read_text()


@pytest.mark.parametrize(
    "code",
    [
        'self.dim, self.base, self.layout, self.frequencies, self.start = dim, 10000.0, "interleaved", "paper", start',
        "self.first_parameter_name, self.second_parameter_name = first_value_of_some_length, second_value_too",
        "x = torch.nn.functional.scaled_dot_product_attention(query_states, key_states, value_states, mask)",
    ],
    ids=["tuple-value", "two-items", "call"],
)
def test_a_long_line_splits_as_ruff_writes_it(code: str, tmp_path: Path) -> None:
    lines = split_line(code, "    ")
    text = "def f():\n" + "\n".join(lines) + "\n"
    assert _ruff_format(text, tmp_path) == text
    assert len(lines) > 1 or len(code) + 4 <= 110


def test_a_summary_ends_at_a_full_stop_and_keeps_its_literals_whole() -> None:
    doc = (
        "Adds the table of positions ``start + offset .. start + offset + N - 1``.\n\nArgs:\n    dim: width."
    )
    assert _summary(doc) == "Adds the table of positions ``start + offset .. start + offset + N - 1``."
    assert _summary("Reads ``e.g. x`` here. Then more.") == "Reads ``e.g. x`` here."
    long = "Adds the fixed 1D table (:func:`sincos_table`) of the positions ``start + offset .. start + offset + N - 1``"
    text = _docstring(long, "spec: encoder.position, line 11")
    assert "``start + offset .. start + offset + N - 1``" in text.replace("\n    ", " ")
    assert any(line.strip().startswith("``start") for line in text.splitlines())  # moved whole to a line
    assert all(len(line) <= 110 for line in text.splitlines())


def test_a_folded_value_loses_the_parentheses_that_grouped_it() -> None:
    source = (
        "def f(q: int, flag: bool | None) -> tuple[int, int]:\n    return (q if flag is None else 2 * q), q\n"
    )
    text = specialise_function(source, {"flag": None}, {})
    assert text.splitlines()[1] == "    return q, q"
    control = specialise_function(source, {}, {})  # nothing folds: the grouping stays
    assert control.splitlines()[1] == "    return (q if flag is None else 2 * q), q"
    call = "def g(x: int, flag: bool | None) -> int:\n    return abs(x if flag is None else -x)\n"
    assert (
        specialise_function(call, {"flag": None}, {}).splitlines()[1] == "    return abs(x)"
    )  # a call's stay
