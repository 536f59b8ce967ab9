"""Hostile input, second round (#17): what reaches the terminal, YAML 1.1 surprises, --set, Python data.

Each class is tested as a class: every control and invisible character, every YAML 1.1 form that YAML
1.2 reads otherwise, every non-ASCII digit, and random --set items and text (Hypothesis).
"""

from __future__ import annotations

import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specvit
from specvit import SpecError
from specvit.cli import main
from specvit.text import escape, oddities, quote

if __package__:
    from . import robustness_cases as rc
else:
    import robustness_cases as rc

ROOT = Path(__file__).resolve().parents[1]

# every character a terminal acts on or does not draw: C0, DEL, C1, bidi controls, zero-width, separators
CONTROL = [chr(c) for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)]]
INVISIBLE = [chr(c) for c in [0xAD, 0x200B, 0x200C, 0x200D, 0x200E, 0x200F, 0x2028, 0x2029, 0x2060, 0xFEFF]]
INVISIBLE += [chr(c) for c in [*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x00A0, 0x3000, 0xE0041]]


def _shown_safe(text: str) -> bool:
    """Nothing in ``text`` but printable characters and the line breaks between messages."""
    return all(
        c == "\n" or (c.isprintable() and unicodedata.category(c) not in ("Cf", "Zl", "Zp")) for c in text
    )


# ------------------------------------------------------------------------------- terminal injection


@pytest.mark.parametrize("ch", CONTROL + INVISIBLE, ids=lambda c: f"U+{ord(c):04X}")
def test_every_control_and_invisible_character_is_escaped(ch: str) -> None:
    text = f"a{ch}b"
    for shown in (escape(text), quote(text)):
        assert _shown_safe(shown) and "\n" not in shown
        assert f"\\x{ord(ch):02x}" in shown or f"\\u{ord(ch):04x}" in shown or f"\\U{ord(ch):08x}" in shown
    assert oddities(text), "an invisible character is named"


@given(st.text(max_size=40))
def test_escape_and_quote_leave_nothing_a_terminal_acts_on(text: str) -> None:
    assert _shown_safe(escape(text)) and "\n" not in escape(text)
    assert _shown_safe(quote(text)) and "\n" not in quote(text)


@pytest.mark.parametrize(
    ("word", "note"),
    [
        ("d\u0435pth", "a Cyrillic 'е' (U+0435) that looks like 'e'"),
        ("l\u0430yernorm", "a Cyrillic 'а' (U+0430) that looks like 'a'"),
        ("w\u03bfdth", "a Greek 'ο' (U+03BF) that looks like 'o'"),
        ("\uff57idth", "a Fullwidth 'ｗ' (U+FF57) that looks like 'w'"),
        ("de\u200bpth", "an invisible U+200B (ZERO WIDTH SPACE)"),
    ],
)
def test_look_alikes_are_shown_escaped_and_named(word: str, note: str) -> None:
    assert oddities(word) == [note]
    assert quote(word).isascii()
    assert quote("depth") == "'depth'" and oddities("Modèle") == []  # plain text is left as it is


@pytest.mark.parametrize(
    ("old", "new", "shown", "named"),
    [
        ("  depth: 2", "  d\u0435pth: 2", "unknown key 'd\\u0435pth'", "Cyrillic 'е'"),
        ("kind: layernorm", "kind: l\u0430yernorm", "'l\\u0430yernorm' is not one of", "Cyrillic 'а'"),
        ("  width: 768", '  "wi\\u200bdth": 768', "unknown key 'wi\\u200bdth'", "invisible U+200B"),
    ],
)
def test_spec_messages_show_look_alikes(old: str, new: str, shown: str, named: str) -> None:
    with pytest.raises(SpecError) as info:
        specvit.parse_spec(rc.VALID.replace(old, new, 1))
    text = str(info.value)
    assert shown in text and named in text, text


# keys and values that try to act on the terminal: clear screen, a fake "ok" line, a title, hidden text
_INJECTIONS = [
    "\\e[2J\\e[H",
    "\\rok  tiny: encoder",
    "\\nok  tiny",
    "\\e]0;pwned\\a",
    "\\e[8mhidden",
    "\\u202egpj",
]


@pytest.mark.parametrize("payload", _INJECTIONS)
@pytest.mark.parametrize("where", ["key", "value", "kind", "file", "set"])
def test_nothing_from_the_input_reaches_the_terminal_raw(
    payload: str, where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = yaml.safe_load(f'"{payload}"')
    text, name, sets = rc.VALID, "spec.yaml", []
    if where == "key":
        text = text.replace("  depth: 2", f'  depth: 2\n  "{payload}": 2')
    elif where == "value":
        text = text.replace("name: tiny", f'name: "{payload}"')
    elif where == "kind":
        text = text.replace("kind: layernorm", f'kind: "{payload}"')
    elif where == "file":
        name, text = f"a{raw}.yaml".replace("/", "_"), text.replace("depth: 2", "depth: 0")
    else:
        sets = ["--set", f"encoder.{raw}=1"]
    path = tmp_path / name
    path.write_text(text)
    assert main(["validate", str(path), *sets]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert _shown_safe(err), repr(err)
    assert len(err.strip().split("\n")) == 1, f"a newline from the input split the message: {err!r}"


@settings(max_examples=150, deadline=None)
@given(st.text(min_size=1, max_size=12))
def test_any_key_is_reported_on_one_safe_line(key: str) -> None:
    document = yaml.safe_dump({**yaml.safe_load(rc.VALID), key: 1}, allow_unicode=False)
    try:
        specvit.parse_spec(document)
    except SpecError as exc:
        text = str(exc)
        assert _shown_safe(text)
        assert text.count("\n") == len(exc.problems) - 1


# ------------------------------------------------------------------------------------- YAML 1.1


@pytest.mark.parametrize(
    ("value", "message", "fix"),
    [
        ("012", "012 is the octal number 10 in YAML 1.1 (a leading zero) but 12 in YAML 1.2", "write 12"),
        ("-012", "-012 is the octal number -10 in YAML 1.1", "write -12"),
        ("00", "00 is the octal number 0 in YAML 1.1", "write 0"),
        ("089", "089 is a string in YAML 1.1 (a leading zero) but the number 89 in YAML 1.2", "write 89"),
        ("1_000", "1_000 is the number 1000 in YAML 1.1 but a string in YAML 1.2", "write 1000"),
        ("1:30", "1:30 is the base-60 number 90 in YAML 1.1 but a string in YAML 1.2", "write 90"),
        ("0b101", "0b101 is the binary number 5 in YAML 1.1 but a string in YAML 1.2", "write 5"),
        ("1_0.5", "1_0.5 is the number 10.5 in YAML 1.1 but a string in YAML 1.2", "write 10.5"),
        ("yes", "yes is the boolean true in YAML 1.1 but a string in YAML 1.2", "write true"),
        ("No", "No is the boolean false in YAML 1.1 but a string in YAML 1.2", "write false"),
        ("on", "on is the boolean true in YAML 1.1", "write true"),
        ("OFF", "OFF is the boolean false in YAML 1.1", "write false"),
    ],
)
def test_values_yaml_11_and_12_read_differently_are_refused(value: str, message: str, fix: str) -> None:
    with pytest.raises(SpecError) as info:
        specvit.parse_spec(rc.VALID.replace("depth: 2", f"depth: {value}"))
    (problem,) = info.value.problems
    assert problem.path == "encoder.depth" and problem.message.startswith(message), problem
    assert problem.hint.startswith(fix) and f"quote the value for a string: '{value}'" in problem.hint
    assert problem.location is not None and problem.location.line == 9
    quoted = specvit.parse_spec(rc.VALID.replace("name: tiny", f"name: tiny\ndescription: '{value}'"))
    assert quoted.description == value  # the fix the hint gives works


@pytest.mark.parametrize("value", ["2024-05-01", "2024-05-01 10:00:00", "2001-12-14t21:59:43.10-05:00", "="])
def test_timestamps_and_equals_are_strings_as_in_yaml_12(value: str) -> None:
    spec = specvit.parse_spec(rc.VALID.replace("name: tiny", f"name: tiny\ndescription: {value}"))
    assert spec.description == value
    assert specvit.parse_spec(spec.to_yaml()) == spec
    with pytest.raises(SpecError, match=r"the tag !!timestamp is refused"):
        specvit.parse_spec(rc.VALID.replace("name: tiny", f"name: tiny\ndescription: !!timestamp {value}"))


def test_yaml_12_forms_that_mean_one_thing_are_read() -> None:
    assert specvit.parse_spec(rc.VALID.replace("depth: 2", "depth: 0o2")).encoder.depth == 2
    assert specvit.parse_spec(rc.VALID.replace("depth: 2", "depth: 0x2")).encoder.depth == 2
    assert specvit.parse_spec(rc.VALID.replace("cls: true", "cls: True")).encoder.prefix.cls is True


def test_a_second_merge_key_is_refused() -> None:
    text = "a: &a {specvit: 1}\nb: &b {name: x}\nc:\n  <<: *a\n  <<: *b\n"
    with pytest.raises(SpecError) as info:
        specvit.parse_spec(text)
    assert str(info.value).startswith(
        "<string>:5:3: c: a second merge key (<<) in one mapping (first at line 4) "
        "(a mapping has one merge key; merge several mappings with one: <<: [*a, *b])"
    )
    with pytest.raises(SpecError) as merged:  # the fix: one merge key with a list is read
        specvit.parse_spec("a: &a {specvit: 1}\nb: &b {name: x}\nc:\n  <<: [*a, *b]\n")
    assert "merge" not in str(merged.value)


# ------------------------------------------------------------------------------------------ --set

NON_ASCII_DIGITS = ["\u00b2", "\u0663", "\u0a69", "\uff15", "\u1d7d", "\u2083", "\U0001d7d1"]


@pytest.mark.parametrize(
    "digit", [d for d in NON_ASCII_DIGITS if d.isdigit()], ids=lambda d: f"U+{ord(d):04X}"
)
def test_an_index_with_a_non_ascii_digit_is_refused(digit: str, capsys: pytest.CaptureFixture[str]) -> None:
    spec = str(ROOT / "specs" / "mnist_vit.yaml")
    assert main(["validate", spec, "--set", f"encoder.block.layers.{digit}=mlp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"<--set encoder.block.layers.{digit}=mlp>: the override path ")
    assert "with digits that are not ASCII" in err and "write list indices with the digits 0-9" in err
    with pytest.raises(SpecError, match="digits that are not ASCII"):
        specvit.load_spec(spec, overrides={f"encoder.block.layers.{digit}": "mlp"})


@pytest.mark.parametrize(
    ("item", "start"),
    [
        (
            "encoder.dpth=3",
            "<--set encoder.dpth=3>: encoder.dpth: unknown key 'dpth' (did you mean 'depth'?)",
        ),
        ("encoder.x.y.z=1", "<--set encoder.x.y.z=1>: encoder.x: unknown key 'x'"),
        ("zzz.y=1", "<--set zzz.y=1>: zzz: unknown key 'zzz'"),
        ("a..b=1", "<--set a..b=1>: the override path 'a..b' has an empty key between dots"),
        (".a=1", "<--set .a=1>: the override path '.a' has an empty key"),
        ("a.=1", "<--set a.=1>: the override path 'a.' has an empty key"),
        ("=1", "<--set =1>: '=1' is not KEY=VALUE"),
        ("name.x=1", "<--set name.x=1>: name: the override path 'name.x' does not lead to a key"),
        ("encoder.depth=012", "<--set encoder.depth=012>:1:1: 012 is the octal number 10 in YAML 1.1"),
    ],
)
def test_problems_from_set_say_they_came_from_set(
    item: str, start: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", str(ROOT / "specs" / "mnist_vit.yaml"), "--set", item]) == 2
    err = capsys.readouterr().err
    assert err.startswith(start), err


_SET_KEYS = ["encoder", "depth", "width", "block", "layers", "heads", "mlp", "ratio", "input", "head", "name"]
_SET_PARTS = [
    *_SET_KEYS,
    "0",
    "1",
    "-1",
    "99",
    *NON_ASCII_DIGITS,
    "",
    " ",
    "\x1b[2J",
    "\u0435",
    "\n",
    "=",
    ".",
]
_SET_VALUES = [
    "1",
    "0",
    "-1",
    "012",
    "yes",
    "null",
    "[",
    "{a: 1}",
    "[1, 2]",
    "2024-05-01",
    "'x'",
    "\x00",
    "=",
    "&a",
]


@st.composite
def _set_item(draw: st.DrawFn) -> str:
    """A --set item from the grammar KEY(.KEY)*=VALUE, with its pieces drawn from good and bad ones."""
    parts = draw(st.lists(st.sampled_from(_SET_PARTS) | st.text(max_size=3), min_size=1, max_size=4))
    value = draw(st.sampled_from(_SET_VALUES) | st.text(max_size=6))
    sep = draw(st.sampled_from(["=", "=", "", "=="]))
    return ".".join(parts) + sep + value


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(_set_item(), min_size=1, max_size=3))
def test_any_set_items_give_a_spec_or_a_clear_error(
    items: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the CLI's main: status 0 or 2, never an exception, every line safe to print."""
    capsys.readouterr()
    args = ["validate", str(ROOT / "specs" / "mnist_vit.yaml")]
    for item in items:
        args += ["--set", item]
    try:
        status = main(args)
    except SystemExit as exc:  # argparse's own usage error: `--set -1=1` reads as an option
        status = exc.code  # type: ignore[assignment]
        assert status == 2 and "usage: specvit validate" in capsys.readouterr().err
        return
    out, err = capsys.readouterr()
    assert status in (0, 2)
    assert _shown_safe(out) and _shown_safe(err)
    if status == 2:
        assert err and all(line.startswith(("<--set ", "/", "specs")) for line in err.splitlines()), err


# ----------------------------------------------------------------------------------- Python data


def _valid() -> dict[str, object]:
    return yaml.safe_load(rc.VALID)  # type: ignore[no-any-return]


def test_a_mapping_that_contains_itself_is_a_spec_error() -> None:
    data = _valid()
    data["encoder"]["block"]["again"] = data  # type: ignore[index]
    with pytest.raises(SpecError, match=r"encoder\.block\.again: the spec contains itself here"):
        specvit.parse_spec(data)
    looped: list[object] = []
    looped.append(looped)
    with pytest.raises(SpecError, match=r"x\.0: the spec contains itself here"):
        specvit.parse_spec({**_valid(), "x": looped})


def test_shared_but_not_cyclic_values_are_fine() -> None:
    """A value given twice (the same dict object) is not a cycle: the only problem is the unknown key."""
    data = _valid()
    norm = data["encoder"]["block"]["norm"]  # type: ignore[index]
    with pytest.raises(SpecError) as info:
        specvit.parse_spec({**data, "x": [norm, {"again": norm}]})
    assert [p.message for p in info.value.problems] == ["unknown key 'x'"]


def test_deep_and_large_mappings_are_bounded() -> None:
    deep: dict[str, object] = {}
    node = deep
    for _ in range(200):
        node["k"] = {}
        node = node["k"]  # type: ignore[assignment]
    with pytest.raises(SpecError, match="nests deeper than 64 levels"):
        specvit.parse_spec({**_valid(), "x": deep})
    with pytest.raises(SpecError, match="more than 10000 values"):
        specvit.parse_spec({**_valid(), "x": list(range(20_000))})
    recursion = sys.getrecursionlimit()
    assert recursion > 64  # the bound is far from Python's own


def test_numpy_numbers_are_numbers() -> None:
    data = _valid()
    data["encoder"]["depth"] = np.int64(3)  # type: ignore[index]
    data["encoder"]["block"]["mlp"]["ratio"] = np.float32(2.0)  # type: ignore[index]
    data["encoder"]["prefix"]["cls"] = np.bool_(True)  # type: ignore[index]
    spec = specvit.parse_spec(data)
    assert spec.encoder.depth == 3 and type(spec.encoder.depth) is int
    mnist = ROOT / "specs" / "mnist_vit.yaml"
    assert specvit.load_spec(mnist, overrides={"encoder.depth": np.int32(2)}).encoder.depth == 2


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (object(), r"x: a builtins\.object is not spec data"),
        (np.zeros(3), r"x: a numpy\.ndarray is not spec data"),
        ({1: "a"}, r"x: keys must be strings, got int 1"),
    ],
)
def test_values_that_are_not_data_are_named(value: object, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        specvit.parse_spec({**_valid(), "x": value})


def test_a_date_where_a_number_belongs_is_not_told_to_drop_quotes_it_does_not_have() -> None:
    with pytest.raises(SpecError) as info:
        specvit.parse_spec(rc.VALID.replace("depth: 2", "depth: 2024-05-01"))
    assert (
        str(info.value)
        == "<string>:9:10: encoder.depth: expected an integer, got '2024-05-01' (write a number)"
    )
    with pytest.raises(SpecError, match=r"write the number without quotes: 12\)"):
        specvit.parse_spec(rc.VALID.replace("depth: 2", 'depth: "12"'))
