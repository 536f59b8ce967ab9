"""Hostile input, second round (#17): outputs that never replace what they should not, bounds that hold in
aggregate, and a command line that answers every bad argument with a message, never a traceback."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import specvit
from specvit import SpecError
from specvit.cli import main
from specvit.diagram import MAX_BOXES, RenderError, render
from specvit.export import MAX_EXAMPLE_BYTES, example_inputs
from specvit.graph import build_graph
from specvit.io import atomic_create, atomic_write
from specvit.resources import cgroup_headroom, memory_budget

ROOT = Path(__file__).resolve().parents[1]
MNIST = ROOT / "specs" / "mnist_vit.yaml"


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "model.yaml"
    path.write_text(MNIST.read_text())
    return path


# ------------------------------------------------------------------------------- outputs and inputs


@pytest.mark.parametrize("command", ["render", "eject", "export"])
@pytest.mark.parametrize("which", ["itself", "symlink", "base"])
def test_no_command_writes_over_its_input(
    command: str, which: str, spec: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The spec (named as itself, through a symlink, or as the base it extends) is never the output."""
    before = spec.read_bytes()
    target = tmp_path / "model.mmd"
    spec.rename(target)  # a spec whose name has a diagram's extension: render accepts it as output
    child = tmp_path / "child.yaml"
    child.write_text("specvit: 1\nextends: model.mmd\n")
    link = tmp_path / "link.mmd"
    link.symlink_to(target)
    source, output = {"itself": (target, target), "symlink": (target, link), "base": (child, target)}[which]
    assert main([command, str(source), "-o", str(output)]) == 1
    err = capsys.readouterr().err
    what = "the spec itself" if which != "base" else "the spec's base"
    assert f"specvit {command}: {output}: is {what}" in err and "name another file" in err, err
    assert target.read_bytes() == before


def test_render_in_python_refuses_its_input_too(spec: Path) -> None:
    dot = spec.rename(spec.with_suffix(".dot"))
    before = dot.read_bytes()
    for source in (dot, specvit.load_spec(dot), build_graph(specvit.load_spec(dot))):
        with pytest.raises(FileExistsError, match="is the spec itself"):
            render(source, dot)  # type: ignore[arg-type]
    assert dot.read_bytes() == before


def test_the_dot_fallback_never_replaces_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Graphviz, `-o hand.svg` writes hand.dot beside it only where no hand.dot exists."""
    monkeypatch.setattr("specvit.diagram.graphviz._engine", lambda: None)
    mine = tmp_path / "hand.dot"
    mine.write_text("digraph mine {}")
    with pytest.raises(RenderError) as info:
        render(MNIST, tmp_path / "hand.svg")
    assert mine.read_text() == "digraph mine {}"
    assert "hand.dot exists, so the Graphviz source was not written there" in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["hand.dot"]
    with pytest.raises(RenderError, match=r"wrote .*fresh\.dot instead"):
        render(MNIST, tmp_path / "fresh.svg")
    assert (tmp_path / "fresh.dot").read_text().startswith("digraph")


def test_atomic_create_never_replaces(tmp_path: Path) -> None:
    target = tmp_path / "x.dot"
    assert atomic_create(target, "first")
    assert not atomic_create(target, "second")
    (tmp_path / "dangling.dot").symlink_to(tmp_path / "nowhere")
    assert not atomic_create(tmp_path / "dangling.dot", "x")  # not even through a dangling symlink
    assert target.read_text() == "first" and not (tmp_path / "nowhere").exists()
    assert sorted(os.listdir(tmp_path)) == ["dangling.dot", "x.dot"]


@pytest.mark.parametrize("fail", ["fsync", "replace", "open"])  # open: creating the temporary file
def test_write_errors_name_the_output_not_the_temporary_file(
    fail: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = getattr(os, fail)

    def no_space(*args: object, **kwargs: object) -> object:
        if fail == "open" and not str(args[0]).startswith(str(tmp_path)):  # the spec being read
            return real(*args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / ".x.mmd.123.tmp"))

    monkeypatch.setattr(os, fail, no_space)
    with pytest.raises(OSError) as info:
        atomic_write(tmp_path / "x.mmd", "text")
    assert info.value.filename == str(tmp_path / "x.mmd") and info.value.errno == errno.ENOSPC
    assert main(["render", str(MNIST), "-o", str(tmp_path / "x.mmd")]) == 1
    err = capsys.readouterr().err
    assert err == f"specvit render: {tmp_path / 'x.mmd'}: No space left on device\n"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("output", ["afile/x.mmd", "afile/sub/x.mmd"])
def test_an_output_under_a_file_says_so(
    output: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "afile").write_text("mine")
    assert main(["render", str(MNIST), "-o", str(tmp_path / output)]) == 1
    err = capsys.readouterr().err
    assert f"cannot write it: {tmp_path / 'afile'} is a file, not a directory" in err
    assert "File exists" not in err and (tmp_path / "afile").read_text() == "mine"


# ---------------------------------------------------------------------------------- bounds in aggregate


def test_the_bytes_of_an_extends_chain_are_bounded_in_total(tmp_path: Path) -> None:
    """Four files of 300 KB each: under the limit alone, over it together, refused at the fourth."""
    pad = ("# " + "x" * 1021 + "\n") * 300
    for i in range(4):
        (tmp_path / f"c{i}.yaml").write_text(f"specvit: 1\nextends: c{i + 1}.yaml\n" + pad)
    (tmp_path / "c4.yaml").write_text(MNIST.read_text())
    start = time.process_time()
    with pytest.raises(SpecError) as info:
        specvit.load_spec(tmp_path / "c0.yaml")
    assert time.process_time() - start < 5.0
    assert str(info.value).startswith(
        f"{tmp_path / 'c2.yaml'}:2:10: extends: the extends chain holds more than 1,048,576 bytes: with "
    )
    for i in range(2, 4):  # the control: a chain of two such files loads
        (tmp_path / f"c{i}.yaml").unlink()
    (tmp_path / "c1.yaml").write_text(MNIST.read_text())
    assert specvit.load_spec(tmp_path / "c0.yaml").name == "mnist_vit"


def test_an_expanded_render_is_bounded_in_boxes(tmp_path: Path) -> None:
    graph = build_graph(specvit.load_spec(MNIST, overrides={"encoder.depth": 1024}))
    start = time.process_time()
    with pytest.raises(RenderError) as info:
        render(graph, tmp_path / "x.mmd", view="expanded")
    assert time.process_time() - start < 2.0
    assert f"the expanded view has {len(graph.nx):,} boxes, over the limit of {MAX_BOXES:,}" in str(
        info.value
    )
    assert "--view collapsed" in str(info.value)
    assert not (tmp_path / "x.mmd").exists()
    render(graph, tmp_path / "x.mmd")  # the collapsed view of the same model is drawn
    assert (tmp_path / "x.mmd").read_text().startswith("%%") or (tmp_path / "x.mmd").stat().st_size > 0


def _png_size(path: Path) -> tuple[int, int]:
    """The width and height a PNG file's IHDR states."""
    data = path.read_bytes()[16:24]
    return int.from_bytes(data[:4], "big"), int.from_bytes(data[4:], "big")


def test_a_png_is_bounded_in_pixels_by_dpi_times_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``render --dpi 2400`` (the largest dpi) of a ViT asks for ~600M pixels: refused after the layout, before
    a pixel is drawn, naming the bound and the largest dpi that fits; that dpi is the largest that does."""
    from specvit.diagram import raster

    out = tmp_path / "vit.png"
    vit = str(ROOT / "specs" / "vit_tiny_patch16_224.yaml")
    assert main(["render", vit, "-o", str(out), "--dpi", "2400"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot draw {out} at 2400 dpi: the diagram is " in err, err
    assert f"over the limit of {raster.MAX_PIXELS:,} pixels" in err and "write .svg or .pdf" in err
    fit = int(err.split("use --dpi ")[1].split()[0])
    inches = raster.layout_inches(render(vit).dot)
    assert 96 < fit < 2400 and not out.exists()
    with pytest.raises(RenderError, match=f"cannot draw .* at 2400 dpi: .* use --dpi {fit} or less"):
        render(vit, out, dpi=2400)  # the Python API is bounded alike
    assert not out.exists()
    assert raster.raster_pixels(inches, fit)[0] * raster.raster_pixels(inches, fit)[1] <= raster.MAX_PIXELS
    assert (
        raster.raster_pixels(inches, fit + 1)[0] * raster.raster_pixels(inches, fit + 1)[1]
        > raster.MAX_PIXELS
    )
    assert main(["render", vit, "-o", str(out), "--dpi", "150"]) == 0  # the control: what fits is drawn ...
    assert _png_size(out) == raster.raster_pixels(inches, 150)  # ... at the size predicted, to the pixel
    monkeypatch.setattr(raster, "MAX_SIDE", 1000)  # a side over cairo's limit: Graphviz would shrink it
    assert main(["render", vit, "-o", str(tmp_path / "side.png"), "--dpi", "150"]) == 1
    assert "a side over 1,000 pixels, the most cairo draws" in capsys.readouterr().err
    assert not (tmp_path / "side.png").exists()


def test_example_inputs_are_bounded_before_allocation() -> None:
    spec = specvit.load_spec(
        MNIST,
        overrides={"encoder.input.size": 16384, "encoder.input.patch": 512, "encoder.input.channels": 3},
    )
    graph = build_graph(spec)
    with pytest.raises(SpecError) as info:
        example_inputs(graph, batch=2)
    assert "its example inputs (2 x 3 x 16384 x 16384) need 6.4GB, more than" in str(info.value)
    small = build_graph(specvit.load_spec(MNIST))
    with pytest.raises(SpecError, match="more than the limit given"):
        example_inputs(small, batch=2, max_bytes=1000)
    (x,) = example_inputs(small, batch=__import__("numpy").int64(3))
    assert x.shape == (3, 1, 28, 28) and x.numel() * 4 < MAX_EXAMPLE_BYTES
    with pytest.raises(ValueError, match="batch must be an integer >= 1, got 0"):
        example_inputs(small, batch=0)


def test_export_refuses_a_huge_example_input_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    sets = ["--set", "encoder.input.size=16384", "--set", "encoder.input.patch=512"]
    assert main(["export", str(MNIST), "-o", "/nonexistent/x.onnx", *sets]) == 2
    assert "its example inputs (2 x 1 x 16384 x 16384) need 2.1GB" in capsys.readouterr().err


def _cgroup_root(tmp_path: Path, lines: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(lines)
    (tmp_path / "proc/meminfo").write_text("MemTotal: 64000000 kB\nMemAvailable: 32000000 kB\n")
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("lines", "files", "room"),
    [
        # cgroup v2: the process's own group limit, and a parent's tighter one
        ("0::/box/job\n", {"sys/fs/cgroup/box/job/memory.max": "4000\n", "sys/fs/cgroup/box/job/memory.current": "1000\n"}, 3000),
        ("0::/box/job\n", {"sys/fs/cgroup/box/job/memory.max": "max\n", "sys/fs/cgroup/box/memory.max": "2000\n", "sys/fs/cgroup/box/memory.current": "500\n"}, 1500),
        # in a container the group is the mount point itself
        ("0::/\n", {"sys/fs/cgroup/memory.max": "8000\n", "sys/fs/cgroup/memory.current": "8500\n"}, 0),
        # cgroup v1: memory controller line, 'no limit' written as a huge number
        ("4:memory:/docker/abc\n1:cpu:/\n", {"sys/fs/cgroup/memory/memory.limit_in_bytes": "5000\n", "sys/fs/cgroup/memory/memory.usage_in_bytes": "1000\n"}, 4000),
        ("4:cpuacct,memory:/x\n", {"sys/fs/cgroup/memory/x/memory.limit_in_bytes": "9223372036854771712\n"}, None),
        ("0::/\n", {}, None),
    ],
)  # fmt: skip
def test_cgroup_limits_are_read(tmp_path: Path, lines: str, files: dict[str, str], room: int | None) -> None:
    root = _cgroup_root(tmp_path, lines, files)
    assert cgroup_headroom(root) == room
    budget, what = memory_budget(root)
    if room is None:
        assert (budget, what) == (32000000 * 1024, "the memory available")
    else:
        assert budget == room and "cgroup (container) limit" in what


def test_a_build_over_the_cgroup_limit_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _cgroup_root(
        tmp_path, "0::/\n", {"sys/fs/cgroup/memory.max": "100000\n", "sys/fs/cgroup/memory.current": "0\n"}
    )
    monkeypatch.setattr("specvit.compile.memory_budget", lambda: memory_budget(root))
    with pytest.raises(
        SpecError, match=r"more than the memory left under this process's cgroup \(container\) limit"
    ):
        specvit.build_model(MNIST)
    assert specvit.build_model(MNIST, device="meta").graph.total_params > 100000 // 4


# -------------------------------------------------------------------------------------- command line


@pytest.mark.parametrize(
    "argv", [["--seq-len", "0"], ["--seq-len", "-3"], ["--batch", "0"], ["--seq-len", "x"]]
)
def test_sizes_must_be_positive(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["summary", str(ROOT / "specs" / "gpt2_small.yaml"), *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[0]}: " in err and ("must be >= 1" in err or "is not an integer" in err)


def test_export_of_a_mismatched_checkpoint_is_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    specvit.build_model(MNIST).save_pretrained(tmp_path / "ck")
    (tmp_path / "ck" / "spec.yaml").write_text(
        specvit.load_spec(MNIST, overrides={"encoder.depth": 2}).to_yaml()
    )
    assert main(["export", "--checkpoint", str(tmp_path / "ck"), "-o", str(tmp_path / "x.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"specvit export: the weights in {tmp_path / 'ck' / 'model.safetensors'} do not match"
    )
    (tmp_path / "ck" / "checkpoint.json").unlink()
    assert main(["export", "--checkpoint", str(tmp_path / "ck"), "-o", str(tmp_path / "x.onnx")]) == 2
    assert "checkpoint.json is missing: the checkpoint is incomplete" in capsys.readouterr().err
    assert (
        main(["export", "--checkpoint", str(tmp_path / "ck"), "-o", str(tmp_path / "ck" / "spec.yaml")]) == 1
    )
    assert "is the checkpoint's spec.yaml" in capsys.readouterr().err
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.parametrize("package", ["onnx", "onnxscript"])
def test_export_without_its_extra_says_what_to_install(package: str, tmp_path: Path) -> None:
    code = (
        f"import sys; sys.modules[{package!r}] = None; import specvit.cli; "
        f"sys.exit(specvit.cli.main(['export', {str(MNIST)!r}, '-o', {str(tmp_path / 'x.onnx')!r}]))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr == (
        f"specvit export: ONNX export needs the package '{package}', which is not installed: "
        "pip install 'specvit[export]'\n"
    )
    assert not (tmp_path / "x.onnx").exists()


def test_generate_refuses_bad_arguments_with_the_right_errors() -> None:
    torch.manual_seed(0)
    model = specvit.build_model(
        ROOT / "specs" / "gpt2_small.yaml",
        overrides={
            "decoder.depth": 1,
            "decoder.width": 64,
            "decoder.block.heads": 2,
            "decoder.input.vocab": 50,
        },
    ).eval()
    prompt = torch.randint(0, 50, (2, 3))
    np = __import__("numpy")
    assert model.generate(prompt, np.int64(2), temperature=1.0, top_k=np.int64(3)).shape == (2, 5)
    cases: list[tuple[dict[str, object], type[Exception], str]] = [
        ({"top_k": 0, "temperature": 1.0}, ValueError, "top_k must be >= 1, got 0"),
        ({"top_k": 2.5, "temperature": 1.0}, TypeError, "top_k must be an integer, got float"),
        ({"temperature": float("inf")}, ValueError, "temperature must be a finite number >= 0"),
        ({"temperature": -1.0}, ValueError, "temperature must be a finite number >= 0"),
        ({"eos_id": True}, TypeError, "eos_id must be an integer, got True"),
        ({"max_new_tokens": -1}, ValueError, "max_new_tokens must be >= 0, got -1"),
        (
            {"tokens": torch.zeros(2, 0, dtype=torch.long)},
            ValueError,
            r"the prompt is empty \(shape \[2, 0\]\)",
        ),
        (
            {"tokens": torch.tensor([[3, 50]])},
            ValueError,
            "the prompt holds the id 50, outside the vocabulary 0..49",
        ),
        ({"tokens": torch.tensor([1.0, 2.0])}, ValueError, "the prompt must be a 2-D .* got a 1-D float32"),
        ({"tokens": [[1, 2]]}, TypeError, "the prompt must be a torch.Tensor of token ids, got list"),
    ]
    for kwargs, error, message in cases:
        tokens = kwargs.pop("tokens", prompt)
        steps = kwargs.pop("max_new_tokens", 2)
        with pytest.raises(error, match=message):
            model.generate(tokens, steps, **kwargs)  # type: ignore[arg-type]
