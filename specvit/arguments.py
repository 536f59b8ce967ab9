"""The command-line arguments several ``specvit`` subcommands share: overrides, JSON output, the view, the
sizes FLOPs are counted at and the unit they are printed in, and the argparse types they parse with."""

from __future__ import annotations

import argparse

from specvit.text import escape

__all__ = [
    "add_json",
    "add_macs",
    "add_quiet",
    "add_set",
    "add_sizes",
    "add_view",
    "at_least_2",
    "key_value",
    "port",
    "positive",
]


def key_value(text: str) -> str:
    """``KEY=VALUE`` as given to ``--set``; anything else is a usage error with an example."""
    _, sep, _ = text.partition("=")
    if not sep:  # an empty key (`=1`) is reported like every other --set problem, at <--set =1>
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE; write e.g. --set encoder.depth=6")
    return text


def positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{escape(text)!s} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def port(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{escape(text)!s} is not an integer") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 0 (any free one) to 65535, got {value}")
    return value


def at_least_2(text: str) -> int:
    """An int >= 2: an export specialises a dimension whose example size is 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"must be 2 or more (a size of 1 would be fixed in the export), got {value}"
        )
    return value


def add_set(p: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE``, repeatable: overrides applied to the spec after loading.

    Args:
        p: the subcommand's parser.
    """
    p.add_argument(
        "--set",
        metavar="KEY=VALUE",
        type=key_value,
        action="append",
        default=[],
        help="override a key after loading, e.g. --set encoder.depth=6 (repeatable; VALUE is YAML)",
    )


def add_json(p: argparse.ArgumentParser) -> None:
    """``--json``: print JSON instead of text.

    Args:
        p: the subcommand's parser.
    """
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def add_view(p: argparse.ArgumentParser, what: str) -> None:
    """``--view collapsed|expanded``.

    Args:
        p: the subcommand's parser.
        what: what happens to a run of identical blocks in the collapsed view (``drawn``).
    """
    p.add_argument(
        "--view",
        choices=["collapsed", "expanded"],
        default="collapsed",
        help=f"collapsed (default): each run of identical blocks {what} once with its count; "
        "expanded: every block",
    )


def add_sizes(p: argparse.ArgumentParser) -> None:
    """``--batch``, ``--seq-len``, ``--src-len``, ``--tgt-len``: the sizes FLOPs are counted at.

    Args:
        p: the subcommand's parser.
    """
    g = p.add_argument_group("sizes FLOPs are counted at (image inputs fix their own token counts)")
    g.add_argument("--batch", type=positive, default=1, metavar="N", help="batch size B (default 1)")
    g.add_argument(
        "--seq-len",
        type=positive,
        metavar="N",
        help="sequence length S of token/feature inputs (default 128, or the spec's max_len if shorter)",
    )
    g.add_argument("--src-len", type=positive, metavar="N", help="encoder length S_src of an encoder_decoder")
    g.add_argument("--tgt-len", type=positive, metavar="N", help="decoder length S_tgt of an encoder_decoder")


def add_quiet(p: argparse.ArgumentParser) -> None:
    """``-q``/``--quiet``: no progress display.

    Args:
        p: the subcommand's parser.
    """
    p.add_argument(
        "-q", "--quiet", action="store_true", help="no progress display (none is shown off a terminal)"
    )


def add_macs(p: argparse.ArgumentParser) -> None:
    """``--macs``: print multiply-adds instead of FLOPs (which count a multiply-add as 2).

    Args:
        p: the subcommand's parser.
    """
    p.add_argument(
        "--macs",
        action="store_true",
        help="print multiply-adds (MACs, the unit papers quote as GMACs) instead of FLOPs, which count a "
        "multiply-add as 2 (as torch's FlopCounterMode does): every figure halves",
    )
