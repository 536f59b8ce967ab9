"""Peak memory of one side of a training case, in a fresh process: ``python -m benchmarks.memory vit ours``.

The child builds the case (both models, so the baseline holds the same weights either way), resets the
kernel's high-water mark (writing 5 to /proc/self/clear_refs), reads its resident size, runs two training steps of one side (the first allocates AdamW's states) and prints the
high-water mark's rise (VmHWM - VmRSS before, from /proc/self/status): activations, gradients and
optimizer states as the allocator actually touched them. A fresh process per measurement keeps memory
freed by an earlier run (kept by the allocator, already resident) from hiding a later run's peak.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["child_peak", "status_kib"]

ROOT = Path(__file__).resolve().parents[1]


def status_kib(field: str, text: str | None = None) -> int | None:
    """A ``kB`` field of /proc/self/status (or of ``text``), None where there is none."""
    if text is None:
        try:
            with open("/proc/self/status") as f:
                text = f.read()
        except OSError:
            return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def child_peak(case: str, side: str, smoke: bool) -> int | None:
    """Peak bytes one training step of ``side`` (``ours`` / ``peer``) of ``case`` adds, from a child process."""
    from benchmarks.common import MALLOC_KEEP

    env = {k: v for k, v in os.environ.items() if k not in MALLOC_KEEP}  # the default allocator's peak
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    args = [sys.executable, "-m", "benchmarks.memory", case, side] + (["--smoke"] if smoke else [])
    run = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    last = run.stdout.strip().splitlines()[-1:] or [""]
    return int(last[0]) if last[0].isdigit() else None


def main(argv: list[str]) -> int:
    import benchmarks.common  # noqa: F401  (the torchvision schemas, before transformers / timm)
    from benchmarks.training import CASES

    case = CASES[argv[0]]("--smoke" in argv)
    step = case.steps[argv[1]]
    try:  # reset the high-water mark, so that building the case does not count
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    before = status_kib("VmRSS")
    step()
    step()
    peak = status_kib("VmHWM")
    if before is None or peak is None:
        return 1
    print(max(peak - before, 0) * 1024)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
