"""Command-line conventions: --version, exit statuses as the help states, usage errors, the same flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import specvit
from specvit.cli import build_parser, main

SUBCOMMANDS = (
    "validate",
    "summary",
    "diff",
    "presets",
    "schema",
    "render",
    "export",
    "eject",
    "import",
    "serve",
)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        status = main(list(argv))
    except SystemExit as exc:  # argparse's own exits (--help, --version, usage errors)
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys, "--version") == (0, f"specvit {specvit.__version__}\n", "")


def test_exit_statuses_are_as_the_help_says(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _, help_text, _ = _run(capsys, "--help")
    assert "1 a file cannot be read or written" in " ".join(help_text.split())
    assert "2 an invalid spec, or a usage error" in " ".join(help_text.split())
    assert _run(capsys, "validate", "mnist_vit")[0] == 0
    assert _run(capsys, "validate", str(tmp_path / "missing.yaml"))[0] == 1  # a file error
    assert _run(capsys, "validate", str(tmp_path))[0] == 1  # a directory
    bad = tmp_path / "bad.yaml"
    bad.write_text("specvit: 1\nname: x\nmodel: encoder\nencoder: {width: six}\n")
    assert _run(capsys, "validate", str(bad))[0] == 2  # an invalid spec
    assert _run(capsys, "validate", str(bad), str(tmp_path / "missing.yaml"))[0] == 2  # the worse of the two
    assert _run(capsys, "summary", str(tmp_path / "missing.yaml"))[0] == 1
    assert _run(capsys, "render", "mnist_vit", "-o", str(tmp_path / "m.jpg"))[0] == 1


@pytest.mark.parametrize("command", ["validate", "summary", "render", "export", "eject"])
def test_set_without_equals_is_a_usage_error_of_the_subcommand(
    capsys: pytest.CaptureFixture[str], command: str, tmp_path: Path
) -> None:
    out = [] if command in ("validate", "summary") else ["-o", str(tmp_path / "x.svg")]
    status, _, err = _run(capsys, command, "mnist_vit", *out, "--set", "encoder.depth")
    assert status == 2
    assert err.startswith(f"usage: specvit {command} ")
    assert err.splitlines()[-1] == (
        f"specvit {command}: error: argument --set: 'encoder.depth' is not KEY=VALUE; "
        "write e.g. --set encoder.depth=6"
    )
    assert _run(capsys, command, "mnist_vit", *out, "--set", "=6")[0] == 2


def test_validate_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("specvit: 1\nname: x\nmodel: encoder\nencoder: {width: six}\n")
    status, out, err = _run(capsys, "validate", "--json", "mnist_vit", str(bad), str(tmp_path / "no.yaml"))
    assert status == 2 and err == ""
    ok, invalid, unreadable = json.loads(out)
    assert ok == {
        "spec": "mnist_vit",
        "status": "ok",
        "name": "mnist_vit",
        "summary": specvit.load_spec("mnist_vit").summary_line(),
    }
    assert invalid["status"] == "invalid" and unreadable["status"] == "unreadable"
    width = next(p for p in invalid["problems"] if p["path"] == "encoder.width")
    assert (width["file"], width["line"], width["col"]) == (str(bad), 4, 18)
    assert width["text"].startswith(f"{bad}:4:18: encoder.width: ")
    assert unreadable["problems"][0]["message"] == f"spec '{tmp_path / 'no.yaml'}' does not exist"


def test_summary_json_and_one_spelling_of_the_expanded_view(capsys: pytest.CaptureFixture[str]) -> None:
    spec = ("vit_tiny_patch16_224", "--set", "encoder.depth=3")
    folded = json.loads(_run(capsys, "summary", *spec, "--json")[1])
    expanded = json.loads(_run(capsys, "summary", *spec, "--json", "--view", "expanded")[1])
    assert len(expanded["rows"]) > len(folded["rows"]) and folded["total_params"] == expanded["total_params"]
    assert (
        _run(capsys, "summary", *spec, "--expand")[1]
        == _run(capsys, "summary", *spec, "--view", "expanded")[1]
    )


def test_the_same_flags_across_subcommands() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    commands = sub.choices  # type: ignore[attr-defined]
    assert set(commands) == set(SUBCOMMANDS)
    flags = {name: {o for a in p._actions for o in a.option_strings} for name, p in commands.items()}
    for name in ("validate", "summary", "presets"):
        assert "--json" in flags[name]
    for name in ("summary", "render"):
        assert "--view" in flags[name]
        assert "--expand" not in commands[name].format_help()  # one spelling shown
    for name in ("validate", "summary", "render", "export", "eject"):
        assert "--set" in flags[name]


def test_set_values_get_the_right_hints(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = _run(capsys, "validate", "tiny_seq2seq", "--set", "decoder.depth=six")
    assert status == 2
    assert err.strip() == (
        "<--set decoder.depth=six>: decoder.depth: expected an integer, got 'six' (write it in digits, e.g. 6)"
    )
    _, _, err = _run(capsys, "validate", "tiny_seq2seq", "--set", 'decoder.depth="6"')
    assert err.strip().endswith("(write the number without quotes: 6)")
    _, _, err = _run(capsys, "validate", "mnist_vit", "--set", "encoder.ratio=2")
    assert err.strip().endswith(
        "unknown key 'ratio' (ratio belongs under encoder.masking or encoder.block.mlp)"
    )
