"""Bad input never crashes, never hangs, never runs code, never loses a file.

The table of bad inputs lives in ``tests/robustness_cases.py``; here every case goes through the CLI (each
in a process forked from one interpreter that imported specvit, and a sample also in fresh interpreters, which
must give the same) and through :func:`specvit.load_spec` in-process, ``docs/robustness.md`` is checked against the
table, and ``specvit.parse_spec`` is given random bytes and random YAML-like text (Hypothesis).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specvit
from specvit import SpecError

if __package__:  # tests/ is a package (it has an __init__.py)
    from . import robustness_cases as rc
else:  # tests/ itself is on sys.path
    import robustness_cases as rc

HANG = 20.0  # seconds after which a case counts as hanging (the requirement is 1 s)


class Hang(Exception):
    """Raised in the main thread when a call outlives its hard time limit."""


@contextlib.contextmanager
def hard_timeout(seconds: float) -> Iterator[None]:
    """Turn a hang into a failure: raise :class:`Hang` in the body after ``seconds`` (main thread only)."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _can_switch_user() -> bool:
    """Whether this process may switch its effective user (root without CAP_SETUID may not)."""
    try:
        os.seteuid(os.geteuid())
    except OSError:  # pragma: no cover
        return False
    return True


def _skip_if_privileges_cannot_drop(case: rc.Case) -> None:
    if rc.must_drop_privileges(case) and not _can_switch_user():  # pragma: no cover
        pytest.skip("cannot switch the effective user, so file permissions cannot be tested as root")


def _base_for(case: rc.Case, tmp_path: Path) -> contextlib.AbstractContextManager[Path]:
    """Where a case's directory goes: tmp_path, or a directory nobody can enter when it runs as nobody."""
    return rc.traversable_tmpdir() if rc.must_drop_privileges(case) else contextlib.nullcontext(tmp_path)


# ---------------------------------------------------------------------------------------------- table


# the inputs the issue names ("bad input never crashes, never hangs, never runs code, never loses a file")
REQUIRED = {
    "empty", "comment_only", "root_list", "root_scalar", "not_utf8", "tab_indent", "syntax_error",
    "duplicate_key", "python_object", "alias_bomb", "deep_flow", "deep_block_list", "huge_file",
    "integer_10e30", "zero_size", "negative_size", "nan", "infinity", "bool_for_number", "quoted_number",
    "extends_cycle", "extends_missing", "extends_directory", "path_missing", "path_directory",
    "path_unreadable",
}  # fmt: skip


def _tidy(case_dir: Path) -> None:
    """Delete the case's large files (the 50 MiB one) rather than leave them in the kept tmp dirs."""
    for entry in case_dir.rglob("*"):
        with contextlib.suppress(OSError):
            if entry.is_file() and not entry.is_symlink() and entry.stat().st_size > 2**20:
                entry.unlink()


def test_table_is_well_formed() -> None:
    ids = [case.id for case in rc.CASES]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    assert set(ids) >= REQUIRED, f"missing: {sorted(REQUIRED - set(ids))}"
    assert all(re.fullmatch(r"[a-z0-9_]+", i) for i in ids)
    assert all(case.expected for case in rc.CASES)
    # 1 exactly where the path given cannot be read (no line to point at), 2 for every spec that is read
    assert all(case.exit_code == (1 if case.error_file is None else 2) for case in rc.CASES)


def test_the_base_of_the_cases_is_valid(tmp_path: Path) -> None:
    """The cases break VALID one thing at a time; VALID itself must pass, in-process and through the CLI."""
    assert specvit.parse_spec(rc.VALID).name == "tiny"
    path = tmp_path / "valid.yaml"
    path.write_text(rc.VALID)
    run = subprocess.run(
        [sys.executable, "-m", "specvit.cli", "validate", str(path)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("ok  tiny: encoder")


@pytest.mark.parametrize("case", rc.CASES, ids=[c.id for c in rc.CASES])
def test_case_in_process(case: rc.Case, tmp_path: Path) -> None:
    """load_spec raises a SpecError whose first line is the expected one, at its file:line, within 1 s."""
    _skip_if_privileges_cannot_drop(case)
    with _base_for(case, tmp_path) as base:
        case_dir = case.create(base)
        before = rc.snapshot(case_dir)
        try:
            with hard_timeout(HANG):
                outcome = rc.run_in_process(case, case_dir)
            assert rc.snapshot(case_dir) == before, "the case's files changed"
        finally:
            _tidy(case_dir)
        assert outcome.first_line is not None, "no SpecError"
        assert rc.shown(outcome.first_line, case_dir).startswith(case.expected_line)
        if case.error_name is not None:
            assert re.match(rf"{re.escape(str(case_dir / case.error_name))}:\d+:\d+: ", outcome.first_line)
        assert outcome.seconds < case.seconds, f"took {outcome.seconds:.2f} s"
        if case.must_not_create:
            assert not (case_dir / case.must_not_create).exists(), "the spec ran code"


def _cli_problems(
    case: rc.Case, case_dir: Path, run: subprocess.CompletedProcess[str] | None, before: object
) -> list[str]:
    """What is wrong with the result of validating ``case`` through the CLI (``run``; None: it timed out)."""
    if run is None or run.returncode == -signal.SIGALRM:
        return ["hangs"]
    problems = []
    lines = run.stderr.splitlines()
    first = lines[0] if lines else ""
    if run.returncode != case.exit_code:
        problems.append(f"exit status {run.returncode}, not {case.exit_code}")
    if "Traceback" in run.stderr:
        problems.append("a traceback")
    if not rc.shown(first, case_dir).startswith(case.expected_line):
        problems.append(f"first line {rc.shown(first, case_dir)!r}, not {case.expected_line!r}...")
    if case.error_name is not None and not re.match(
        rf"{re.escape(str(case_dir / case.error_name))}:\d+:\d+: ", first
    ):
        problems.append(f"no {case.error_name}:line:col at the start of {first!r}")
    if run.stdout:
        problems.append(f"output {run.stdout!r}")
    if case.must_not_create and (case_dir / case.must_not_create).exists():
        problems.append("the spec ran code")
    if rc.snapshot(case_dir) != before:
        problems.append("the case's files changed")
    _tidy(case_dir)
    return problems


def _cli_cases() -> list[rc.Case]:
    return [c for c in rc.CASES if not (rc.must_drop_privileges(c) and not _can_switch_user())]


def test_cases_through_the_cli(tmp_path: Path) -> None:
    """Every case through ``specvit validate`` as ``python -m specvit.cli`` runs it, each in a process of its
    own forked from one interpreter that imported specvit (:func:`rc.cli_runs`): one start-up for all."""
    cases = _cli_cases()
    with rc.traversable_tmpdir() as open_base:
        dirs = {c.id: c.create(open_base if rc.must_drop_privileges(c) else tmp_path) for c in cases}
        before = {i: rc.snapshot(d) for i, d in dirs.items()}
        runs = rc.cli_runs(cases, dirs, int(HANG))
        report = [
            f"{c.id}: {'; '.join(problems)}"
            for c in cases
            if (problems := _cli_problems(c, dirs[c.id], runs[c.id], before[c.id]))
        ]
    assert not report, "\n".join(report)


SAMPLE = ["syntax_error", "path_missing", "python_object", "path_unreadable"]
"""Cases also run through a fresh ``python -m specvit.cli`` each: exit statuses 2 and 1, a spec that must not
run code, and the case that runs as ``nobody``."""


def test_forked_runs_are_what_a_fresh_interpreter_gives(tmp_path: Path) -> None:
    """The sample through ``python -m specvit.cli validate`` in a subprocess each: the checks pass, and the
    status, output and error are exactly the forked runs' (so the forked runs stand for the real CLI)."""
    cases = [c for c in _cli_cases() if c.id in SAMPLE]
    assert len(cases) >= len(SAMPLE) - 1  # path_unreadable drops out where the user cannot switch
    with rc.traversable_tmpdir() as open_base:
        dirs = {c.id: c.create(open_base if rc.must_drop_privileges(c) else tmp_path) for c in cases}
        forked = rc.cli_runs(cases, dirs, int(HANG))
        for case in cases:
            before = rc.snapshot(dirs[case.id])
            try:
                run = subprocess.run(
                    rc.cli_command(case, dirs[case.id]),
                    capture_output=True,
                    encoding="utf-8",
                    errors="replace",
                    timeout=HANG + 30,  # generous: Python and specvit start up in this time too
                    cwd=rc.ROOT,
                )
            except subprocess.TimeoutExpired:
                run = None
            assert _cli_problems(case, dirs[case.id], run, before) == [], case.id
            assert run is not None
            got = (forked[case.id].returncode, forked[case.id].stdout, forked[case.id].stderr)
            assert got == (run.returncode, run.stdout, run.stderr), case.id


def test_the_code_case_would_run_code_if_loaded_unsafely(tmp_path: Path) -> None:
    """The marker really is made by that input under an unsafe loader: its absence proves something."""
    case = rc.BY_ID["python_object"]
    case_dir = case.create(tmp_path)
    marker = case_dir / case.must_not_create
    with pytest.raises(SpecError):
        specvit.load_spec(case_dir / case.spec_name)
    assert not marker.exists()
    yaml.unsafe_load((case_dir / case.spec_name).read_text())  # what specvit must never do
    assert marker.exists()


def test_unreadable_path_is_really_unreadable_to_the_user_it_runs_as() -> None:
    """path_unreadable fails because of the file's mode, not because its directory is closed."""
    case = rc.BY_ID["path_unreadable"]
    _skip_if_privileges_cannot_drop(case)
    with rc.traversable_tmpdir() as base:
        case_dir = case.create(base)
        (case_dir / "readable.yaml").write_text(rc.VALID)
        specvit.load_spec(case_dir / "readable.yaml")  # import everything it needs while still root
        with rc.privileges_dropped(case):
            assert specvit.load_spec(case_dir / "readable.yaml").name == "tiny"
            with pytest.raises(PermissionError):
                (case_dir / case.spec_name).read_bytes()


def test_doc_is_current() -> None:
    """docs/robustness.md is what ``python tests/robustness_cases.py`` writes from the table now."""
    assert rc.DOC.read_text(encoding="utf-8") == rc.render_doc(rc.first_lines()), (
        "docs/robustness.md is stale: run `.venv/bin/python tests/robustness_cases.py`"
    )


def test_every_case_beyond_the_spec_file_names_a_test_that_exists() -> None:
    """The second table of docs/robustness.md points at real tests, so it cannot drift from them."""
    import ast

    ids = [item.id for item in rc.BEYOND]
    assert len(ids) == len(set(ids))
    for item in rc.BEYOND:
        file, _, name = item.test.partition("::")
        tree = ast.parse((rc.ROOT / file).read_text())
        assert name in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, item.test


# ------------------------------------------------------------------------------------------ properties


def _spec_or_spec_error(document: str | bytes) -> None:
    """``parse_spec(document)`` gives a Spec, or a SpecError whose every problem is at a line, within
    rc.TIME_LIMIT of CPU time (the cases' bound; a hang fails at HANG seconds)."""
    start = time.process_time()
    with hard_timeout(HANG):
        try:
            result = specvit.parse_spec(document)
        except SpecError as exc:
            assert exc.problems
            for problem in exc.problems:
                assert problem.location is not None and problem.location.line >= 1, str(problem)
                assert str(problem).startswith("<string>:")
        else:
            assert isinstance(result, specvit.Spec)
    seconds = time.process_time() - start
    assert seconds < rc.TIME_LIMIT, f"took {seconds:.2f} s of CPU time"


_TOKENS = [
    "{", "}", "[", "]", ": ", ":", "- ", "-", ", ", ",", "? ", "&a ", "*a", "&b ", "*b", "<<: ", "'", '"',
    "\\", "\\0", "\\x85", "\t", "\n", "\r\n", "\r", " ", "  ", "    ", "#", "# c\n", "---\n", "...\n",
    "%YAML 1.1\n", "%TAG ! tag:yaml.org,2002:\n", "|\n", ">-\n", "~", "null", "true", "no", "0", "1",
    "-1", "12", "1e-6", "1.0e-6", ".nan", ".inf", "-.inf", "0x1f", "0o17", "1_000", "1:30", "9" * 30,
    "!!tag ", "!!str ", "!!int ", "!!float ", "!!bool ", "!!null ", "!!map ", "!!seq ", "!!binary ",
    "!!python/object/apply:os.system ", "!local ", "!", "\x00", "\ufeff", "\x85", "\u2028", "é",
    "specvit", "specvit: 1\n", "name: t\n", "model: encoder\n", "extends", "encoder", "decoder", "head",
    "width", "depth", "heads", "block", "layers", "input", "kind", "image", "tokens", "mlp", "norm",
    "position", "prefix", "cls", "patch", "size", "vocab", "classes", "ratio", "eps", "self_attention",
    "learned", "classifier",
]  # fmt: skip


@st.composite
def _yamlish(draw: st.DrawFn) -> str:
    """Text made of YAML tokens and spec keys: from nothing, or spliced into the valid spec."""
    tokens = draw(st.lists(st.sampled_from(_TOKENS), max_size=60))
    if draw(st.booleans()):
        return "".join(tokens)
    text = rc.VALID
    for token in tokens[:8]:
        at = draw(st.integers(0, len(text)))
        cut = draw(st.integers(0, 3))
        text = text[:at] + token + text[at + cut :]
    return text


# deadline=None: Hypothesis's deadline is wall-clock time, which a loaded machine stretches; the bound is
# checked in CPU time in _spec_or_spec_error
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_random_bytes_give_spec_or_spec_error(data: bytes) -> None:
    _spec_or_spec_error(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_yamlish())
def test_yaml_like_text_gives_spec_or_spec_error(text: str) -> None:
    _spec_or_spec_error(text)
