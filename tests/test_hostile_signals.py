"""Hostile input, third round: signals. A save interrupted by any signal the process can handle leaves the
previous checkpoint loadable and no temporary file; Ctrl-C in the CLI is one line and status 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import specvit
from specvit.cli import main

ROOT = Path(__file__).resolve().parents[1]
MNIST = ROOT / "specs" / "mnist_vit.yaml"
OLD = {"encoder.width": 32, "encoder.block.heads": 2, "encoder.block.mlp.hidden": 64}
NEW = {"encoder.width": 512, "encoder.block.heads": 8, "encoder.block.mlp.hidden": 2048, "encoder.depth": 8}
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _default_signals() -> None:
    """Each child's start: the signals these tests send at their default action. A child inherits an ignored
    signal (``nohup`` ignores SIGHUP), and specvit leaves an ignored signal ignored, as it should."""
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)


# The child saves the big NEW model over the checkpoint; WHEN says where the signal comes from: sent by the
# parent while the save runs ("external"), or by the child itself right after its weights are staged
# ("staging") or right before its first rename into place ("commit").
_CHILD = """
import os, signal, sys
import torch, specvit
from specvit import checkpoint as ck
directory, when, signum = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(1)
model = specvit.build_model({mnist!r}, overrides={new!r})
hook = {{"staging": "_stage", "commit": "_put"}}.get(when)
if hook:
    real = getattr(ck, hook)
    def signalled(*args):
        if hook == "_put":
            os.kill(os.getpid(), signum)
        real(*args)
        if hook == "_stage":
            os.kill(os.getpid(), signum)
    setattr(ck, hook, signalled)
print("saving", flush=True)
model.save_pretrained(directory, overwrite=True)
print("saved", flush=True)
"""


@pytest.fixture
def old(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    specvit.build_model(MNIST, overrides=OLD).save_pretrained(tmp_path / "ck")
    return tmp_path / "ck"


def _save_and_signal(directory: Path, when: str, signum: int) -> subprocess.CompletedProcess[str]:
    code = _CHILD.format(mnist=str(MNIST), new=NEW)
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(directory), when, str(signum)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        preexec_fn=_default_signals,
    )
    assert child.stdout is not None and child.stdout.readline() == "saving\n"
    if when == "external":
        time.sleep(0.3)
        child.send_signal(signum)
    out, err = child.communicate(timeout=300)
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".") or p.name.endswith(".tmp"))


# SIGINT in the default run; SIGTERM and SIGHUP take the same handler, so they run with the slow tests
@pytest.mark.parametrize(
    "signum",
    [
        pytest.param(signal.SIGTERM, marks=pytest.mark.slow),
        signal.SIGINT,
        pytest.param(signal.SIGHUP, marks=pytest.mark.slow),
    ],
    ids=lambda s: s.name,
)
def test_a_signal_while_a_save_writes_leaves_the_old_checkpoint(signum: int, old: Path) -> None:
    before = {n: (old / n).read_bytes() for n in ("spec.yaml", "model.safetensors", "checkpoint.json")}
    run = _save_and_signal(old, "staging", signum)
    assert run.returncode == -signum, run.stderr  # the process still ends by the signal
    assert "saved" not in run.stdout
    assert _leftovers(old) == []
    assert {n: (old / n).read_bytes() for n in before} == before
    assert specvit.load_pretrained(old).spec == specvit.load_spec(MNIST, overrides=OLD)


@pytest.mark.parametrize(
    "signum", [pytest.param(signal.SIGTERM, marks=pytest.mark.slow), signal.SIGINT], ids=lambda s: s.name
)
def test_a_signal_while_a_save_renames_waits_until_the_new_one_is_whole(signum: int, old: Path) -> None:
    run = _save_and_signal(old, "commit", signum)
    assert run.returncode == -signum, run.stderr
    assert _leftovers(old) == []
    assert specvit.load_pretrained(old).spec == specvit.load_spec(MNIST, overrides=NEW)


@pytest.mark.parametrize(
    "signum", [pytest.param(signal.SIGTERM, marks=pytest.mark.slow), signal.SIGINT], ids=lambda s: s.name
)
def test_a_signal_at_any_moment_of_a_save_leaves_one_whole_checkpoint(signum: int, old: Path) -> None:
    run = _save_and_signal(old, "external", signum)
    assert run.returncode in (-signum, 0), run.stderr
    assert _leftovers(old) == []
    loaded = specvit.load_pretrained(old).spec  # the old one, or the new one if the renames had begun
    assert loaded in (specvit.load_spec(MNIST, overrides=OLD), specvit.load_spec(MNIST, overrides=NEW))
    if run.returncode == 0:
        assert loaded == specvit.load_spec(MNIST, overrides=NEW)


def test_ctrl_c_in_the_cli_is_one_line_and_status_130(tmp_path: Path) -> None:
    code = (
        "import time, specvit.cli as cli\n"
        "cli._load = lambda *a: time.sleep(60)\n"
        "print('ready', flush=True)\n"
        f"raise SystemExit(cli.main(['summary', {str(MNIST)!r}]))\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        preexec_fn=_default_signals,
    )
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    time.sleep(0.2)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 130 and "Traceback" not in err
    assert err == "specvit summary: interrupted\n"


def test_ctrl_c_in_code_made_by_exec_still_ends_with_status_130(tmp_path: Path) -> None:
    """An interrupt that passes through code run by ``exec`` of a string (as dataclasses make their methods)
    stays marked unhandled in CPython once caught: ``python -m`` ended by SIGINT (-2), not with status 130."""
    (tmp_path / "interrupting.py").write_text(
        "import sys, specvit.cli as cli\n"
        "def load(*args):\n"
        "    exec('import os, signal\\nos.kill(os.getpid(), signal.SIGINT)\\nfor i in range(9): pass')\n"
        "cli._load = load if sys.argv[1] == 'exec' else cli._load\n"
        f"sys.exit(cli.main(['validate', {str(MNIST)!r}]))\n"
    )
    env = {**ENV, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    for how in ("exec", "none"):
        run = subprocess.run(
            [sys.executable, "-m", "interrupting", how],
            capture_output=True,
            text=True,
            env=env,
            preexec_fn=_default_signals,
            timeout=60,
        )
        if how == "none":  # the control: uninterrupted, it validates
            assert run.returncode == 0 and run.stdout.startswith("ok  mnist_vit"), run.stderr
        else:
            assert run.returncode == 130 and run.stderr == "specvit validate: interrupted\n", run.stderr


def test_ctrl_c_in_process(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("specvit.cli._load", interrupted)
    assert main(["validate", str(MNIST)]) == 130
    assert capsys.readouterr().err == "specvit validate: interrupted\n"


# Ctrl-C while the command line starts: the child interrupts itself as one of specvit.cli's imports begins
# (the first tenth of a second of every command, before main() ran: a traceback, status 1 or -2)
_STARTING = """
import builtins, os, runpy, signal, sys
real, module = builtins.__import__, sys.argv[1]
def interrupting(name, *args, **kwargs):
    if name == module:
        os.kill(os.getpid(), signal.SIGINT)
    return real(name, *args, **kwargs)
builtins.__import__ = interrupting
sys.argv = ["specvit", "validate", sys.argv[2]]
runpy.run_module("specvit.cli", run_name="__main__")
"""


@pytest.mark.parametrize("module", ["specvit.commands", "specvit.units", "no.such.module"])
def test_ctrl_c_while_the_cli_starts_is_one_line_and_status_130(module: str) -> None:
    run = subprocess.run(
        [sys.executable, "-c", _STARTING, module, str(MNIST)],
        capture_output=True,
        text=True,
        env=ENV,
        preexec_fn=_default_signals,
        timeout=60,
    )
    if module == "no.such.module":  # the control: no interrupt, the command runs
        assert run.returncode == 0 and run.stdout.startswith("ok  mnist_vit"), run.stderr
        return
    assert run.returncode == 130 and run.stderr == "specvit: interrupted\n", run.stderr


def test_ctrl_c_while_the_arguments_are_parsed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("specvit.cli.build_parser", interrupted)
    try:
        status = main(["validate", str(MNIST)])
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt left main()")
    assert status == 130
    assert capsys.readouterr().err == "specvit: interrupted\n"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_during_any_atomic_write_removes_its_temporary_file(signum: int, tmp_path: Path) -> None:
    """render, eject, export and import write through io.atomic_path: a signal mid-write leaves the old file."""
    target = tmp_path / "out.mmd"
    target.write_text("old")
    code = (
        "import os, sys, specvit.io as io\n"
        "with io.atomic_open(sys.argv[1]) as f:\n"
        "    f.write(b'new, half written')\n"
        "    os.kill(os.getpid(), int(sys.argv[2]))\n"
        "    f.write(b' and the rest')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(target), str(signum)],
        capture_output=True,
        env=ENV,
        preexec_fn=_default_signals,
    )
    assert run.returncode == -signum
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.mmd"] and target.read_text() == "old"


# A signal at the worst moments of a temporary's life: right after the directory is made (before the
# caller knows its name) and in the middle of its removal. specvit.signals.temporary holds signals over
# both; tempfile.TemporaryDirectory, the control, leaves the directory behind.
_TEMPORARY = """
import os, shutil, signal, sys, tempfile
from pathlib import Path
from specvit.signals import cleanup_on_signals, temporary
parent, when, impl = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
def kill_then(real):
    def wrapped(*args, **kwargs):
        if when == "remove":
            os.kill(os.getpid(), signal.SIGTERM)
        out = real(*args, **kwargs)
        if when == "create":
            os.kill(os.getpid(), signal.SIGTERM)
        return out
    return wrapped
if when == "create":
    os.mkdir = kill_then(os.mkdir)
else:
    shutil.rmtree = kill_then(shutil.rmtree)
with cleanup_on_signals():
    if impl == "specvit":
        with temporary(parent, ".t-", directory=True) as tmp:
            (tmp / "file").write_bytes(b"x" * 1000)
    else:
        with tempfile.TemporaryDirectory(prefix=".t-", dir=parent) as name:
            (Path(name) / "file").write_bytes(b"x" * 1000)
print("not killed")
"""


@pytest.mark.parametrize("impl", ["specvit", "tempfile"])
@pytest.mark.parametrize("when", ["create", "remove"])
def test_a_signal_while_a_temporary_is_made_or_removed_leaves_nothing(
    when: str, impl: str, tmp_path: Path
) -> None:
    run = subprocess.run(
        [sys.executable, "-c", _TEMPORARY, str(tmp_path), when, impl],
        capture_output=True,
        text=True,
        env=ENV,
        preexec_fn=_default_signals,
    )
    assert run.returncode == -signal.SIGTERM, run.stderr
    left = sorted(p.name for p in tmp_path.iterdir())
    if impl == "tempfile":  # the control: the same signal, the same moment, a directory left behind
        assert len(left) == 1 and left[0].startswith(".t-")
    else:
        assert left == []
