"""How specvit prints its figures: one format for every count, and units that say what they count.

- :func:`format_count`: counts of anything measured in SI prefixes (FLOPs, bytes): ``148.4K``, ``35.1G``.
- :func:`format_params`: parameter counts, as papers write them: ``86.6M``, ``7.2B`` (a billion, not ``G``).
- :class:`FlopUnit`: what a FLOPs figure counts. specvit counts FLOPs as ``FlopCounterMode`` does, a
  multiply-add as 2 (:data:`FLOPS`); papers usually quote multiply-adds (GMACs, :data:`MACS`), half as
  many, so every figure names its unit (``35.1G FLOPs``, ``17.6G MACs``) and each output defines it once
  (``FLOPs (2 x MACs)``).
- :func:`format_flops`: a FLOPs figure with its unit, and the useful part when a mask makes it smaller.
- :func:`format_sizes`: the sizes a figure was counted at (``B=1, S=128``), printed beside it.

Nothing here imports the rest of specvit: any module may print with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "FLOPS",
    "MACS",
    "FlopUnit",
    "flop_unit",
    "format_count",
    "format_flops",
    "format_params",
    "format_sizes",
]

_SI = (("K", 10**3), ("M", 10**6), ("G", 10**9), ("T", 10**12), ("P", 10**15))
_PARAMS = (("K", 10**3), ("M", 10**6), ("B", 10**9), ("T", 10**12))


def _scaled(n: int, units: tuple[tuple[str, int], ...]) -> str:
    """``n`` exact below 1000, else to one decimal in the largest unit that keeps it under 1000."""
    if abs(n) < 1000:
        return str(n)
    for i, (unit, scale) in enumerate(units):
        shown = round(n / scale, 1)
        if abs(shown) < 1000 or i == len(units) - 1:
            return f"{shown:.1f}{unit}"
    raise AssertionError("unreachable")


def format_count(n: int) -> str:
    """One format for every count but parameters: exact below 1000, else one decimal and an SI prefix.

    ``950`` -> ``950``, ``1936`` -> ``1.9K``, ``148_352`` -> ``148.4K``, ``2_362_368`` -> ``2.4M``,
    ``35_127_656_448`` -> ``35.1G``.

    Args:
        n: the count (FLOPs, MACs, bytes).
    """
    return _scaled(n, _SI)


def format_params(n: int) -> str:
    """A parameter count as papers write it: ``5.7M``, ``86.6M``, ``7.2B`` (billions are ``B``, not ``G``).

    Args:
        n: the number of parameters.
    """
    return _scaled(n, _PARAMS)


@dataclass(frozen=True)
class FlopUnit:
    """What a FLOPs figure counts.

    Args:
        name: the unit as written beside a figure: ``FLOPs`` or ``MACs``.
        per: FLOPs in one unit: 1, or 2 for a multiply-add.
        note: the unit in words, written once per output: ``2 x MACs``, ``multiply-adds``.
        key: the unit as JSON keys spell it: ``flops`` or ``macs``.
    """

    name: str
    per: int
    note: str
    key: str

    @property
    def meaning(self) -> str:
        """The unit with its definition: ``FLOPs (2 x MACs)``, ``MACs (multiply-adds)``."""
        return f"{self.name} ({self.note})"

    def of(self, flops: int) -> int:
        """``flops`` (as the graph counts them, a multiply-add as 2) in this unit.

        Args:
            flops: a count of FLOPs; every count specvit makes is even (a matmul's or a conv's).
        """
        return flops // self.per


FLOPS = FlopUnit("FLOPs", 1, "2 x MACs", "flops")
"""Floating-point operations as ``torch.utils.flop_counter.FlopCounterMode`` counts them: a multiply-add
is 2; element-wise work (norms, activations, softmax) counts nothing."""

MACS = FlopUnit("MACs", 2, "multiply-adds", "macs")
"""Multiply-adds (multiply-accumulates), the unit papers quote as GMACs (and often call FLOPs): half of
:data:`FLOPS`."""


def flop_unit(macs: bool) -> FlopUnit:
    """:data:`MACS` when ``macs`` (the ``--macs`` flag), else :data:`FLOPS`.

    Args:
        macs: report multiply-adds.
    """
    return MACS if macs else FLOPS


def format_flops(
    flops: int, unit: FlopUnit = FLOPS, *, useful: int | None = None, define: bool = False
) -> str:
    """A FLOPs figure with its unit: ``1.0G FLOPs``; ``35.1G FLOPs (2 x MACs)`` with ``define``; with a
    ``useful`` count below it (attention under a causal mask or a sliding window, computed densely):
    ``32.2G FLOPs (2 x MACs; useful 24.1G)``.

    Args:
        flops: the count, as the graph holds it (a multiply-add is 2).
        unit: the unit to print it in.
        useful: the count of the work whose results are used, written when it differs from ``flops``.
        define: say what the unit counts.
    """
    notes = [unit.note] if define else []
    if useful is not None and useful != flops:
        notes.append(f"useful {format_count(unit.of(useful))}")
    return f"{format_count(unit.of(flops))} {unit.name}" + (f" ({'; '.join(notes)})" if notes else "")


def format_sizes(dims: Mapping[str, int]) -> str:
    """The sizes a graph's figures were counted at: ``B=1, S=128`` (an image input fixes its own tokens,
    so a ViT's are ``B=1``).

    Args:
        dims: the graph's ``dims``: symbolic dim -> its size (derived ones such as ``S+1`` are left out).
    """
    return ", ".join(f"{k}={v}" for k, v in dims.items() if "+" not in k)
