"""The robustness table: bad inputs to specvit and the first error line each must get.

Each :class:`Case` is one input, created in a fresh directory (files from bytes, or a small setup
function for symlinks, FIFOs, permissions and large files), given to specvit as a spec path. Every
case must get a SpecError: through ``python -m specvit.cli validate FILE`` exit status 2 (1 where the
path itself cannot be read), no traceback,
and a first error line that starts with ``expected``, after the file name (and line:col) it names.

``tests/test_robustness.py`` runs the table through the CLI and through :func:`specvit.load_spec`. The CLI
runs are forked from one interpreter that imported specvit (:func:`cli_runs`: one start-up instead of one per
case), and a sample runs in fresh interpreters too (:func:`cli_command`), which must give the same.
``python tests/robustness_cases.py`` runs it in-process and writes ``docs/robustness.md`` from it;
a test fails when that file is stale.

The tests may run as root (they do in this project's container), and root reads files whatever their
mode. The one case that needs file permissions to apply (``path_unreadable``) therefore runs with the
effective user id switched to ``nobody`` (65534) when the process is root: in-process with ``os.seteuid``
around the call, and through the CLI by a forked process, or a ``python -c``, that does the same before
running the CLI. Its directory is then made traversable by ``nobody``, so that the error comes from
the file's mode, not from a parent directory. ``path_symlink_loop`` is a path no user can read, root
included.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "robustness.md"
NOBODY = 65534  # the user id the unprivileged case runs as, when the tests run as root
TIME_LIMIT = 1.0  # seconds: every case returns within this, in-process

# The spec the cases break, one thing at a time. It is valid (a test checks that).
VALID = """specvit: 1
name: tiny
model: encoder
encoder:
  input: {kind: image, size: 32, patch: 8, channels: 3}
  prefix: {cls: true}
  position: learned
  width: 768
  depth: 2
  block:
    heads: 12
    layers: [self_attention, mlp]
    norm: {kind: layernorm, placement: pre, eps: 1.0e-6}
    mlp: {ratio: 4, activation: gelu}
head: {kind: classifier, pool: cls, classes: 10}
"""


def _valid_with(old: str, new: str) -> bytes:
    """VALID with its first ``old`` replaced by ``new``, as UTF-8 bytes."""
    if old not in VALID:
        raise ValueError(f"{old!r} is not in the valid spec")
    return VALID.replace(old, new, 1).encode()


@dataclass(frozen=True)
class Case:
    """One bad input and what specvit must say about it.

    Args:
        id: a short name; also the spec file's name (``<id>.yaml``) unless ``spec`` says otherwise.
        input: what the input is, for the table in docs/robustness.md.
        expected: the exact start of the first error line after ``<error_file>:``; when ``error_file``
            is None (no line exists: the path cannot be read) the exact start of the whole line.
        text: the bytes of the spec file, if the case has one made of bytes.
        files: other files of the case (bases of ``extends``), by name.
        setup: makes what bytes cannot (symlinks, FIFOs, directories, modes, large files).
        spec: the path given to specvit, relative to the case's directory.
        error_file: the file the first error line names, relative to the case's directory; "" for the
            spec itself; None for a path error, which names the path in the message instead.
        exit_code: the exit status of ``specvit validate``.
        unprivileged: the case needs file permissions to apply (run as ``nobody`` when root).
        must_not_create: a file the input would create if specvit ran code from it.
        seconds: the CPU time the case may take: :data:`TIME_LIMIT`, unless the refusal must read that
            much first (a chain of files each under the value limit is refused once 10,000 values are read).
    """

    id: str
    input: str
    expected: str
    text: bytes | None = None
    files: Mapping[str, bytes] = field(default_factory=dict)
    setup: Callable[[Path], None] | None = None
    spec: str = ""
    error_file: str | None = ""
    exit_code: int = 2
    unprivileged: bool = False
    must_not_create: str = ""
    seconds: float = TIME_LIMIT

    @property
    def spec_name(self) -> str:
        """The spec path, relative to the case's directory."""
        return self.spec or f"{self.id}.yaml"

    @property
    def error_name(self) -> str | None:
        """The file the first error line starts with, relative to the case's directory."""
        return self.spec_name if self.error_file == "" else self.error_file

    @property
    def expected_line(self) -> str:
        """The expected start of the first error line, with the case's directory left out."""
        return f"{self.error_name}:{self.expected}" if self.error_name is not None else self.expected

    def create(self, base: Path) -> Path:
        """Make the case's files in a new directory ``base/<id>``; return that directory."""
        case_dir = base / self.id
        case_dir.mkdir()
        if self.text is not None:
            (case_dir / self.spec_name).write_bytes(self.text)
        for name, data in self.files.items():
            (case_dir / name).write_bytes(data)
        if self.setup is not None:
            self.setup(case_dir)
        return case_dir


# ------------------------------------------------------------------------------------------ inputs


def _python_object(d: Path) -> None:
    command = json.dumps(f"touch {shlex.quote(str(d / 'ran'))}")  # JSON strings are YAML strings too
    text = VALID.replace("name: tiny", f"name: !!python/object/apply:os.system [{command}]")
    (d / "python_object.yaml").write_text(text)


def _alias_bomb() -> bytes:
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    return ("\n".join(lines) + "\n").encode()  # 9**10 (3.5 billion) strings once expanded


def _merge_chain() -> bytes:
    # anchors defined inside keys (never converted themselves), each merging the one before
    lines = [f"? &m{i} {{" + (f"<<: *m{i - 1}, " if i else "") + f"k{i}: 1}}\n: 1" for i in range(200)]
    return ("\n".join(lines) + "\nv: *m199\n").encode()


def _deep_block_map() -> bytes:
    return ("".join(" " * i + "k:\n" for i in range(1000)) + " " * 1000 + "v\n").encode()


def _huge_file(d: Path) -> None:
    with (d / "huge_file.yaml").open("wb") as f:
        f.write(VALID.encode())
        line = b"# " + b"x" * 1021 + b"\n"  # 1 KiB
        for _ in range(50 * 1024 - 1):
            f.write(line)
        f.write(b"#" * (50 * 2**20 - f.tell()))  # exactly 50 MiB


def _mkfifo(name: str) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        os.mkfifo(d / name)

    return setup


def _sparse(name: str) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        with (d / name).open("wb") as f:
            f.truncate(8 << 30)  # a hole: no block is written

    return setup


def _mkdir(name: str) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        (d / name).mkdir()

    return setup


def _symlink(name: str, target: str) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        os.symlink(target, d / name)

    return setup


def _extends_chain(d: Path) -> None:
    for i in range(40):
        (d / f"c{i:02}.yaml").write_text(f"specvit: 1\nextends: c{i + 1:02}.yaml\n")
    (d / "c40.yaml").write_text(VALID)


def _extends_bytes(d: Path) -> None:
    pad = ("# " + "x" * 1021 + "\n") * 300  # 300 KiB of comment: each file is far under the limit
    for i in range(4):
        (d / f"b{i}.yaml").write_text(f"specvit: 1\nextends: b{i + 1}.yaml\n" + pad)
    (d / "b4.yaml").write_text(VALID)


def _extends_values(d: Path) -> None:
    values = "".join(f"  - {j}\n" for j in range(4900))  # 4,900 values: each file under the 10,000 limit
    for i in range(20):
        (d / f"v{i}.yaml").write_text(f"specvit: 1\nextends: v{i + 1}.yaml\npad{i}:\n{values}")
    (d / "v20.yaml").write_text(VALID)


def _unreadable(d: Path) -> None:
    path = d / "path_unreadable.yaml"
    path.write_text(VALID)
    path.chmod(0)


_EXTENDS = b"specvit: 1\nextends: %s\nname: child\n"

CASES: list[Case] = [
    # --- documents that are not a spec
    Case(
        "empty",
        "an empty file",
        "1:1: the file holds no YAML document (a spec starts with 'specvit: 1')",
        text=b"",
    ),
    Case(
        "comment_only",
        "a file that is only a comment",
        "1:1: the file holds no YAML document (a spec starts with 'specvit: 1')",
        text=b"# specvit: 1\n",
    ),
    Case(
        "root_list",
        "a list at the top level",
        "1:1: the spec must be a mapping of keys at the top level, got a list",
        text=b"- specvit: 1\n- name: tiny\n",
    ),
    Case(
        "root_scalar",
        "a scalar at the top level",
        "1:1: the spec must be a mapping of keys at the top level, got 42",
        text=b"42\n",
    ),
    # --- bytes and characters
    Case(
        "not_utf8",
        "a byte that is not UTF-8 (0xff in the name)",
        "2:8: the file is not UTF-8 text (byte 0xff at offset 18) (save the spec as UTF-8)",
        text=VALID.encode().replace(b"name: tiny", b"name: t\xffny"),
    ),
    Case(
        "control_character",
        "a NUL character (valid UTF-8, not allowed in YAML)",
        "2:9: the character #x0000 is not allowed in YAML",
        text=_valid_with("name: tiny", "name: ti\x00ny"),
    ),
    Case(
        "tab_indent",
        "a tab used for indentation",
        "11:1: a tab character where YAML expects indentation or a value "
        "(YAML does not allow tabs for indentation; indent with spaces)",
        text=_valid_with("    heads: 12", "\theads: 12"),
    ),
    Case(
        "syntax_error",
        "a YAML syntax error (an unclosed '[')",
        "5:56: YAML syntax error: expected ',' or ']', but got '}' (while parsing a flow sequence)",
        text=_valid_with("size: 32, patch: 8", "size: [32, patch: 8"),
    ),
    Case(
        "indent_between_levels",
        "a key indented between two levels (3 spaces, in a 2-space file)",
        "12:4: this line is indented 3 spaces, which matches no mapping above it (keys of one mapping start "
        "in the same column: indent it 4 spaces, as 'heads' at line 11 or 2 spaces, as 'block' at line 10 "
        "or 0 spaces, as 'encoder' at line 4)",
        text=_valid_with("    layers:", "   layers:"),
    ),
    Case(
        "indent_under_a_value",
        "a key indented under a key that already has a value",
        "9:10: this key is indented deeper than 'width' above it, which already has a value (indent it as "
        "'width' (2 spaces); to nest it under 'width', leave 'width:' without a value)",
        text=_valid_with("  depth: 2", "    depth: 2"),
    ),
    Case(
        "colon_in_value",
        "an unquoted value holding ': '",
        "2:8: a ': ' inside a value, which YAML reads as a new key (put the value in quotes, or end the line "
        "after the key's colon)",
        text=_valid_with("name: tiny", "name: a: b"),
    ),
    Case(
        "key_at_the_wrong_level",
        "a block key written on the stack (`encoder.heads`)",
        "10:3: encoder.heads: unknown key 'heads' (heads belongs under encoder.block)",
        text=_valid_with("  block:\n    heads: 12\n", "  heads: 12\n  block:\n"),
    ),
    Case(
        "stack_key_in_a_block",
        "a stack key written in a block (`encoder.block.position`)",
        "12:5: encoder.block.position: unknown key 'position' (position belongs under encoder, not "
        "encoder.block; a block varies the stack's rotary positions by its rope: {base: theta} or rope: false, "
        "in blocks: or overrides:)",
        text=_valid_with("    layers:", "    position: learned\n    layers:"),
    ),
    Case(
        "number_in_words",
        "a number written in words",
        "9:10: encoder.depth: expected an integer, got 'six' (write it in digits, e.g. 6)",
        text=_valid_with("depth: 2", "depth: six"),
    ),
    Case(
        "duplicate_key",
        "a key given twice in one mapping",
        "10:3: encoder.depth: duplicate key 'depth' (first at line 9)",
        text=_valid_with("  depth: 2\n", "  depth: 2\n  depth: 3\n"),
    ),
    Case(
        "key_is_a_list",
        "a key that is a list (`? [a, b]`)",
        "16:3: keys must be plain strings, got a list (write the key as a name such as width)",
        text=(VALID + "? [a, b]\n: 1\n").encode(),
    ),
    # --- code, tags, aliases
    Case(
        "python_object",
        '`name: !!python/object/apply:os.system ["touch <case dir>/ran"]`',
        "2:7: name: the tag !!python/object/apply:os.system is refused",
        setup=_python_object,
        must_not_create="ran",
    ),
    Case(
        "bad_tagged_value",
        "`!!int abc`: an explicit tag on a value that is not of that type",
        "8:10: encoder.width: 'abc' is not a valid !!int (remove the tag or correct the value)",
        text=_valid_with("width: 768", "width: !!int abc"),
    ),
    Case(
        "tagged_empty_value",
        "`width: !!int` (a tag with no value)",
        "8:10: encoder.width: '' is not a valid !!int (remove the tag or correct the value)",
        text=_valid_with("width: 768", "width: !!int"),
    ),
    Case(
        "alias_bomb",
        'an alias bomb ("billion laughs": 10 levels of 9 aliases)',
        "1:20: the document expands to more than 10000 values",
        text=_alias_bomb(),
    ),
    Case(
        "alias_to_itself",
        "an anchored list that holds an alias to itself (`a: &a [*a]`)",
        "1:4: a.0: an alias (*name) refers to a collection that contains it",
        text=b"a: &a [*a]\n",
    ),
    Case(
        "merge_chain",
        "200 anchors, each merging (`<<`) the one before",
        "273:3: v: the document nests deeper than 64 levels once its aliases are expanded",
        text=_merge_chain(),
    ),
    # --- size and shape
    Case(
        "deep_flow",
        "5,000 levels of flow lists (`[[[[...`)",
        "1:68: the document nests deeper than 64 levels",
        text=b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n",
    ),
    Case(
        "deep_block_list",
        "5,000 levels of block lists (`- - - - ...`)",
        "1:129: the document nests deeper than 64 levels",
        text=b"- " * 5000 + b"x\n",
    ),
    Case(
        "deep_block_map",
        "1,000 levels of indented mappings (500 KB)",
        "65:65: the document nests deeper than 64 levels",
        text=_deep_block_map(),
    ),
    Case(
        "huge_file",
        "a 50 MiB file",
        "1:1: the file is 52,428,800 bytes, over the 1,048,576-byte limit for a spec",
        setup=_huge_file,
    ),
    Case(
        "too_many_values",
        "100,000 values in one list (300 KB, under the size limit)",
        "1:29999: the document holds more than 10000 values",
        text=b"a: [" + b"0, " * 100_000 + b"]\n",
    ),
    # --- values
    Case(
        "integer_10e30",
        "`width: 10**30`",
        "8:10: encoder.width: must be <= 65536, got 1000000000000000000000000000000",
        text=_valid_with("width: 768", f"width: {10**30}"),
    ),
    Case(
        "integer_5000_digits",
        "an integer of 5,000 digits (more than Python converts)",
        "8:10: encoder.width: the integer has 5,000 digits, too many to read",
        text=_valid_with("width: 768", "width: " + "9" * 5000),
    ),
    Case(
        "zero_size",
        "`depth: 0`",
        "9:10: encoder.depth: a stack of depth 0 has no blocks; only an encoder_decoder's encoder may",
        text=_valid_with("depth: 2", "depth: 0"),
    ),
    Case(
        "negative_size",
        "`width: -768`",
        "8:10: encoder.width: must be >= 1, got -768",
        text=_valid_with("width: 768", "width: -768"),
    ),
    Case(
        "override_out_of_range",
        "`overrides: [{layers: [0], block: {mlp: {ratio: -1}}}]`: a partial block's value out of range",
        "15:50: encoder.overrides.0.block.mlp.ratio: must be > 0.0, got -1",
        text=_valid_with("head:", "  overrides: [{layers: [0], block: {mlp: {ratio: -1}}}]\nhead:"),
    ),
    Case(
        "nan",
        "`ratio: .nan`",
        "14:18: encoder.block.mlp.ratio: must be a finite number, got nan",
        text=_valid_with("ratio: 4", "ratio: .nan"),
    ),
    Case(
        "infinity",
        "`eps: .inf`",
        "13:50: encoder.block.norm.eps: must be a finite number, got inf",
        text=_valid_with("eps: 1.0e-6", "eps: .inf"),
    ),
    Case(
        "bool_for_number",
        "`heads: true` (a boolean where a number belongs)",
        "11:12: encoder.block.heads: expected an integer, got true "
        "(booleans are not numbers here; write a number)",
        text=_valid_with("heads: 12", "heads: true"),
    ),
    Case(
        "quoted_number",
        '`heads: "12"` (a number as a string)',
        "11:12: encoder.block.heads: expected an integer, got '12' (write the number without quotes: 12)",
        text=_valid_with("heads: 12", 'heads: "12"'),
    ),
    # --- extends
    Case(
        "extends_cycle",
        "a.yaml extends b.yaml, which extends a.yaml",
        "2:10: extends: extends forms a cycle: a.yaml -> b.yaml -> a.yaml",
        files={"a.yaml": b"specvit: 1\nextends: b.yaml\n", "b.yaml": b"specvit: 1\nextends: a.yaml\n"},
        spec="a.yaml",
        error_file="b.yaml",
    ),
    Case(
        "extends_missing",
        "extends names a file that does not exist",
        "2:10: spec 'missing.yaml' does not exist (check the path; bundled presets load by name, e.g. vit_base_patch16_224; specvit presets lists them)",
        text=_EXTENDS % b"missing.yaml",
    ),
    Case(
        "extends_directory",
        "extends names a directory",
        "2:10: spec 'presets' is a directory (give the path of a .yaml file)",
        text=_EXTENDS % b"presets",
        setup=_mkdir("presets"),
    ),
    Case(
        "extends_fifo",
        "extends names a FIFO nobody writes to (reading it would wait forever)",
        "2:10: spec 'base.yaml' is not a regular file but a FIFO (a named pipe: reading it waits for a writer) (give the path of a .yaml file)",
        text=_EXTENDS % b"base.yaml",
        setup=_mkfifo("base.yaml"),
    ),
    Case(
        "extends_dev_urandom",
        "extends names a symlink to /dev/urandom (reading it would never end)",
        "2:10: spec '/dev/urandom' is not a regular file but a character device (give the path of a .yaml file)",
        text=_EXTENDS % b"base.yaml",
        setup=_symlink("base.yaml", "/dev/urandom"),
    ),
    Case(
        "extends_sparse",
        "extends names a sparse file of 8 GiB (no disk used; reading it would fill memory)",
        "1:1: the file is 8,589,934,592 bytes, over the 1,048,576-byte limit for a spec",
        text=_EXTENDS % b"base.yaml",
        setup=_sparse("base.yaml"),
        error_file="base.yaml",
    ),
    Case(
        "extends_symlink_loop",
        "extends names a symlink to itself",
        "2:10: spec 'loop.yaml' cannot be read: Too many levels of symbolic links",
        text=_EXTENDS % b"loop.yaml",
        setup=_symlink("loop.yaml", "loop.yaml"),
    ),
    Case(
        "extends_nul",
        '`extends: "a\\0b.yaml"` (a NUL character in the path)',
        "2:10: spec 'a\\x00b.yaml' cannot be read: the path holds a NUL character",
        text=_EXTENDS % b'"a\\0b.yaml"',
    ),
    Case(
        "extends_chain",
        "a chain of 41 files, each extending the next",
        "2:10: extends: extends chains more than 32 files",
        setup=_extends_chain,
        spec="c00.yaml",
        error_file="c31.yaml",
    ),
    Case(
        "extends_bytes",
        "a chain of 5 files of 300 KiB each: each under the 1 MiB limit, together over it",
        "2:10: extends: the extends chain holds more than 1,048,576 bytes: with 'b3.yaml' its 4 files hold "
        "1,228,912",
        setup=_extends_bytes,
        spec="b0.yaml",
        error_file="b2.yaml",
    ),
    Case(
        "extends_values",
        "a chain of 21 files, 20 of them of 4,900 values: each under the 10,000-value limit, together 98,000",
        "2:10: extends: the extends chain holds more than 10,000 values: its 3 files up to 'v2.yaml' do",
        setup=_extends_values,
        spec="v0.yaml",
        error_file="v1.yaml",
        seconds=2.5,  # 9,800 values parsed before the third file is refused: ~0.55 s warm, ~1.1 s cold
    ),
    # --- YAML 1.1 forms that YAML 1.2 reads as another value
    Case(
        "yaml11_octal",
        "`depth: 012` (octal 10 in YAML 1.1, 12 in YAML 1.2)",
        "9:10: encoder.depth: 012 is the octal number 10 in YAML 1.1 (a leading zero) but 12 in YAML 1.2 "
        "(write 12 without the leading zero (or 0o12 for octal), or quote the value for a string: '012')",
        text=_valid_with("depth: 2", "depth: 012"),
    ),
    Case(
        "yaml11_boolean",
        "`cls: yes` (a boolean in YAML 1.1, a string in YAML 1.2)",
        "6:17: encoder.prefix.cls: yes is the boolean true in YAML 1.1 but a string in YAML 1.2 "
        "(write true for the boolean, or quote the value for a string: 'yes')",
        text=_valid_with("cls: true", "cls: yes"),
    ),
    Case(
        "yaml11_underscore",
        "`width: 7_68` (768 in YAML 1.1, a string in YAML 1.2)",
        "8:10: encoder.width: 7_68 is the number 768 in YAML 1.1 but a string in YAML 1.2 (the '_')",
        text=_valid_with("width: 768", "width: 7_68"),
    ),
    Case(
        "yaml11_base60",
        "`width: 12:48` (base 60, 768, in YAML 1.1; a string in YAML 1.2)",
        "8:10: encoder.width: 12:48 is the base-60 number 768 in YAML 1.1 but a string in YAML 1.2",
        text=_valid_with("width: 768", "width: 12:48"),
    ),
    Case(
        "yaml11_leading_zero",
        "`depth: 08` (a string in YAML 1.1, 8 in YAML 1.2)",
        "9:10: encoder.depth: 08 is a string in YAML 1.1 (a leading zero) but the number 8 in YAML 1.2",
        text=_valid_with("depth: 2", "depth: 08"),
    ),
    Case(
        "duplicate_merge_key",
        "two merge keys (`<<: *a` and `<<: *b`) in one mapping",
        "20:3: x: a second merge key (<<) in one mapping (first at line 19) "
        "(a mapping has one merge key; merge several mappings with one: <<: [*a, *b])",
        text=(VALID + "a: &a {k: 1}\nb: &b {j: 2}\nx:\n  <<: *a\n  <<: *b\n").encode(),
    ),
    # --- characters that would act on the terminal or pass for others
    Case(
        "ansi_key",
        'a key holding ANSI escape sequences (`"\\e[2J\\e[H": 1`: clear the screen)',
        "16:1: \\x1b[2J\\x1b[H: unknown key '\\x1b[2J\\x1b[H' (it contains a control character \\x1b;",
        text=(VALID + '"\\e[2J\\e[H": 1\n').encode(),
    ),
    Case(
        "newline_in_value",
        'a name holding a newline and a fake "ok" line (`name: "x\\nok  tiny"`)',
        "2:7: name: 'x\\x0aok  tiny' is not a valid name",
        text=_valid_with("name: tiny", 'name: "x\\nok  tiny"'),
    ),
    Case(
        "bidi_value",
        "a name holding a right-to-left override (U+202E), which reverses the text after it",
        "2:7: name: '\\u202eymmud' is not a valid name",
        text=_valid_with("name: tiny", 'name: "\\u202Eymmud"'),
    ),
    Case(
        "confusable_key",
        "a key with a Cyrillic 'е' that looks like the Latin 'e' (`dеpth`)",
        "10:3: encoder.d\\u0435pth: unknown key 'd\\u0435pth' (it contains a Cyrillic 'е' (U+0435) that looks "
        "like 'e'; did you mean 'depth'?)",
        text=_valid_with("  depth: 2\n", "  depth: 2\n  d\u0435pth: 2\n"),
    ),
    Case(
        "confusable_kind",
        "a kind with a Cyrillic 'а' (`kind: lаyernorm`)",
        "13:18: encoder.block.norm.kind: 'l\\u0430yernorm' is not one of layernorm, rmsnorm (it contains "
        "a Cyrillic 'а' (U+0430) that looks like 'a'; did you mean 'layernorm'?)",
        text=_valid_with("kind: layernorm", "kind: l\u0430yernorm"),
    ),
    Case(
        "line_separator",
        "a U+2028 LINE SEPARATOR in a comment, with a real error further down (PyYAML breaks the line there)",
        "1:15: a line separator (U+2028): a line break to YAML that editors do not show, so every later line "
        "would be numbered wrong (delete it; inside double quotes, write it as the escape \\u2028)",
        text=_valid_with("specvit: 1", "specvit: 1 # a\u2028b").replace(b"heads: 12", b"heads: -1"),
    ),
    Case(
        "nel_in_value",
        "a NEL (U+0085) inside a quoted name",
        "2:9: a NEL next-line character (U+0085): a line break to YAML",
        text=_valid_with("name: tiny", 'name: "t\u0085iny"'),
    ),
    Case(
        "nbsp_indent",
        "a no-break space (U+00A0) in the indentation of a key",
        "9:1: a no-break space (U+00A0) in the indentation (indent with plain spaces: retype the start of the line)",
        text=_valid_with("  depth: 2", "\u00a0 depth: 2"),
    ),
    Case(
        "nbsp_after_colon",
        "a no-break space after a key's colon (`heads:\\u00a012`)",
        "11:11: a no-break space (U+00A0) after 'heads:' (write a plain space after the colon)",
        text=_valid_with("heads: 12", "heads:\u00a012"),
    ),
    Case(
        "fullwidth_colon",
        "a fullwidth colon after a key (`depth：2`)",
        "9:8: a fullwidth colon (U+FF1A) after 'depth' (write an ASCII colon: 'depth: ')",
        text=_valid_with("  depth: 2", "  depth\uff1a 2"),
    ),
    Case(
        "fullwidth_digit",
        "a fullwidth digit where a number goes (`depth: ２`)",
        "9:10: encoder.depth: expected an integer, got '\\uff12' (write 2: it contains a Fullwidth '２' "
        "(U+FF12) that looks like '2')",
        text=_valid_with("depth: 2", "depth: \uff12"),
    ),
    Case(
        "node_name_keyword",
        "a block-graph node named after a Python keyword or a module attribute (`name: def`, `training`)",
        "13:16: encoder.block.graph.0.name: 'def' is a Python keyword (rename it, e.g. def_)",
        text=_valid_with(
            "    layers: [self_attention, mlp]\n",
            "    graph:\n      - {name: def, op: self_attention, inputs: [x]}\n"
            "      - {name: training, op: add, inputs: [x, def]}\n",
        ),
    ),
    # --- the spec path itself
    Case(
        "path_missing",
        "a spec path that does not exist",
        "spec 'missing.yaml' does not exist (check the path; bundled presets load by name, e.g. vit_base_patch16_224; specvit presets lists them)",
        spec="missing.yaml",
        error_file=None,
        exit_code=1,  # the path given cannot be read: a file error
    ),
    Case(
        "path_dangling_symlink",
        "a spec path that is a symlink to nothing",
        "spec 'path_dangling_symlink.yaml' does not exist (check the path; bundled presets load by name, e.g. vit_base_patch16_224; specvit presets lists them)",
        setup=_symlink("path_dangling_symlink.yaml", "nowhere.yaml"),
        error_file=None,
        exit_code=1,  # the path given cannot be read: a file error
    ),
    Case(
        "path_directory",
        "a spec path that is a directory",
        "spec 'specs' is a directory (give the path of a .yaml file)",
        setup=_mkdir("specs"),
        spec="specs",
        error_file=None,
        exit_code=1,  # the path given cannot be read: a file error
    ),
    Case(
        "path_fifo",
        "a spec path that is a FIFO nobody writes to",
        "spec 'path_fifo.yaml' is not a regular file but a FIFO (a named pipe: reading it waits for a writer) (give the path of a .yaml file)",
        setup=_mkfifo("path_fifo.yaml"),
        error_file=None,
        exit_code=1,  # the path given cannot be read: a file error
    ),
    Case(
        "path_dev_zero",
        "a spec path that is a symlink to /dev/zero (reading it would never end)",
        "spec 'path_dev_zero.yaml' is not a regular file but a character device (give the path of a .yaml file)",
        setup=_symlink("path_dev_zero.yaml", "/dev/zero"),
        error_file=None,
        exit_code=1,  # the path given cannot be read: a file error
    ),
    Case(
        "path_symlink_loop",
        "a spec path that is a symlink to itself (unreadable, even by root)",
        "spec 'path_symlink_loop.yaml' cannot be read: Too many levels of symbolic links",
        setup=_symlink("path_symlink_loop.yaml", "path_symlink_loop.yaml"),
        error_file=None,
        exit_code=1,  # the path given cannot be read: a file error
    ),
    Case(
        "path_unreadable",
        "a spec file with mode 000 (read as user nobody when the tests run as root)",
        "spec 'path_unreadable.yaml' cannot be read (permission denied) (check the file's permissions)",
        setup=_unreadable,
        error_file=None,
        exit_code=1,  # the path given cannot be read: a file error
        unprivileged=True,
    ),
]

BY_ID = {case.id: case for case in CASES}


# ------------------------------------------------------------------------------------------ running


@dataclass(frozen=True)
class Outcome:
    """What :func:`specvit.load_spec` did with a case.

    Args:
        first_line: the first line of the SpecError, as printed; None if there was no error.
        seconds: how long the call took.
    """

    first_line: str | None
    seconds: float


def must_drop_privileges(case: Case) -> bool:
    """Whether ``case`` has to run as ``nobody`` for file permissions to apply (it does as root)."""
    return case.unprivileged and hasattr(os, "geteuid") and os.geteuid() == 0


@contextlib.contextmanager
def privileges_dropped(case: Case) -> Iterator[None]:
    """Run the body with the effective user id ``nobody`` if the case needs it, else unchanged."""
    if not must_drop_privileges(case):
        yield
        return
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)


def run_in_process(case: Case, case_dir: Path) -> Outcome:
    """Give the case (already created in ``case_dir``) to :func:`specvit.load_spec`."""
    import specvit

    load = specvit.load_spec  # imports specvit.spec (lazily, on first use) before the clock starts
    first_line = None
    with privileges_dropped(case):
        start = time.process_time()  # CPU time: what the case costs, whatever else the machine runs
        try:
            load(case_dir / case.spec_name)
        except specvit.SpecError as exc:
            first_line = str(exc).splitlines()[0]
        seconds = time.process_time() - start
    return Outcome(first_line, seconds)


# Runs cases as ``python -m specvit.cli validate PATH`` does, less the interpreter's start-up: it imports
# specvit once, and each case runs the CLI module's code as __main__ in a process forked from it, with
# standard output and error sent to files and an alarm for a hang. argv: the jobs as JSON
# ([id, path, uid or null]), the folder for the outputs, the seconds before the alarm.
_FORKED_CLI = r"""
import builtins, importlib.util, json, os, signal, sys, traceback
import specvit.cli, specvit.spec.loader
spec = importlib.util.find_spec("specvit.cli")
code = spec.loader.get_code("specvit.cli")
jobs, out_dir, limit = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
status = {}
for job, path, uid in jobs:
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        exit_code = 1
        try:
            for fd, name in ((1, "out"), (2, "err")):
                os.dup2(os.open(os.path.join(out_dir, f"{job}.{name}"), os.O_WRONLY | os.O_CREAT, 0o600), fd)
            signal.alarm(limit)
            if uid is not None:
                os.seteuid(uid)
            sys.argv = [spec.origin, "validate", path]
            exec(code, {"__name__": "__main__", "__file__": spec.origin, "__package__": "specvit",
                        "__spec__": spec, "__builtins__": builtins})
            exit_code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                exit_code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(exit_code)
    status[job] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(status))
"""


def cli_runs(
    cases: list[Case], dirs: dict[str, Path], limit: int
) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every case through the CLI as ``python -m specvit.cli validate`` runs it (as ``nobody`` when it must
    drop privileges), each in a process of its own forked from one that imported specvit: what each run
    returned, printed and wrote to standard error. A run killed by its alarm after ``limit`` seconds has
    the return code ``-SIGALRM``.

    Args:
        cases: the cases.
        dirs: each case's directory, by id, made by ``case.create``.
        limit: seconds before a case counts as hanging.
    """
    jobs = [(c.id, str(dirs[c.id] / c.spec_name), NOBODY if must_drop_privileges(c) else None) for c in cases]
    with tempfile.TemporaryDirectory(prefix="specvit-cli-") as out:
        runner = subprocess.run(
            [sys.executable, "-c", _FORKED_CLI, json.dumps(jobs), out, str(limit)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=True,
        )
        status = json.loads(runner.stdout)
        return {
            job: subprocess.CompletedProcess(
                [sys.executable, "-m", "specvit.cli", "validate", path],
                status[job],
                *(
                    Path(out, f"{job}.{name}").read_text(encoding="utf-8", errors="replace")
                    for name in ("out", "err")
                ),
            )
            for job, path, _ in jobs
        }


def cli_command(case: Case, case_dir: Path) -> list[str]:
    """The command that validates the case through the CLI (as ``nobody`` when it must drop privileges)."""
    path = str(case_dir / case.spec_name)
    if must_drop_privileges(case):
        # python itself lives under /root, which nobody cannot enter: drop the user after start-up
        code = (
            "import os, sys, specvit.cli, specvit.spec.loader; "
            f"os.seteuid({NOBODY}); sys.exit(specvit.cli.main(sys.argv[1:]))"
        )
        return [sys.executable, "-c", code, "validate", path]
    return [sys.executable, "-m", "specvit.cli", "validate", path]


def snapshot(case_dir: Path) -> dict[str, tuple[int, int, int, bytes | None]]:
    """Every entry under ``case_dir`` (symlinks not followed): mode, size, mtime and small files' bytes."""
    out: dict[str, tuple[int, int, int, bytes | None]] = {}
    for entry in sorted(case_dir.rglob("*")):
        info = entry.lstat()
        data = None
        if stat.S_ISREG(info.st_mode) and info.st_size <= 2**20:
            with contextlib.suppress(PermissionError):
                data = entry.read_bytes()
        out[str(entry.relative_to(case_dir))] = (info.st_mode, info.st_size, info.st_mtime_ns, data)
    return out


def shown(line: str, case_dir: Path) -> str:
    """``line`` with the case's directory left out of every path, as the docs show it."""
    return line.replace(f"{case_dir}{os.sep}", "")


@contextlib.contextmanager
def traversable_tmpdir() -> Iterator[Path]:
    """A temporary directory that every user can enter (so that ``nobody`` meets only the file's mode)."""
    with tempfile.TemporaryDirectory(prefix="specvit-robustness-") as tmp:
        path = Path(tmp).resolve()
        path.chmod(0o711)
        yield path


# ---------------------------------------------------------------------------------------------- docs

_INTRO = """\
# Robustness: what bad input gets

<!-- Generated by `python tests/robustness_cases.py` from the table in tests/robustness_cases.py;
     tests/test_robustness.py fails when this file is stale. Do not edit by hand. -->

A spec is untrusted input. Whatever a spec file holds, specvit answers with a `SpecError` that lists every
problem at once, each as `file:line:col: key.path: message (hint)`; `specvit validate` prints them and
exits with status 2, never with a traceback. Where there is no line to point at (the path does not exist,
is a directory, cannot be read), the message names the path and the status is 1, as for any file error. Every input below gets its answer within
1 second, and `specvit validate` only reads: the files it is given are left as they were.

The policy:

- **Safe YAML only.** Mappings, lists, strings, numbers, booleans and null. Any other tag
  (`!!python/object/apply:...`, `!!binary`, `!!timestamp`, `!local`) is refused by name and nothing is
  constructed from it, so a spec cannot run code. Duplicate keys are errors, not "last one wins".
- **Bounded.** A spec file is at most 1 MiB (larger files are refused before they are read), nests at
  most 64 levels deep, and holds at most 10,000 values, counted after aliases (`*name`) and merge keys
  (`<<`) are expanded, so that no file can hang specvit or exhaust its memory. An alias may not refer to
  a collection that contains it. A chain of `extends` is at most 32 files long, holds at most 1 MiB in
  all and 10,000 values in all (the limits hold for the chain, not for each file) and may not loop; it
  names regular files only (a FIFO or a device would wait forever for input).
- **Regular files only, in and out.** Every file a user names is read through one function
  (`specvit.io.read_regular`): spec files, `extends` bases, an HF `config.json` and each file of a
  checkpoint. A FIFO, a device (`/dev/zero`, `/dev/urandom`, through a symlink or not), a socket or a
  directory is refused by its `stat` before it is opened (and by `fstat` after an open that cannot
  block), and a file over its limit is refused by its size before a byte is read: a spec 1 MiB, a
  config.json 16 MiB, a weight file the size its safetensors header gives (so a sparse file of many GB
  is refused after reading 8 bytes). Outputs (`-o`) replace regular files only: a device, a FIFO or a
  link to `/proc/self/fd/1` is refused and left as it was, and no command writes over its inputs.
- **An HF config is input too.** Each field `from_hf` reads is checked for its type (integers are
  integers and not booleans, floats are finite numbers, strings are strings); every problem names
  `config.<field>` and the file, also when the spec made of the config fails its own validation.
- **YAML 1.2 where YAML 1.1 differs.** `2024-05-01` and `=` are strings, as YAML 1.2 reads them (PyYAML's
  YAML 1.1 makes a timestamp and a "value" tag of them), and `0o17` is an integer. The forms YAML 1.1 and
  1.2 read as different values are refused with the fix: `012` (octal 10, or 12), `08` (a string, or 8),
  `1_000` and `12:48` (numbers, or strings), `0b101`, and `yes`/`no`/`on`/`off` (booleans, or strings);
  the hint gives the number to write, or says to quote the value for a string. A mapping has at most one
  merge key (`<<`); merge several mappings with `<<: [*a, *b]`.
- **Nothing reaches the terminal raw.** Every key, value and file name echoed in a message has its
  control characters (ANSI escape sequences, carriage returns, newlines) and invisible characters
  (zero-width spaces, bidirectional overrides) written as escapes (`\\x1b`, `\\u202e`), so a spec cannot
  clear the screen, fake an "ok" line or hide text; one problem is always one line. Characters that pass
  for ASCII letters (a Cyrillic `е` in `dеpth`, a fullwidth `ｗ`) are shown escaped (`d\\u0435pth`) and
  named ("it contains a Cyrillic 'е' (U+0435) that looks like 'e'").
- **Slow is bounded, not absent.** PyYAML's scanner is pure Python and reads roughly 0.3 to 1 MB a
  second, so a document near the limits (a 1 MiB comment, 1 MiB of blank lines, 10,000 keys and values)
  takes a few seconds to refuse or accept; the limits are what keep that from growing.
- **Numbers are never quoted.** `heads: "12"` is refused with the hint "write the number without quotes:
  12", and `heads: true` is refused too: in YAML a quoted value is a string and `true` is a boolean. If
  specvit converted them, a typo such as `"12 "` or `"1e3"` would be read as a number it does not say,
  editors using the JSON Schema (`specvit schema`) would flag what `specvit validate` accepts, and
  `spec.to_yaml()` would not give back the file. A spec means what its YAML types say.
- **Every problem at once.** Type errors, unknown keys and missing keys are reported together, each at
  its own line; the cross-field rules (divisibility, which attention goes where) run once the types are
  right.

The inputs tried, and the first error line each gets (the temporary directory left out of the paths):

"""

_BEYOND_INTRO = """
## Beyond the spec file

What else a hostile input can be, and what specvit does; each row names the test that checks it.

"""

_OUTRO = """
Besides these tables, `tests/test_robustness.py` gives `specvit.parse_spec` random bytes and random
YAML-like text built from YAML tokens and spec keys (Hypothesis), and `tests/fuzz_parse_spec.py` fuzzes
it with coverage guidance (atheris; `make fuzz`): every outcome must be a spec or a `SpecError`.
`tests/test_hostile_text.py` gives the command line random `--set` items drawn from the `KEY.KEY=VALUE`
grammar (keys, indices, non-ASCII digits, empty parts, escape sequences, YAML values): every outcome is
status 0 or 2 and lines safe to print. `tests/test_checkpoint_unit.py` damages checkpoint directories at
random (flipped, truncated, deleted, emptied files, files of another save): every load gives back the
saved model exactly or raises a `CheckpointError`. `tests/test_hostile_hf.py` gives `from_hf` configs of
random field types: every outcome is a spec that builds or a `SpecError` naming a config field.
"""


@dataclass(frozen=True)
class Beyond:
    """A hostile input that is not a spec file, what specvit does with it, and the test that checks it.

    Args:
        id: a short name.
        input: what the input is.
        outcome: what specvit does.
        test: ``file::function`` of the test.
    """

    id: str
    input: str
    outcome: str
    test: str


_IO = "tests/test_hostile_io.py::"
_TEXT = "tests/test_hostile_text.py::"
_CK = "tests/test_checkpoint_unit.py::"
_FILES = "tests/test_hostile_files.py::"
_HF = "tests/test_hostile_hf.py::"
_SIG = "tests/test_hostile_signals.py::"
_CALLS = "tests/test_hostile_calls.py::"
_TABLES = "tests/test_hostile_hf_tables.py::"
_WEIGHTS = "tests/test_hostile_weights.py::"

BEYOND: list[Beyond] = [
    Beyond("checkpoint_concurrent_saves", "two processes save different models into one directory at once",
           "a save puts its files in place under an exclusive lock on the directory: one after the other, "
           "and the last loads whole",
           _CK + "test_a_second_save_waits_for_the_first"),
    Beyond("checkpoint_mixed", "one save's `spec.yaml` beside another save's weights (the lock bypassed)",
           "`CheckpointError`: the file is not the one `checkpoint.json` (SHA-256 of both) was written for",
           _CK + "test_a_save_inside_another_save_never_loads_as_a_mix"),
    Beyond("checkpoint_interrupted", "a save killed (SIGKILL, power loss) after renaming its weights into "
           "place, before its spec", "`CheckpointError`: `checkpoint.json` is missing, the checkpoint is "
           "incomplete (the renames remove the manifest first and put it last)",
           _CK + "test_an_interrupted_save_never_loads"),
    Beyond("checkpoint_signal", "SIGTERM, SIGINT or SIGHUP while `save_pretrained(overwrite=True)` writes",
           "the files are written in a hidden directory first: the old checkpoint stays and loads, the "
           "hidden directory is removed, and the process ends by the signal",
           _SIG + "test_a_signal_while_a_save_writes_leaves_the_old_checkpoint"),
    Beyond("checkpoint_signal_commit", "a signal while a save renames its files into place",
           "held until the renames are done: the new checkpoint loads whole",
           _SIG + "test_a_signal_while_a_save_renames_waits_until_the_new_one_is_whole"),
    Beyond("write_signal", "SIGTERM, SIGHUP or SIGINT while render, eject, export or import writes its output",
           "the temporary file is removed, the old output is left, and the process ends by the signal",
           _SIG + "test_a_signal_during_any_atomic_write_removes_its_temporary_file"),
    Beyond("checkpoint_special_file", "a checkpoint file that is a FIFO, a link to `/dev/zero` or "
           "`/dev/urandom`, a sparse 8 GiB file or a directory", "`CheckpointError` naming the file, "
           "read by `read_regular`; `export --checkpoint` exits 2 with one line",
           _FILES + "test_every_file_of_a_checkpoint_is_read_only_if_regular"),
    Beyond("checkpoint_sparse_weights", "a weight file grown to 64 GiB (sparse)", "`CheckpointError` after "
           "reading its 8-byte header: its header describes another size",
           _FILES + "test_a_weight_file_of_another_size_than_its_header_says_is_refused_unread"),
    Beyond("checkpoint_float8", "weights stored as float8 (all of them, or one)", "`CheckpointError` at "
           "load naming the dtype the model cannot compute in; `dtype=` casts",
           _FILES + "test_weights_in_a_dtype_the_model_cannot_compute_in_are_refused_at_load"),
    Beyond("checkpoint_dtype", "a weight stored as int64, or as float64 among float32 ones",
           "`CheckpointError` naming each tensor and its dtype; a checkpoint of one dtype loads in it",
           _CK + "test_tensors_of_the_wrong_dtype_are_named"),
    Beyond("checkpoint_damaged", "random damage to any file of a checkpoint (Hypothesis)",
           "the saved model exactly, or `CheckpointError`", _CK + "test_a_damaged_checkpoint_loads_whole_or_not_at_all"),
    Beyond("output_special", "`-o` onto a link to `/dev/null`, `/dev/full` or `/proc/self/fd/1`, or a "
           "FIFO (render, eject, export, schema, import, diff)", "refused with one line, status 1; the node "
           "and the link are left as they were", _FILES + "test_an_output_that_is_not_a_regular_file_is_refused_and_left"),
    Beyond("output_long_name", "`-o` of a valid 254- or 255-byte file name", "written: the temporary file's "
           "name is cut to fit 255 bytes", _FILES + "test_an_output_of_any_valid_name_length_is_written"),
    Beyond("diff_input", "`diff A B -o A` (or `-o B`)", "refused before writing: `-o` is the spec itself",
           _FILES + "test_diff_refuses_to_write_over_its_specs"),
    Beyond("cwd_deleted", "a command run in a working directory that was deleted",
           "one line saying the working directory no longer exists; presets by name still load",
           _FILES + "test_a_deleted_working_directory_is_named"),
    Beyond("stdout_full", "standard output that cannot be written (`> /dev/full`)",
           "`cannot write to standard output: No space left on device`, status 1, no second error at exit",
           _FILES + "test_a_full_standard_output_is_named"),
    Beyond("cli_ctrl_c", "Ctrl-C (SIGINT) while a command runs", "`specvit CMD: interrupted`, status 130, "
           "no traceback", _SIG + "test_ctrl_c_in_the_cli_is_one_line_and_status_130"),
    Beyond("cli_ctrl_c_start", "Ctrl-C while the command starts (specvit.cli's imports, the argument parsing), "
           "or through code made by `exec` (dataclasses) under `python -m`", "`specvit: interrupted`, status "
           "130 (`python -m` ended by SIGINT, -2: CPython kept such an interrupt marked unhandled once caught); "
           "CPython's own start and `import specvit` (the first 30 to 90 ms) print Python's traceback, as for "
           "any Python program", _SIG + "test_ctrl_c_while_the_cli_starts_is_one_line_and_status_130"),
    Beyond("hf_config_file", "`import hf` / `from_hf` of a config.json that is a FIFO, a device, a sparse "
           "4 GiB file or a directory", "`SpecError` naming the file; the CLI exits 1 with one line",
           _HF + "test_a_config_that_is_not_a_regular_file_is_refused"),
    Beyond("hf_config_types", "`hidden_size: \"64\"`, `hidden_act: [\"silu\"]`, `rope_scaling: \"linear\"`, zero "
           "heads, an int `id2label`, `hidden_size: -64`", "`SpecError` at `config.<field>` and the file (not "
           "at the spec key the value became)", _HF + "test_config_fields_are_typed_and_named"),
    Beyond("hf_config_nesting", "a config.json of 100,000 nested arrays", "`SpecError`: the JSON nests too "
           "deeply; values are shown clipped", _HF + "test_deeply_nested_arrays_are_a_spec_error"),
    Beyond("hf_config_fuzz", "Llama, GPT-2 and BERT configs with random types per field (Hypothesis)",
           "a spec that builds, or a `SpecError` at `config.<field>`", _HF + "test_any_config_gives_a_spec_or_a_spec_error"),
    Beyond("render_input", "`render model.mmd -o model.mmd`, through a symlink, or over a base of `extends`",
           "refused before writing: `-o` is the spec itself (render, eject and export alike)",
           _IO + "test_no_command_writes_over_its_input"),
    Beyond("render_fallback_dot", "`render -o hand.svg` without Graphviz beside an existing `hand.dot`",
           "the `.dot` source is written only where no file is; an existing one is left and the message "
           "says so", _IO + "test_the_dot_fallback_never_replaces_a_file"),
    Beyond("write_error", "a write that fails (disk full) or an output under a file (`-o afile/x.mmd`)",
           "the message names the output the user gave (`afile is a file, not a directory`), never the "
           "hidden temporary file", _IO + "test_write_errors_name_the_output_not_the_temporary_file"),
    Beyond("render_expanded_huge", "`render --view expanded` of a 1,024-layer spec (6,000 boxes)",
           "refused at once: at most 1,000 boxes are drawn; the collapsed view draws it",
           _IO + "test_an_expanded_render_is_bounded_in_boxes"),
    Beyond("export_huge_input", "`export` of a valid spec whose example input would take 6.4 GB",
           "`SpecError` before anything is allocated: example inputs take at most 256 MiB (or half the "
           "memory available)", _IO + "test_export_refuses_a_huge_example_input_without_a_traceback"),
    Beyond("cgroup_limit", "a build under a container (cgroup v1 or v2) memory limit below `MemAvailable`",
           "refused before allocating, naming the cgroup limit", _IO + "test_a_build_over_the_cgroup_limit_is_refused"),
    Beyond("set_non_ascii_digit", "`--set layers.²=mlp` (an index written with a non-ASCII digit)",
           "`SpecError` at `<--set ...>`: write list indices with the digits 0-9",
           _TEXT + "test_an_index_with_a_non_ascii_digit_is_refused"),
    Beyond("set_unknown_key", "`--set encoder.x.y=1` (an unknown key, created by `--set`)",
           "the problem is located at `<--set encoder.x.y=1>`, not at a line of the file",
           _TEXT + "test_problems_from_set_say_they_came_from_set"),
    Beyond("set_grammar", "random `--set` items (Hypothesis)", "status 0 or 2, never a traceback",
           _TEXT + "test_any_set_items_give_a_spec_or_a_clear_error"),
    Beyond("export_checkpoint_mismatch", "`export --checkpoint DIR` whose weights do not match its spec",
           "`specvit export: the weights in ... do not match ...`, status 2",
           _IO + "test_export_of_a_mismatched_checkpoint_is_a_message"),
    Beyond("export_without_extra", "`export` without `onnx` or `onnxscript` installed",
           "`ONNX export needs the package 'onnxscript' ...: pip install 'specvit[export]'`, status 1",
           _IO + "test_export_without_its_extra_says_what_to_install"),
    Beyond("summary_zero", "`summary --seq-len 0` (or a negative size, or `--batch 0`)",
           "refused by the argument parser: must be >= 1", _IO + "test_sizes_must_be_positive"),
    Beyond("python_cycle", "`parse_spec(d)` where `d` contains itself", "`SpecError` at the key path where it does",
           _TEXT + "test_a_mapping_that_contains_itself_is_a_spec_error"),
    Beyond("python_numpy", "NumPy integers, floats and booleans in a spec dict or in overrides",
           "read as the Python numbers they are; other objects are a `SpecError` naming their type",
           _TEXT + "test_numpy_numbers_are_numbers"),
    Beyond("generate_arguments", "`generate(top_k=0)`, an empty prompt, ids outside the vocabulary",
           "`ValueError` / `TypeError` saying which argument and why",
           _IO + "test_generate_refuses_bad_arguments_with_the_right_errors"),
    Beyond("call_token_dtype", "token ids as uint8, int8, int16, bool or float (`model(ids.byte())`)",
           "`InputError`: `x: expected integer token ids, got torch.uint8; pass x.long()`",
           _CALLS + "test_token_ids_of_a_dtype_an_embedding_cannot_take_say_long"),
    Beyond("call_mask_dtype", "a float or int 0/1 (or 0/-inf) padding mask", "`InputError` saying to pass "
           "`mask.bool()` (True marks padding), or `mask == 0` for HF's attention_mask",
           _CALLS + "test_a_padding_mask_that_is_not_bool_says_what_to_pass"),
    Beyond("call_device", "ids, images or a mask on another device than the weights (meta ids into a CPU "
           "model returned garbage)", "`InputError` naming both devices: `pass x.to('cpu')`",
           _CALLS + "test_an_input_on_another_device_than_the_weights_is_refused"),
    Beyond("call_none", "`model(None)`, `model(src, None)`", "`InputError`: `x: expected a tensor of ... got None`",
           _CALLS + "test_a_required_input_given_as_none_is_named"),
    Beyond("call_decoding", "`offset=\"1\"`, `offset=-1`, `cache=5`", "`InputError` naming the argument and "
           "what it takes", _CALLS + "test_decoding_arguments_are_typed"),
    Beyond("generate_types", "`generate(p, \"5\")`, a `pad_id` or `eos_id` beyond the vocabulary (or int64), "
           "`use_cache=\"no\"`, `generator=5`", "`TypeError` / `ValueError` naming the argument, before "
           "anything runs", _CALLS + "test_generate_names_each_wrong_argument"),
    Beyond("build_arguments", "`build_model(dtype=torch.int64 / complex64 / float8, device=\"gpu\")`, "
           "`overrides=[...]` (a list)", "`ValueError` / `TypeError` naming the argument and what to pass "
           "(`specvit.argcheck`)", _CALLS + "test_build_model_names_each_wrong_argument"),
    Beyond("graph_sizes", "`build_graph(batch=2.5)`, `seq_len=0`, `seq_len=\"8\"`", "`TypeError` / "
           "`ValueError` naming the size (`seq_len=0` was read as the default)",
           _CALLS + "test_build_graph_sizes_are_positive_integers"),
    Beyond("overrides_type", "`load_spec(path, overrides=[\"encoder.depth=1\"])` (a list or a string)",
           "`TypeError`: overrides must be a mapping, and how to make one from `--set` items",
           _CALLS + "test_overrides_that_are_not_a_mapping_are_a_type_error"),
    Beyond("save_arguments", "`save_pretrained` of a plain `nn.Module`, or a `state_dict` with a key missing, "
           "extra, of another shape, dtype (float8) or not a tensor", "`TypeError` / `ValueError` naming "
           "each mismatch; nothing is written (it wrote a checkpoint that did not load)",
           _CALLS + "test_save_pretrained_refuses_what_would_not_load"),
    Beyond("convert_arguments", "`convert_state_dict` with non-tensor values, a spec that is a name, an "
           "unknown source", "`TypeError` / `ValueError` naming the argument",
           _CALLS + "test_convert_state_dict_names_wrong_arguments"),
    Beyond("set_deep_path", "`--set a.a.a...b=1`: a 60,000-level path (it took 8 GB of memory)",
           "refused before walking it: more keys than the 64 levels a spec nests; the `<--set ...>` shown "
           "is clipped", _CALLS + "test_a_set_path_deeper_than_a_spec_nests_is_refused_at_once"),
    Beyond("summary_collapsed_deep", "`summary` of a valid 1,024-layer spec of 16 sublayers (collapsed view)",
           "folded in one pass over the graph (a lookup per block scanned every node: minutes, now seconds)",
           _CALLS + "test_the_collapsed_view_folds_a_deep_stack_of_many_sublayers_into_one_run"),
    Beyond("render_dpi", "`render -o vit.png --dpi 2400` (the largest dpi): 600 million pixels, 2.4 GB as "
           "Graphviz draws", "refused after the layout, before a pixel is drawn: a PNG has at most 100,000,000 "
           "pixels and 32,767 a side; the message gives the largest dpi that fits",
           _IO + "test_a_png_is_bounded_in_pixels_by_dpi_times_layout"),
    Beyond("hf_config_every_field", "every field every HF family reads (its table's fields and the reads seen), "
           "given a quoted number, a word, control characters, a list, a mapping, true, 2.5, 0, -64, 10**30, "
           "NaN, Infinity, 500 nested lists or 100,000 items", "a spec, or a `SpecError` at `config.<field>` "
           "naming the file; a value of another JSON type is always refused at its field (a depth of 10**30 "
           "was looped over; sliding_window: 0 and a T5 d_model of 0 ended in tracebacks)",
           _TABLES + "test_every_field_of_every_family_gives_a_spec_or_names_itself"),
    Beyond("hf_import_every_family", "`import hf` of each family's config with a quoted integer", "status 2, one "
           "line naming the file and `config.<field>`, nothing written",
           _TABLES + "test_the_cli_refuses_a_wrong_type_in_one_line_and_writes_nothing"),
    Beyond("hf_weights_header", "a model directory's `model.safetensors` whose header lies: offsets past the end "
           "or beyond any file, overlapping, reversed, negative or not integers, a shape of other bytes, an "
           "unknown dtype, a header length of 2**63, a header that is not JSON or nests 100,000 deep",
           "`SpecError` naming the file, after reading its header", _WEIGHTS +
           "test_a_lying_header_in_a_model_directory_is_named"),
    Beyond("checkpoint_forged_header", "the same headers in a specvit checkpoint whose `checkpoint.json` was "
           "forged to match them", "`CheckpointError` naming the weight file", _WEIGHTS +
           "test_a_lying_header_in_a_forged_checkpoint_is_named"),
    Beyond("distributed_exit", "`torchrun --nproc_per_node 2 examples/train.py ... --parallel fsdp` (or ddp) that "
           "finishes", "exits 0 every time (20 runs each): a rank leaves by `os._exit` once the run is over, "
           "before the gloo threads that outlive `destroy_process_group()` meet the interpreter's teardown",
           "tests/test_distributed.py::test_a_finished_distributed_run_exits_0_every_time"),
]  # fmt: skip


def _cell(text: str) -> str:
    """``text`` as inline code in a Markdown table cell."""
    text = text.replace("|", "\\|")
    fence = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def render_doc(lines: Mapping[str, str | None]) -> str:
    """docs/robustness.md, from the first error line of every case (by case id)."""
    rows = ["| case | input | first error line |", "|---|---|---|"]
    for case in CASES:
        line = lines[case.id]
        got = _cell(line) if line is not None else "**no error**"
        description = case.input.replace("|", "\\|")
        rows.append(f"| `{case.id}` | {description} | {got} |")
    beyond = ["| case | input | what specvit does | test |", "|---|---|---|---|"]
    for item in BEYOND:
        cells = (item.input.replace("|", "\\|"), item.outcome.replace("|", "\\|"), f"`{item.test}`")
        beyond.append(f"| `{item.id}` | {cells[0]} | {cells[1]} | {cells[2]} |")
    return _INTRO + "\n".join(rows) + "\n" + _BEYOND_INTRO + "\n".join(beyond) + "\n" + _OUTRO


def first_lines() -> dict[str, str | None]:
    """Run every case in-process in a temporary directory: the first error line of each, as shown."""
    out: dict[str, str | None] = {}
    with traversable_tmpdir() as base:
        for case in CASES:
            case_dir = case.create(base)
            line = run_in_process(case, case_dir).first_line
            out[case.id] = None if line is None else shown(line, case_dir)
    return out


def main() -> None:
    """Write docs/robustness.md from the table."""
    from specvit.io import atomic_write

    atomic_write(DOC, render_doc(first_lines()))
    print(f"wrote {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
