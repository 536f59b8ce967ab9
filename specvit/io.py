"""Writing files whole or not at all, never over a file the user did not name, nor over an input.

Errors name the file the user asked for, never the hidden temporary file beside it.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from specvit.signals import cleanup_on_signals, temporary

__all__ = [
    "Unreadable",
    "atomic_create",
    "atomic_open",
    "atomic_path",
    "atomic_save",
    "atomic_write",
    "file_mode",
    "open_regular",
    "read_regular",
    "refuse_inputs",
    "refuse_special",
    "spec_inputs",
    "temp_prefix",
]


class Unreadable(ValueError):
    """Why a file the user named cannot be read; callers turn it into their own error (SpecError ...).

    Args:
        message: what is wrong, naming the file (``spec 'x.yaml' is not a regular file but a FIFO``).
        hint: how to fix it.
        reason: ``missing``, ``directory``, ``special``, ``too_big``, ``permission`` or ``os``.
        size: the file's size, for ``too_big``.
    """

    def __init__(self, message: str, hint: str, reason: str, size: int = 0):
        super().__init__(f"{message} ({hint})" if hint else message)
        self.message, self.hint, self.reason, self.size = message, hint, reason, size


_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # POSIX: opening a FIFO nobody writes to returns at once
_KINDS = {
    stat.S_IFIFO: "a FIFO (a named pipe: reading it waits for a writer)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def read_regular(
    path: str | os.PathLike[str], limit: int, what: str, *, shown: str | None = None, head: bool = False
) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; anything else is refused.

    The one way specvit reads a file a user named (specs, ``extends`` bases, config.json, every file of
    a checkpoint), through :func:`open_regular`: a FIFO, a device (``/dev/zero``, ``/dev/stdin``), a
    socket or a directory is refused before a byte is read; a file over ``limit`` is refused by its size,
    and the read stops at ``limit + 1`` bytes should the file grow meanwhile.

    Args:
        path: the file.
        limit: the most bytes it may hold.
        what: what the file is, for messages (``spec``, ``HF config``, ``checkpoint file``).
        shown: the file's name in messages (default: ``path`` as given).
        head: read only the first ``limit`` bytes (a header), whatever the file's size.

    Raises:
        Unreadable: naming the file, what is wrong and the fix.
    """
    name = shown if shown is not None else os.fspath(path)
    with open_regular(path, what, shown=shown, limit=None if head else limit) as f:
        try:
            data = f.read(limit if head else limit + 1)
        except OSError as exc:
            raise Unreadable(f"{what} '{name}' cannot be read: {exc.strerror or exc}", "", "os") from None
    if len(data) > limit:
        raise Unreadable(
            f"{what} '{name}' holds more than {limit:,} bytes, over the limit",
            "is this the right file?",
            "too_big",
            len(data),
        )
    return data


def open_regular(
    path: str | os.PathLike[str], what: str, *, shown: str | None = None, limit: int | None = None
) -> io.BufferedReader:
    """The regular file ``path`` opened for binary reading; anything else is refused before it is read.

    A FIFO, a device (``/dev/zero``, ``/dev/stdin``), a socket or a directory is refused by its ``stat``
    before it is opened, and again by ``fstat`` after an open that cannot block (the path may change in
    between): what the caller reads from the returned file is the regular file that was checked, even
    if the path is replaced afterwards.

    Args:
        path: the file.
        what: what the file is, for messages (``HF weights shard``).
        shown: the file's name in messages (default: ``path`` as given).
        limit: refuse a file of more bytes than this (default: any size).

    Returns:
        The open file (buffered); the caller closes it.

    Raises:
        Unreadable: naming the file, what is wrong and the fix.
    """
    name = shown if shown is not None else os.fspath(path)
    if "\0" in os.fspath(path):
        raise Unreadable(
            f"{what} {name!r} cannot be read: the path holds a NUL character", "check the path", "os"
        )
    try:
        _check(os.stat(path), name, what, limit)
        fd = os.open(path, os.O_RDONLY | _NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0))
        try:
            _check(os.fstat(fd), name, what, limit)
        except BaseException:
            os.close(fd)
            raise
        return open(fd, "rb")
    except FileNotFoundError:
        if not os.path.isabs(path) and not _cwd_exists():
            raise Unreadable(
                f"{what} '{name}' cannot be read: the working directory no longer exists (it was deleted or moved)",
                "cd to a directory that exists, or give an absolute path",
                "os",
            ) from None
        raise Unreadable(f"{what} '{name}' does not exist", "check the path", "missing") from None
    except PermissionError:
        raise Unreadable(
            f"{what} '{name}' cannot be read (permission denied)",
            "check the file's permissions",
            "permission",
        ) from None
    except OSError as exc:
        raise Unreadable(f"{what} '{name}' cannot be read: {exc.strerror or exc}", "", "os") from None


def _cwd_exists() -> bool:
    try:
        os.getcwd()
    except OSError:
        return False
    return True


def _check(info: os.stat_result, name: str, what: str, limit: int | None) -> None:
    """Refuse what is not a regular file, or a regular file over ``limit`` bytes."""
    if stat.S_ISDIR(info.st_mode):
        raise Unreadable(f"{what} '{name}' is a directory", "give the path of a file", "directory")
    if not stat.S_ISREG(info.st_mode):
        raise Unreadable(
            f"{what} '{name}' is not a regular file but {_kind(info.st_mode)}",
            "give the path of a regular file; specvit does not read pipes or devices",
            "special",
        )
    if limit is not None and info.st_size > limit:
        raise Unreadable(
            f"{what} '{name}' is {info.st_size:,} bytes, over the {limit:,}-byte limit for it",
            "is this the right file?",
            "too_big",
            info.st_size,
        )


def _parent(target: Path) -> None:
    """Create ``target``'s missing parent directories, or say which part of the path is not a directory."""
    for ancestor in target.parents:
        if ancestor.exists() or ancestor.is_symlink():
            if not ancestor.is_dir():
                raise NotADirectoryError(
                    errno.ENOTDIR, f"cannot write it: {ancestor} is a file, not a directory", str(target)
                )
            break
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _about(exc, target) from None


NAME_MAX = 255  # bytes in one file name, on the file systems specvit writes to


def temp_prefix(name: str) -> str:
    """``.NAME.``: the prefix of a temporary file beside ``NAME``, cut so that the temporary file's name
    (the prefix, 8 random characters, ``.tmp``) fits in :data:`NAME_MAX` bytes whatever ``NAME`` is.

    Args:
        name: the file name the temporary file stands in for.
    """
    room = NAME_MAX - len("..") - 8 - len(".tmp")
    return f".{os.fsdecode(os.fsencode(name)[:room])}."


def refuse_special(target: Path) -> None:
    """Refuse an output that exists and is not a regular file (a device, a FIFO, a socket, a link to one).

    A write replaces its output in one rename: over ``/dev/null`` or a link to ``/proc/self/fd/1`` that
    would replace the node itself (or fail half-way), so specvit writes regular files only.

    Args:
        target: the output named by the user.

    Raises:
        FileExistsError: naming ``target`` and what it is.
    """
    try:
        info = os.stat(target)
    except (OSError, ValueError):  # missing (or a dangling link, replaced as a file would be)
        return
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory; name a file", str(target))
    if not stat.S_ISREG(info.st_mode):
        raise FileExistsError(
            errno.EEXIST,
            f"is {_kind(info.st_mode)}, not a regular file; specvit writes its outputs as regular files and "
            "never replaces a device, pipe or socket: name a file",
            str(target),
        )


def _about(exc: OSError, target: Path) -> OSError:
    """``exc`` as an error about ``target`` (the path the user named), of the same class."""
    return OSError(exc.errno, exc.strerror or str(exc), str(target)) if exc.errno else exc


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """The name of a temporary file beside ``path``; on success it replaces ``path`` in one rename.

    For writers that take a file name (``program.save(name)``). If the body raises, the temporary file is
    removed and ``path`` keeps its old content; an OSError names ``path``, not the temporary file.

    Args:
        path: the file to write.
    """
    target = Path(path)
    _parent(target)
    refuse_special(target)
    with cleanup_on_signals():  # SIGTERM, SIGHUP ... remove the temporary file, as Ctrl-C does
        yield from _replacing(target)


def _replacing(target: Path) -> Iterator[str]:
    """The body of :func:`atomic_path`: a temporary file beside ``target`` that replaces it at the end."""
    try:
        with temporary(target.parent, temp_prefix(target.name), ".tmp") as tmp:
            os.chmod(tmp, file_mode(target))  # created 0600; give the file the mode a plain open would
            yield str(tmp)
            os.replace(tmp, target)
    except OSError as exc:
        raise _about(exc, target) from None


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Open a temporary file (binary) beside ``path``; on success it replaces ``path`` in one rename.

    If the body raises, the temporary file is removed and ``path`` keeps its old content. Missing parent
    directories are created. An OSError names ``path``, not the temporary file.

    Args:
        path: the file to write.
    """
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def file_mode(target: Path) -> int:
    """The existing file's mode, or 0666 less the umask for a new file.

    Args:
        target: the file about to be written.
    """
    try:
        return target.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def atomic_write(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write ``data`` to ``path`` atomically (temporary file in the same directory, then rename).

    Args:
        path: the file to write.
        data: text (written as UTF-8) or bytes.
    """
    with atomic_open(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def atomic_create(path: str | os.PathLike[str], data: str | bytes) -> bool:
    """Write ``data`` to ``path`` whole, only if no file is there: never over an existing file.

    For files the user did not name (the ``.dot`` source written beside a diagram that could not be
    drawn): the temporary file is hard-linked into place, which fails if ``path`` exists.

    Args:
        path: the file to create.
        data: text (written as UTF-8) or bytes.

    Returns:
        True if the file was written, False if ``path`` already existed (it is left as it was).
    """
    target = Path(path)
    if target.exists() or target.is_symlink():
        return False
    _parent(target)
    try:
        with temporary(target.parent, temp_prefix(target.name), ".tmp") as tmp:
            with open(tmp, "wb") as f:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, file_mode(target))
            os.link(tmp, target)  # fails if target exists: a file created meanwhile is never replaced
    except FileExistsError:
        return False
    except OSError as exc:
        raise _about(exc, target) from None
    return True


def spec_inputs(source: Any) -> dict[str, str]:
    """The files a spec (or a graph or model of one) was read from, each with what it is to the spec.

    Args:
        source: a Spec, an ArchGraph, a compiled model, or anything else (no files).

    Returns:
        ``{path: "the spec itself"}`` for the spec file, ``"the spec's base <path> (extends)"`` for the
        files of its extends chain.
    """
    spec = getattr(source, "spec", source)
    files = list(getattr(getattr(spec, "_source", None), "files", []))
    return {f: "the spec itself" if i == 0 else f"the spec's base {f} (extends)" for i, f in enumerate(files)}


def refuse_inputs(output: str | os.PathLike[str], inputs: Mapping[str, str]) -> None:
    """Refuse to write ``output`` when it is one of ``inputs`` (the same file, through any path or link), or
    not a regular file (:func:`refuse_special`): the commands call this before their work, so a refusal
    costs nothing.

    Args:
        output: the file about to be written.
        inputs: the files read to make it, each with what it is (``"the spec itself"``).

    Raises:
        FileExistsError: naming the output and the input it is, or what the output is.
    """
    out = Path(output)
    refuse_special(out)
    if not out.exists():
        return
    for item, what in inputs.items():
        try:
            same = os.path.samefile(out, item)
        except OSError:  # the input is gone: the output cannot be it
            continue
        if same:
            raise FileExistsError(
                errno.EEXIST, f"is {what}; writing it would replace it: name another file", str(out)
            )


def atomic_save(path: str | os.PathLike[str], save: Callable[[Path], object]) -> Path:
    """Let ``save`` write ``path`` (and any side files it adds, such as ONNX external weights), then put
    them in place whole: each written in a temporary directory beside ``path``, then renamed over.

    Side files land before ``path`` itself, so a reader never sees ``path`` without them. Every file gets
    the mode a plain ``open`` would give it (0644 under the usual umask). If ``save`` raises, nothing in
    place changes.

    Args:
        path: the main file to write.
        save: writes the main file at the path it is given (same name, another directory).
    """
    target = Path(path)
    _parent(target)
    refuse_special(target)
    with (
        cleanup_on_signals(),
        temporary(target.parent, temp_prefix(target.name), directory=True) as tmp,
    ):
        staged = tmp / target.name
        save(staged)
        if not staged.is_file():
            raise FileNotFoundError(f"nothing was written to {target}")
        for written in sorted(tmp.iterdir(), key=lambda p: p == staged):  # the main file last
            final = target.parent / written.name
            refuse_special(final)
            with open(written, "rb+") as f:
                os.fsync(f.fileno())
            os.chmod(written, file_mode(final))
            os.replace(written, final)
    return target
