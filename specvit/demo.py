"""The main job, as ``make demo`` runs it: validate every bundled spec and summarise it."""

from __future__ import annotations

import sys
from pathlib import Path

from specvit.errors import SpecError
from specvit.spec import load_spec

SPECS = Path(__file__).resolve().parents[1] / "specs"


def main() -> int:
    """Validate every spec in specs/ and print one line each; returns the exit status."""
    status = 0
    for path in sorted(SPECS.glob("*.yaml")):
        try:
            spec = load_spec(path)
        except SpecError as exc:
            print(exc, file=sys.stderr)
            status = 2
            continue
        print(f"ok  {spec.summary_line()}")
    return status


if __name__ == "__main__":
    sys.exit(main())
