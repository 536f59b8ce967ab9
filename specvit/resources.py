"""How much memory a new allocation may take: the machine's, and the container's (cgroup v1 and v2) limit.

Under a container or a systemd slice the kernel kills a process that passes its cgroup's memory limit,
whatever ``MemAvailable`` says, so a check before a large allocation must take the smaller of the two:
the machine's available memory and the headroom under every limit of the process's cgroup and its
ancestors (a parent's limit binds the children too).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["available_memory", "cgroup_headroom", "memory_budget"]

_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a huge number (9223372036854771712)


def _read_int(path: Path) -> int | None:
    """The integer in a cgroup file, None for ``max`` (no limit), a missing file or anything else."""
    try:
        text = path.read_text().split()[0]
    except (OSError, IndexError, UnicodeDecodeError):
        return None
    if not text.isdigit():
        return None
    value = int(text)
    return None if value >= _UNLIMITED else value


def _cgroup_paths(root: Path) -> list[tuple[str, str]]:
    """``(version, path)`` of the process's memory cgroups, from ``/proc/self/cgroup``."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    out = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            out.append(("v2", path))
        elif "memory" in controllers.split(","):
            out.append(("v1", path))
    return out


def _headroom(directory: Path, limit_file: str, usage_file: str) -> int | None:
    limit = _read_int(directory / limit_file)
    if limit is None:
        return None
    usage = _read_int(directory / usage_file) or 0
    return max(limit - usage, 0)


def cgroup_headroom(root: str | os.PathLike[str] = "/") -> int | None:
    """Bytes the process may still allocate under its cgroups' memory limits, or None if none applies.

    Reads cgroup v2 (``memory.max`` - ``memory.current``) and v1 (``memory.limit_in_bytes`` -
    ``memory.usage_in_bytes``) of the process's cgroup and each ancestor up to the mount point (in a
    container the mount point is the container's own cgroup), and takes the smallest.

    Args:
        root: the filesystem root to read ``proc`` and ``sys`` under (tests give a fake one).
    """
    base = Path(root)
    found: list[int] = []
    for version, path in _cgroup_paths(base):
        mount = base / ("sys/fs/cgroup" if version == "v2" else "sys/fs/cgroup/memory")
        files = (
            ("memory.max", "memory.current")
            if version == "v2"
            else (
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        )
        parts = [p for p in path.split("/") if p and p not in (".", "..")]
        for depth in range(len(parts), -1, -1):
            room = _headroom(mount.joinpath(*parts[:depth]), *files)
            if room is not None:
                found.append(room)
    return min(found) if found else None


def _mem_available(root: Path) -> int | None:
    try:
        with open(root / "proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if root != Path("/"):
        return None
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def memory_budget(root: str | os.PathLike[str] = "/") -> tuple[int | None, str]:
    """The bytes a new allocation may take, and what bounds them (for messages).

    Args:
        root: the filesystem root to read ``proc`` and ``sys`` under (tests give a fake one).

    Returns:
        ``(bytes, "the memory available")`` or ``(bytes, "the memory left under the cgroup limit")``;
        ``(None, "")`` when neither is known.
    """
    machine = _mem_available(Path(root))
    group = cgroup_headroom(root)
    if group is not None and (machine is None or group < machine):
        return group, "the memory left under this process's cgroup (container) limit"
    return machine, "the memory available" if machine is not None else ""


def available_memory(root: str | os.PathLike[str] = "/") -> int | None:
    """Bytes of memory available to a new allocation: the smaller of the machine's ``MemAvailable`` and
    the headroom under the process's cgroup memory limits; None if neither is known.

    Args:
        root: the filesystem root to read ``proc`` and ``sys`` under (tests give a fake one).
    """
    return memory_budget(root)[0]
