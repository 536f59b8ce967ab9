"""Errors that say where and how to fix.

Every problem found in a spec is a :class:`Problem` (key path, source location, message, hint);
a :class:`SpecError` carries all of them at once, so a user fixes a file in one pass, not one
error per run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from specvit.text import escape, visible

__all__ = ["CheckpointError", "Location", "MissingDependencyError", "Problem", "SpecError", "SpecFileError"]


@dataclass(frozen=True)
class Location:
    """A place in a source file; line and column are 1-based, as editors show them.

    Args:
        file: the file name as the user gave it, or a label such as ``<string>`` or ``<--set>``.
        line: 1-based line, or 0 when unknown.
        col: 1-based column, or 0 when unknown.
    """

    file: str
    line: int = 0
    col: int = 0

    def __str__(self) -> str:
        file = escape(self.file)  # a file name is input too: no escape sequence reaches the terminal
        if not self.line:
            return file
        return f"{file}:{self.line}:{self.col}" if self.col else f"{file}:{self.line}"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec.

    Args:
        path: dotted key path inside the spec (``encoder.block.heads``), empty for the whole file.
        message: what is wrong.
        hint: how to fix it, or empty.
        location: where in the source it is, when known.
    """

    path: str
    message: str
    hint: str = ""
    location: Location | None = None

    def __str__(self) -> str:
        """One line: control and invisible characters from the input are escaped (``\\x1b``), never raw."""
        parts = []
        if self.location is not None:
            parts.append(f"{self.location}:")
        if self.path:
            parts.append(f"{visible(self.path)}:")  # keys are ASCII: anything else is shown escaped
        parts.append(escape(self.message))
        text = " ".join(parts)
        return f"{text} ({escape(self.hint)})" if self.hint else text


class SpecError(ValueError):
    """Every problem found in a spec, reported together.

    ``str(error)`` lists one problem per line as ``file:line:col: key.path: message (hint)``.

    Args:
        problems: the problems, in file order where known.
    """

    def __init__(self, problems: Problem | Iterable[Problem]):
        items = [problems] if isinstance(problems, Problem) else list(problems)
        if not items:
            raise ValueError("SpecError needs at least one problem")
        self.problems: Sequence[Problem] = tuple(items)
        super().__init__("\n".join(str(p) for p in self.problems))

    @classmethod
    def at(
        cls, message: str, *, path: str = "", hint: str = "", location: Location | None = None
    ) -> SpecError:
        """A SpecError holding a single problem."""
        return cls(Problem(path=path, message=message, hint=hint, location=location))


class MissingDependencyError(ImportError):
    """An optional package a feature needs is not installed; the message says which extra installs it.

    Args:
        package: the missing import name (``onnxscript``).
        extra: the specvit extra that installs it (``export``).
        feature: what needs it, for the message (``ONNX export``).
    """

    def __init__(self, package: str, extra: str, feature: str):
        super().__init__(
            f"{feature} needs the package '{package}', which is not installed: pip install 'specvit[{extra}]'",
            name=package,
        )
        self.extra = extra


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, is incomplete or mixed, or does not match its spec."""


class SpecFileError(SpecError):
    """The spec file named (on the command line, or to ``load_spec``) cannot be read: missing, a
    directory, not a regular file, or not readable. ``specvit`` exits 1 for it, as for any file error,
    and 2 for a spec that is read but invalid (a missing ``extends`` base included: the spec names it)."""
