"""The bundled presets: found by name, wherever specvit is installed.

The presets' source is the top-level ``specs/`` folder of the repository. A wheel carries them as the
package data ``specvit/presets/*.yaml`` (``pyproject.toml`` maps the package ``specvit.presets`` onto
``specs/``); a source checkout or an editable install reads ``specs/`` itself. Either way
``load_spec("vit_base_patch16_224")`` and ``extends: vit_small_patch16_224.yaml`` find them by name.
"""

from __future__ import annotations

import difflib
from pathlib import Path

__all__ = ["preset_dir", "preset_names", "preset_path", "suggest"]

_PACKAGE = Path(__file__).resolve().parents[1]  # the specvit package directory


def preset_dir() -> Path | None:
    """The folder holding the bundled presets: the installed package data, else the checkout's ``specs/``."""
    installed = _PACKAGE / "presets"
    if installed.is_dir():
        return installed
    checkout = _PACKAGE.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "specs").is_dir():
        return checkout / "specs"
    return None


def preset_names() -> list[str]:
    """The names of the bundled presets (file names without ``.yaml``), sorted."""
    folder = preset_dir()
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder is not None else []


def preset_path(name: str) -> Path | None:
    """The file of the preset ``name`` (``vit_base_patch16_224`` or ``vit_base_patch16_224.yaml``), if any.

    Args:
        name: a bare name; anything with a directory part is a path, never a preset.
    """
    if not name or "/" in name or "\\" in name:
        return None
    stem = name.removesuffix(".yaml").removesuffix(".yml")
    folder = preset_dir()
    if folder is None or stem not in preset_names():
        return None
    return folder / f"{stem}.yaml"


def suggest(name: str) -> str:
    """A hint for a spec path that does not exist: the nearest preset's name, or where presets are listed.

    Args:
        name: the path as written.
    """
    stem = Path(name).name.removesuffix(".yaml").removesuffix(".yml")
    close = difflib.get_close_matches(stem, preset_names(), n=1, cutoff=0.75)
    if close:
        return f"check the path, or use the bundled preset '{close[0]}'"
    return (
        "check the path; bundled presets load by name, e.g. vit_base_patch16_224; specvit presets lists them"
    )
