"""Audit of issue #30 (hostile input, third round): every example the issue names, run as a user would.

Not a test module (pytest collects ``test_*.py`` only): a script that prints one line per example,
``PASS``/``FAIL``, the exit status and the first line of the message. PASS means a clear message naming the
file/line/key/argument, a non-zero exit for a refusal, no traceback, no hang (60 s), no file replaced or
half-written, memory bounded (the peak resident size of the child is shown where memory is the question).

    PYTHONPATH=. python tests/hostile_audit.py [WORD ...]   # only the examples whose name holds a WORD
    PYTHONPATH=. python tests/hostile_audit.py --dist       # also the torchrun runs (minutes)

Sizes: the issue's own (a 60,000-level --set path, 100,000 nested arrays, an 8 GiB sparse file, 1,024
layers of 16 sublayers, 21 extends files of 4,900 values, --dpi 2400); the distributed runs are 2-step runs
(the issue's default-length vit_tiny run takes minutes), repeated 3 times each. Special outputs are device
nodes made with mknod under the temporary directory (the same major/minor as /dev/null and /dev/full), so
a failure cannot replace the machine's own. The cgroup limit is a private mount namespace (``unshare -m``)
in which a file holding the limit is bound over the process's own ``memory.limit_in_bytes``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
MNIST = ROOT / "specs" / "mnist_vit.yaml"
SAGAN = ROOT / "specs" / "sagan_attn1_64.yaml"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
TMP = Path(tempfile.mkdtemp(prefix="hostile-audit-"))
TIMEOUT = 60.0

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
         "intermediate_size": 128, "vocab_size": 100}  # fmt: skip
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 100, "n_positions": 32}
VIT = {"model_type": "vit", "architectures": ["ViTForImageClassification"], "id2label": {"0": "a", "1": "b"}}


@dataclass
class Run:
    rc: int
    out: str
    err: str
    hung: bool = False
    rss_mb: float = 0.0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def first(self) -> str:
        lines = [line for line in self.err.splitlines() if line.strip()] or self.out.splitlines() or [""]
        return lines[0]


def run(argv: list[str], *, cwd: Path | None = None, stdout: object = None, timeout: float = TIMEOUT,
        signals: tuple[float, int] | None = None, wait_for: str | None = None) -> Run:  # fmt: skip
    """Run ``argv``; kill it after ``timeout`` (hung); ``signals=(delay, signum)`` sends a signal after delay
    seconds (counted from the line ``wait_for`` on stdout, if given). Peak RSS by wait4."""
    start = time.monotonic()
    p = subprocess.Popen(
        argv, cwd=cwd, env=ENV, stdin=subprocess.DEVNULL, start_new_session=True,
        stdout=stdout if stdout is not None else subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    chunks: dict[str, list[bytes]] = {"out": [], "err": []}
    ready = threading.Event()

    def pump(stream: object, key: str) -> None:
        for line in iter(stream.readline, b""):  # type: ignore[attr-defined]
            chunks[key].append(line)
            if wait_for and key == "out" and wait_for.encode() in line:
                ready.set()

    threads = [threading.Thread(target=pump, args=(p.stderr, "err"), daemon=True)]
    if p.stdout is not None:
        threads.append(threading.Thread(target=pump, args=(p.stdout, "out"), daemon=True))
    for t in threads:
        t.start()
    if signals is not None:
        if wait_for:
            ready.wait(timeout)
        time.sleep(signals[0])
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signals[1])
    hung = False
    while True:
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() - start > timeout:
            hung = True
            os.killpg(p.pid, signal.SIGKILL)
            pid, status, usage = os.wait4(p.pid, 0)
            break
        time.sleep(0.02)
    p.returncode = os.waitstatus_to_exitcode(status)
    for t in threads:
        t.join(5)
    return Run(
        p.returncode, b"".join(chunks["out"]).decode(errors="replace"), b"".join(chunks["err"]).decode(errors="replace"),
        hung, usage.ru_maxrss / 1024, time.monotonic() - start,
    )  # fmt: skip


def cli(*args: object, **kw: object) -> Run:
    return run([PY, "-m", "specvit.cli", *map(str, args)], **kw)  # type: ignore[arg-type]


API = """
import sys, torch, specvit
def expect(fn):
    try:
        value = fn()
    except Exception as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(3)
    print(f"accepted: {value!r}"[:300])
"""


def api(code: str, **kw: object) -> Run:
    return run([PY, "-c", API + code], **kw)  # type: ignore[arg-type]


CASES: list[tuple[str, Callable[[], tuple[Run, list[str], dict[str, bool]]]]] = []


def case(name: str) -> Callable[[Callable[[], tuple[Run, list[str], dict[str, bool]]]], object]:
    def register(fn: Callable[[], tuple[Run, list[str], dict[str, bool]]]) -> object:
        CASES.append((name, fn))
        return fn

    return register


def verdict(name: str, r: Run, wants: list[str], checks: dict[str, bool], rss_limit: float = 3000) -> bool:
    why = [f"hung {r.seconds:.0f}s"] if r.hung else []
    if "Traceback" in r.err or "Fatal Python" in r.err or "terminate called" in r.err:
        why.append("traceback")
    shown = r.err.replace(str(TMP), "$T")
    why += [f"no '{w}'" for w in wants if w not in shown]
    why += [what for what, ok in checks.items() if not ok]
    if r.rss_mb > rss_limit:
        why.append(f"rss {r.rss_mb:.0f} MB")
    first = r.first.replace(str(TMP), "$T")[:170]
    print(f"{'FAIL' if why else 'PASS'} {name:<30} rc={r.rc:<4} {r.seconds:5.1f}s {r.rss_mb:5.0f}MB  {first}")
    if why:
        print(f"     -> {'; '.join(why)}")
    sys.stdout.flush()
    return not why


def tmpdir(name: str) -> Path:
    d = TMP / name
    d.mkdir(parents=True, exist_ok=True)
    return d


# ------------------------------------------------------------------------ HF configs: import hf / from_hf


def _hf(name: str, config: dict | str, wants: list[str], extra_check: str | None = None) -> None:
    def go() -> tuple[Run, list[str], dict[str, bool]]:
        d = tmpdir(name)
        text = config if isinstance(config, str) else json.dumps(config)
        (d / "config.json").write_text(text)
        r = cli("import", "hf", d, "-o", d / "out.yaml")
        checks = {"rc != 0": r.rc != 0, "nothing written": not (d / "out.yaml").exists(),
                  "names config.json": "config.json" in r.first}  # fmt: skip
        if extra_check:
            checks[f"'{extra_check}' not shown"] = extra_check not in r.err
        return r, wants, checks

    case(name)(go)


_hf("hf_hidden_size_str", {**LLAMA, "hidden_size": "64"}, ["config.hidden_size", "without quotes"])
_hf("hf_hidden_act_list", {**LLAMA, "hidden_act": ["silu"]}, ["config.hidden_act"])
_hf("hf_rope_scaling_str", {**LLAMA, "rope_scaling": "linear"}, ["config.rope_scaling"])
_hf("hf_rope_theta_abc", {**LLAMA, "rope_theta": "abc"}, ["config.rope_theta"])
_hf("hf_zero_heads", {**LLAMA, "num_attention_heads": 0}, ["config.num_attention_heads"])
_hf("hf_id2label_int", {**VIT, "id2label": 3}, ["config.id2label"])
_hf(
    "hf_nested_100k", '{"model_type": "llama", "hidden_act": ' + "[" * 100_000 + "]" * 100_000 + "}", ["nest"]
)
_hf("hf_negative_size", {**LLAMA, "hidden_size": -64}, ["config.hidden_size"])
_hf("hf_gpt2_n_embd_str", {**GPT2, "n_embd": "64"}, ["config.n_embd"], extra_check="64646464")


def _hf_special(name: str, kind: str, wants: list[str], via: str) -> None:
    def go() -> tuple[Run, list[str], dict[str, bool]]:
        d = tmpdir(name)
        path = d / "config.json"
        if kind == "fifo":
            os.mkfifo(path)
        else:
            path.symlink_to(kind)
        if via == "cli":
            r = cli("import", "hf", d, "-o", d / "out.yaml")
        else:
            r = api(f"expect(lambda: specvit.from_hf({str(path)!r}))")
        return r, wants, {"rc != 0": r.rc != 0, "names config.json": "config.json" in r.first}

    case(name)(go)


_hf_special("hf_config_fifo", "fifo", ["FIFO"], "cli")
_hf_special("hf_config_fifo_api", "fifo", ["Error", "FIFO"], "api")
_hf_special("hf_config_dev_zero", "/dev/zero", ["character device"], "cli")


# ------------------------------------------------------------------------ checkpoint directories

SAVE = f"""
torch.manual_seed(0)
m = specvit.build_model({str(MNIST)!r}, overrides={{"encoder.width": 32, "encoder.block.heads": 2,
                                                 "encoder.block.mlp.hidden": 64}})
m.save_pretrained(sys.argv[1], overwrite=True)
"""


def _saved(d: Path) -> Path:
    r = run([PY, "-c", API + SAVE, str(d / "ck")])
    assert r.rc == 0, r.err
    return d / "ck"


def _special(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "sparse":
        with path.open("wb") as f:
            f.truncate(8 << 30)
    else:
        path.symlink_to(kind)


for _file in ("model.safetensors", "spec.yaml", "checkpoint.json"):
    for _kind in ("/dev/zero", "/dev/urandom", "sparse", "fifo"):

        def _ck(file: str = _file, kind: str = _kind) -> tuple[Run, list[str], dict[str, bool]]:
            d = tmpdir(f"ck_{file}_{kind.strip('/').replace('/', '_')}")
            ck = _saved(d)
            _special(ck / file, kind)
            r = api(f"expect(lambda: specvit.load_pretrained({str(ck)!r}))")
            r2 = cli("export", "--checkpoint", ck, "-o", d / "x.onnx")
            r.notes.append(r2.first)
            checks = {"CheckpointError": r.first.startswith("CheckpointError"), "names the file": file in r.first,
                      "cli rc 2": r2.rc == 2, "cli one line": r2.err.count("\n") == 1,
                      "cli no traceback": "Traceback" not in r2.err and not r2.hung}  # fmt: skip
            return r, [], checks

        case(f"ck_{_file.split('.')[0][:5]}_{_kind.strip('/').replace('dev/', '')}")(_ck)


@case("ck_float8")
def _ck_float8() -> tuple[Run, list[str], dict[str, bool]]:
    d = tmpdir("ck_f8")
    code = SAVE.replace("m.save_pretrained(sys.argv[1], overwrite=True)", "") + (
        "import specvit.checkpoint as ck\n"
        "ck.check_weights = lambda *a, **k: []\n"
        "m.save_pretrained(sys.argv[1], state_dict={k: v.to(torch.float8_e4m3fn) for k, v in m.state_dict().items()})\n"
    )
    assert run([PY, "-c", API + code, str(d / "ck")]).rc == 0
    r = api(f"expect(lambda: specvit.load_pretrained({str(d / 'ck')!r}))")
    return r, ["CheckpointError", "float8"], {}


@case("hf_dir_float8_weights")
def _hf_float8() -> tuple[Run, list[str], dict[str, bool]]:
    d = tmpdir("hf_f8")
    code = (
        "import transformers\n"
        f"cfg = transformers.GPT2Config(**{ {k: v for k, v in GPT2.items() if k != 'model_type'}!r})\n"
        "m = transformers.GPT2LMHeadModel(cfg)\n"
        "m.save_pretrained(sys.argv[1])\n"
        "from safetensors.torch import load_file, save_file\n"
        "p = sys.argv[1] + '/model.safetensors'\n"
        "save_file({k: v.to(torch.float8_e4m3fn) for k, v in load_file(p).items()}, p, metadata={'format': 'pt'})\n"
    )
    made = run([PY, "-c", API + code, str(d)], timeout=120)
    assert made.rc == 0, made.err
    r = api(f"expect(lambda: specvit.from_pretrained({str(d)!r})(torch.tensor([[1, 2, 3]])))")
    return (
        r,
        ["model.safetensors", "F8_E4M3"],
        {"rc != 0": r.rc != 0, "not a RuntimeError": not r.first.startswith("RuntimeError")},
    )


@case("hf_dir_fifo_weights")
def _hf_fifo_weights() -> tuple[Run, list[str], dict[str, bool]]:
    d = tmpdir("hf_fifo_weights")
    (d / "config.json").write_text(json.dumps({**GPT2, "architectures": ["GPT2LMHeadModel"]}))
    os.mkfifo(d / "model.safetensors")
    r = api(f"expect(lambda: specvit.from_pretrained({str(d)!r}))")
    return r, ["model.safetensors", "FIFO"], {"rc != 0": r.rc != 0}


# ------------------------------------------------------------------------ line terminators, look-alikes

BASE = MNIST.read_text()


def _text(name: str, old: str, new: str, wants: list[str], count: int = 1) -> None:
    def go() -> tuple[Run, list[str], dict[str, bool]]:
        assert BASE.count(old) >= 1, old
        d = tmpdir(name)
        (d / "spec.yaml").write_text(BASE.replace(old, new, count), encoding="utf-8")
        r = cli("validate", d / "spec.yaml")
        return r, ["spec.yaml:", *wants], {"rc 2": r.rc == 2}

    case(name)(go)


# a real error further down (heads: 3 does not divide 512) must keep its own line number
_WRONG = BASE.replace("heads: 2", "heads: 3")
_text("ls_in_comment", "# The MNIST", "# The\u2028 MNIST", ["U+2028"])
_text("ps_in_string", "description: A one-block", 'description: "A\u2029 one-block', ["U+2029"])
_text("nel_in_comment", "# The MNIST", "# The\x85 MNIST", ["U+0085"])
_text("nel_in_string", "description: A one-block ViT for 28x28 digits (pre-norm, as ViT).",
      'description: "A one-block\x85ViT"', ["U+0085"])  # fmt: skip
_text("nbsp_indent", "  width: 512", "\u00a0 width: 512", ["U+00A0", "indent"])
_text("nbsp_after_colon", "width: 512", "width:\u00a0512", ["U+00A0", "width"])
_text("fullwidth_colon", "depth: 1", "depth\uff1a 1", ["U+FF1A", "depth"])
_text("fullwidth_digit", "depth: 1", "depth: \uff12", ["encoder.depth", "U+FF12", "write 2"])


@case("ls_comment_real_error_line")
def _ls_line() -> tuple[Run, list[str], dict[str, bool]]:
    """The real error's line: with the U+2028 taken out, where does heads: 3 point?"""
    d = tmpdir("ls_line")
    (d / "spec.yaml").write_text(_WRONG.replace("# The MNIST", "# The\u2028 MNIST"), encoding="utf-8")
    (d / "plain.yaml").write_text(_WRONG, encoding="utf-8")
    r = cli("validate", d / "spec.yaml")
    plain = cli("validate", d / "plain.yaml").first.split(":")[1:3]
    r.notes.append(f"plain error at {plain}")
    shown = [line.split(":")[1:3] for line in r.err.splitlines() if "heads" in line]
    return (
        r,
        ["U+2028"],
        {"rc 2": r.rc == 2, f"real error at {plain} (shown {shown})": plain in shown or not shown},
    )


# ------------------------------------------------------------------------ outputs that are not regular files


def _out(name: str, argv: list[str], node: str) -> None:
    def go() -> tuple[Run, list[str], dict[str, bool]]:
        d = tmpdir(name)
        out = d / (
            "x" + {"render": ".mmd", "eject": ".py", "export": ".onnx", "diff": ".dot"}.get(argv[0], ".json")
        )
        if node in ("null", "full"):
            os.mknod(out, 0o666 | stat.S_IFCHR, os.makedev(1, 3 if node == "null" else 7))
        else:
            out.symlink_to(node)
        before = os.lstat(out)
        args = [a.replace("CONFIG", str(d / "config.json")) for a in argv]
        (d / "config.json").write_text(json.dumps(GPT2))
        r = cli(*args, "-o", out)
        after = os.lstat(out)
        same = (before.st_mode, before.st_ino, before.st_rdev) == (after.st_mode, after.st_ino, after.st_rdev)
        return r, ["not a regular file"], {"rc 1": r.rc == 1, "node left": same,
                                           "nothing else": sorted(os.listdir(d)) == sorted([out.name, "config.json"])}  # fmt: skip

    case(name)(go)


for _cmd, _argv in {"render": ["render", str(MNIST)], "eject": ["eject", str(MNIST)],
                    "export": ["export", str(MNIST)], "schema": ["schema"], "import": ["import", "hf", "CONFIG"],
                    "diff": ["diff", str(MNIST), str(MNIST)]}.items():  # fmt: skip
    _out(f"out_chardev_null_{_cmd}", _argv, "null")
_out("out_chardev_full_render", ["render", str(MNIST)], "full")
_out("out_link_proc_fd1_render", ["render", str(MNIST)], "/proc/self/fd/1")
_out("out_link_dev_full_eject", ["eject", str(MNIST)], "/dev/full")


@case("out_254_char_name")
def _long() -> tuple[Run, list[str], dict[str, bool]]:
    d = tmpdir("long")
    out = d / ("v" * 250 + ".mmd")
    r = cli("render", MNIST, "-o", out)
    return r, [], {"rc 0": r.rc == 0, "written": out.exists() and out.stat().st_size > 0,
                   "no temp left": os.listdir(d) == [out.name]}  # fmt: skip


@case("diff_o_onto_spec_a")
def _diff_a() -> tuple[Run, list[str], dict[str, bool]]:
    d = tmpdir("diffa")
    a, b = d / "a.dot", d / "b.yaml"
    shutil.copy(MNIST, a)
    shutil.copy(MNIST, b)
    r = cli("diff", a, b, "-o", a)
    return r, ["spec itself"], {"rc 1": r.rc == 1, "A unchanged": a.read_text() == BASE}


# ------------------------------------------------------------------------ signals

CHILD_SAVE = f"""
torch.manual_seed(1)
m = specvit.build_model({str(MNIST)!r}, overrides={{"encoder.width": 512, "encoder.block.heads": 8,
                        "encoder.block.mlp.hidden": 2048, "encoder.depth": 8}})
print("saving", flush=True)
m.save_pretrained(sys.argv[1], overwrite=True)
print("saved", flush=True)
"""


def _sig_save(name: str, signum: int) -> None:
    def go() -> tuple[Run, list[str], dict[str, bool]]:
        checks: dict[str, bool] = {}
        last = None
        for delay in (0.0, 0.05, 0.2, 0.5, 1.0):
            d = tmpdir(f"{name}_{delay}")
            ck = _saved(d)
            r = run([PY, "-c", API + CHILD_SAVE, str(ck)], signals=(delay, signum), wait_for="saving")
            loads = api(f"expect(lambda: specvit.load_pretrained({str(ck)!r}).spec.encoder.width)")
            left = sorted(p.name for p in d.iterdir())
            checks[f"@{delay}s old or new loads ({loads.first or loads.out.strip()})"] = loads.rc == 0
            checks[f"@{delay}s no temp ({left})"] = left == ["ck"]
            checks[f"@{delay}s ended by the signal or finished (rc {r.rc})"] = r.rc in (
                0,
                -signum,
                128 + signum,
                130,
            )
            last = r
        assert last is not None
        return last, [], checks

    case(name)(go)


_sig_save("sig_save_sigterm", signal.SIGTERM)
_sig_save("sig_save_sigint", signal.SIGINT)


@case("sig_render_sigterm")
def _sig_render() -> tuple[Run, list[str], dict[str, bool]]:
    checks: dict[str, bool] = {}
    last = None
    for delay in (1.0, 2.0, 3.0, 4.0, 6.0):
        d = tmpdir(f"render_{delay}")
        out = d / "out.svg"
        out.write_text("old")
        r = cli(
            "render", "vit_huge_patch14_224", "-o", out, "--view", "expanded", signals=(delay, signal.SIGTERM)
        )
        left = sorted(os.listdir(d))
        text = out.read_text()
        checks[f"@{delay}s no temp ({left})"] = left == ["out.svg"]
        checks[f"@{delay}s old or whole"] = text == "old" or text.rstrip().endswith("</svg>")
        checks[f"@{delay}s no traceback"] = "Traceback" not in r.err
        last = r
    assert last is not None
    return last, [], checks


def _ctrl_c(delays: list[float]) -> tuple[Run, list[str], dict[str, bool]]:
    checks: dict[str, bool] = {}
    last = None
    for delay in delays:
        r = cli("summary", "vit_huge_patch14_224", "--view", "expanded", signals=(delay, signal.SIGINT))
        # finished before the signal, or as it came: at exit CPython puts SIGINT back to its default (-2)
        finished = r.rc in (0, -signal.SIGINT) and "total" in r.out.lower() and not r.err.strip()
        checks[f"@{delay}s status 130 (rc {r.rc})"] = r.rc == 130 or finished
        checks[f"@{delay}s one line ({r.err.strip()[-80:]!r})"] = (
            r.err.count("\n") == 1 or finished
        ) and "Traceback" not in r.err
        last = r
    assert last is not None
    return last, [], checks


# once the interpreter has started and imported the package (it takes 50 to 100 ms here) ...
case("ctrl_c_cli")(lambda: _ctrl_c([0.12, 0.15, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0]))
# ... and before: CPython's own start and `import specvit`, where any Python program prints a traceback
case("ctrl_c_during_startup")(lambda: _ctrl_c([0.0, 0.02, 0.04, 0.06, 0.08, 0.1]))


# ------------------------------------------------------------------------ bounds in aggregate


def _deep_spec(d: Path) -> Path:
    spec = d / "deep.yaml"
    layers = ", ".join(["masked_self_attention", "mlp"] * 8)
    spec.write_text(
        "specvit: 1\nname: deep\nmodel: decoder\ndecoder:\n  input: {kind: tokens, vocab: 12}\n"
        "  position: {kind: learned, max_len: 16}\n  width: 32\n  depth: 1024\n"
        f"  block: {{heads: 2, layers: [{layers}]}}\nhead: {{kind: lm}}\n"
    )
    return spec


@case("deep_collapsed_summary")
def _deep_summary() -> tuple[Run, list[str], dict[str, bool]]:
    r = cli("summary", _deep_spec(tmpdir("deep")))
    return r, [], {"rc 0": r.rc == 0, "folded": "blocks.0-1023" in r.out}


@case("deep_collapsed_render")
def _deep_render() -> tuple[Run, list[str], dict[str, bool]]:
    d = tmpdir("deep_r")
    r = cli("render", _deep_spec(d), "-o", d / "deep.svg")
    return r, [], {"rc 0": r.rc == 0, "drawn": (d / "deep.svg").exists()}


@case("extends_20x4900_values")
def _extends() -> tuple[Run, list[str], dict[str, bool]]:
    d = tmpdir("ext")
    values = ", ".join(["0"] * 4898)  # 4,900 values a file with its key, 15 KB: 300 KB in all
    for i in range(1, 21):
        nxt = f"extends: v{i + 1}.yaml\n" if i < 20 else ""
        (d / f"v{i}.yaml").write_text(f"{nxt}x{i}: [{values}]\n")
    (d / "spec.yaml").write_text("extends: v1.yaml\n" + BASE)
    r = cli("validate", d / "spec.yaml")
    return r, ["10,000 values"], {"rc 2": r.rc == 2, "quick": r.seconds < 30}


@case("render_dpi_2400")
def _dpi() -> tuple[Run, list[str], dict[str, bool]]:
    d = tmpdir("dpi")
    r = cli("render", "vit_tiny_patch16_224", "-o", d / "vit.png", "--dpi", "2400")
    return (
        r,
        ["dpi"],
        {"rc != 0": r.rc != 0, "nothing written": not (d / "vit.png").exists(), "quick": r.seconds < 30},
    )


# ------------------------------------------------------------------------ calls with the wrong things

_M = "specvit.build_model('mnist_vit').eval()"
_D = ("specvit.build_model({'specvit': 1, 'name': 'dec', 'model': 'decoder', 'decoder': {'input': {'kind': "
      "'tokens', 'vocab': 12}, 'position': {'kind': 'learned', 'max_len': 16}, 'width': 32, 'depth': 1, "
      "'block': {'heads': 2, 'layers': ['masked_self_attention', 'mlp']}}, 'head': {'kind': 'lm'}}).eval()")  # fmt: skip
IDS = "torch.tensor([[3, 4, 5, 6, 0], [7, 8, 9, 1, 2]])"
CALLS = {
    "call_float64_images": (f"m = {_M}; expect(lambda: m(torch.randn(2, 1, 28, 28, dtype=torch.float64)))", ["x", "x.float()"]),
    "call_uint8_ids": (f"m = {_D}; expect(lambda: m({IDS}.byte()))", ["tokens", "long()"]),
    "call_model_none": (f"m = {_M}; expect(lambda: m(None))", ["x", "None"]),
    "call_float_mask": (f"m = {_D}; expect(lambda: m({IDS}, key_padding_mask=torch.zeros(2, 5)))", ["key_padding_mask", "bool()"]),
    "call_int_mask": (f"m = {_D}; expect(lambda: m({IDS}, key_padding_mask=torch.zeros(2, 5, dtype=torch.long)))", ["key_padding_mask", "bool()"]),
    "call_meta_ids": (f"m = {_D}; expect(lambda: m({IDS}.to('meta')))", ["tokens", "meta", "to('cpu')"]),
    "generate_prompt_str": (f"m = {_D}; expect(lambda: m.generate({IDS}, '5'))", ["max_new_tokens"]),
    "generate_pad_id_huge": (f"m = {_D}; expect(lambda: m.generate({IDS}, 3, pad_id=1 << 70, eos_id=1))", ["pad_id"]),
    "build_dtype_int64": ("expect(lambda: specvit.build_model('mnist_vit', dtype=torch.int64))", ["dtype", "int64"]),
    "build_dtype_complex64": ("expect(lambda: specvit.build_model('mnist_vit', dtype=torch.complex64))", ["dtype", "complex64"]),
    "save_plain_module": (f"expect(lambda: specvit.save_pretrained(torch.nn.Linear(2, 2), {str(TMP / 'lin')!r}))", ["TypeError", "Linear"]),
    "save_state_missing_key": (f"m = {_M}; s = dict(m.state_dict()); s.pop(next(iter(s))); "
                               f"expect(lambda: m.save_pretrained({str(TMP / 'miss')!r}, state_dict=s))", ["ValueError", "missing"]),
    "convert_non_tensor": ("expect(lambda: specvit.convert_state_dict({'a': 1}, 'timm', specvit.load_spec('vit_tiny_patch16_224')))",
                           ["TypeError", "state_dict['a']"]),
    "load_spec_overrides_list": ("expect(lambda: specvit.load_spec('mnist_vit', overrides=['encoder.depth=1']))", ["TypeError", "overrides"]),
    "build_graph_batch_2.5": ("expect(lambda: specvit.build_graph('mnist_vit', batch=2.5))", ["TypeError", "batch"]),
    "build_graph_seq_len_0": ("expect(lambda: specvit.build_graph('tiny_seq2seq', seq_len=0))", ["ValueError", "seq_len"]),
}  # fmt: skip
for _name, (_code, _wants) in CALLS.items():

    def _call(
        code: str = _code, wants: list[str] = _wants, name: str = _name
    ) -> tuple[Run, list[str], dict[str, bool]]:
        r = api(code)
        ok_type = r.first.split(":")[0] in (
            "InputError",
            "TypeError",
            "ValueError",
            "SpecError",
            "CheckpointError",
        )
        checks = {"raised a typed error": r.rc == 3 and ok_type}
        if name.startswith("save_"):
            checks["nothing written"] = not (TMP / ("lin" if "plain" in name else "miss")).exists()
        return r, wants, checks

    case(_name)(_call)


# ------------------------------------------------------------------------ names that reach generated code


def _node(name: str, node: str, wants: list[str]) -> None:
    def go() -> tuple[Run, list[str], dict[str, bool]]:
        d = tmpdir(name)
        text = (
            SAGAN.read_text()
            .replace("name: attn, op", f"name: {node}, op")
            .replace("[x, attn]", f"[x, {node}]")
        )
        (d / "spec.yaml").write_text(text)
        r = cli("validate", d / "spec.yaml")
        return r, ["spec.yaml:", "graph.0.name", *wants], {"rc 2": r.rc == 2}

    case(name)(go)


_node("node_name_def", "def", ["keyword"])
_node("node_name_training", "training", ["attribute"])


def _eject_path(name: str, filename: str) -> None:
    def go() -> tuple[Run, list[str], dict[str, bool]]:
        d = tmpdir(name)
        spec = d / filename
        shutil.copy(MNIST, spec)
        r = cli("eject", spec, "-o", d / "cli.py")  # the CLI names no path in the file
        made = api(
            f"expect(lambda: specvit.eject({str(spec)!r}, {str(d / 'api.py')!r}) and None)"
        )  # the API does
        checks = {"rc 0": r.rc == 0 and made.rc == 0}
        for out in ("cli.py", "api.py"):
            c = run([PY, "-c", f"import runpy; m = runpy.run_path({str(d / out)!r}); print(m['__doc__'])"])
            checks[f"{out} compiles ({c.first[:80]})"] = c.rc == 0
        checks["api.py's docstring reads back as the path"] = str(spec) in c.out
        return r, [], checks

    case(name)(go)


_eject_path("eject_windows_path", "C:\\Users\\new\\x\\N\\vit.yaml")
_eject_path("eject_triple_quote_name", 'a"""b.yaml')


# ------------------------------------------------------------------------ process environment


@case("cwd_deleted")
def _cwd() -> tuple[Run, list[str], dict[str, bool]]:
    d = tmpdir("cwd")
    gone = d / "gone"
    gone.mkdir()
    r = run(["sh", "-c", f'cd "{gone}" && rmdir "{gone}" && exec "{PY}" -m specvit.cli validate x.yaml'])
    return r, ["working directory"], {"rc 1": r.rc == 1, "no empty name": ": :" not in r.err}


@case("stdout_dev_full")
def _full() -> tuple[Run, list[str], dict[str, bool]]:
    with open("/dev/full", "w") as full:
        r = cli("validate", MNIST, stdout=full)
    return r, ["standard output", "No space left"], {"rc 1": r.rc == 1, "one line": r.err.count("\n") == 1}


# ------------------------------------------------------------------------ the second round's six


@case("set_path_60000_levels")
def _deep_set() -> tuple[Run, list[str], dict[str, bool]]:
    r = cli("validate", MNIST, "--set", "a." * 59_999 + "b=1")
    return r, ["--set", "64 levels"], {"rc 2": r.rc == 2, "short": len(r.err) < 500}


@case("dup_merge_keys")
def _merge() -> tuple[Run, list[str], dict[str, bool]]:
    d = tmpdir("merge")
    text = BASE.replace(
        "encoder:\n", "a: &a {width: 512}\nb: &b {depth: 1}\nencoder:\n  <<: *a\n  <<: *b\n", 1
    )
    text = text.replace("  width: 512\n  depth: 1\n", "")
    (d / "spec.yaml").write_text(text)
    r = cli("validate", d / "spec.yaml")
    return r, ["spec.yaml:", "merge key"], {"rc 2": r.rc == 2}


def _string(name: str, key: str, value: str) -> None:
    def go() -> tuple[Run, list[str], dict[str, bool]]:
        d = tmpdir(name)
        (d / "spec.yaml").write_text(BASE.replace(f"{key}: ", f"{key}: {value}  # was: ", 1))
        r = api(f"s = specvit.load_spec({str(d / 'spec.yaml')!r}); print(repr(s.{key})); "
                f"assert specvit.parse_spec(s.to_yaml()) == s")  # fmt: skip
        return (
            r,
            [],
            {
                "rc 0": r.rc == 0,
                f"read as the string {value!r} ({r.out.strip()})": r.out.strip() == repr(value),
            },
        )

    case(name)(go)


_string("date_in_description", "description", "2024-05-01")
_string("date_as_name", "name", "2024-05-01")
_string("equals_in_description", "description", "=")


@case("build_over_cgroup_limit")
def _cgroup() -> tuple[Run, list[str], dict[str, bool]]:
    line = next(x for x in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in x)
    limit = Path("/sys/fs/cgroup/memory") / line.split(":", 2)[2].lstrip("/") / "memory.limit_in_bytes"
    fake = TMP / "limit"
    fake.write_text("300000000\n")  # 300 MB: vit_base's weights are 350 MB
    code = API + "expect(lambda: specvit.build_model('vit_base_patch16_224'))"
    r = run(["unshare", "-m", "sh", "-c", f'mount --bind "{fake}" "{limit}" && exec "{PY}" -c "$0"', code])
    return r, ["SpecError", "cgroup"], {"rc 3": r.rc == 3}


# ------------------------------------------------------------------------ distributed exit


def _dist(mode: str) -> tuple[Run, list[str], dict[str, bool]]:
    torchrun = str(Path(PY).with_name("torchrun"))
    checks: dict[str, bool] = {}
    last = None
    for i in range(3):
        r = run([torchrun, "--standalone", "--nproc_per_node", "2", str(ROOT / "examples" / "train.py"),
                 str(ROOT / "specs" / "vit_tiny_patch16_224.yaml"), "--parallel", mode, "--steps", "2",
                 "--batch", "4", "-q"], cwd=ROOT, timeout=600)  # fmt: skip
        checks[f"run {i} rc 0 (rc {r.rc})"] = r.rc == 0 and "terminate called" not in r.err
        last = r
    assert last is not None
    return last, [], checks


def main(argv: list[str]) -> int:
    if "--dist" in argv:
        case("dist_fsdp_exit")(lambda: _dist("fsdp"))
        case("dist_ddp_exit")(lambda: _dist("ddp"))
        argv = [a for a in argv if a != "--dist"]
    failed = 0
    print(f"# temporary directory $T = {TMP}")
    for name, fn in CASES:
        if argv and not any(word in name for word in argv):
            continue
        try:
            r, wants, checks = fn()
        except Exception as e:  # the audit's own set-up failing is a FAIL too, not a crash of the audit
            print(f"FAIL {name:<30} audit set-up: {type(e).__name__}: {e}"[:250])
            failed += 1
            continue
        failed += not verdict(name, r, wants, checks)
    print(f"# {failed} failing")
    shutil.rmtree(TMP, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
