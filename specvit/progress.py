"""Progress on standard error for long work (export, warm-up, builds, training), through rich.

Shown only on a terminal, never in pipes, logs or tests, and never with ``--quiet``; it is cleared when
the work ends, so the command's own output (``wrote ...``) stays the last line.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

__all__ = ["amount", "enabled", "stages"]


def enabled(quiet: bool = False) -> bool:
    """Whether to show progress: standard error is a terminal and the user did not ask for quiet.

    Args:
        quiet: the user's ``--quiet``.
    """
    return not quiet and sys.stderr.isatty()


@contextlib.contextmanager
def stages(title: str, total: int, show: bool | None = None) -> Iterator[Callable[[str], None]]:
    """A spinner with the stage under way, ``k/total`` and the time elapsed, refreshed while a stage runs.

    Yields ``step(text)``: call it as each stage starts (the first call is stage 1).

    Args:
        title: what is being done, e.g. ``export vit_base_patch16_224``.
        total: the number of stages.
        show: force it on or off; default :func:`enabled`.
    """
    if not (enabled() if show is None else show):
        yield lambda text: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(bar_width=12),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[stage]}"),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(title, total=total, stage="")
        started = False

        def step(text: str) -> None:
            nonlocal started
            if started:
                bar.advance(task)
            started = True
            bar.update(task, stage=text)

        yield step
        bar.update(task, completed=total)


@contextlib.contextmanager
def amount(title: str, total: int, show: bool | None = None) -> Iterator[Callable[[int], None]]:
    """A bar of ``total`` bytes with the bytes done, the rate and the time elapsed.

    Yields ``advance(n)``: call it as each ``n`` bytes are done.

    Args:
        title: what is being done, e.g. ``read llama-3b``.
        total: the bytes the work reads.
        show: force it on or off; default :func:`enabled`.
    """
    if not (enabled() if show is None else show):
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(title, total=total)
        yield lambda n: bar.advance(task, n)
