"""The spec language: presets, errors at the line, extends, overrides, round trips, safety."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specvit
from specvit import SpecError
from specvit.spec.loader import MAX_BYTES, read_yaml

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted((ROOT / "specs").glob("*.yaml"))

VIT = """specvit: 1
name: tiny
model: encoder
encoder:
  input: {kind: image, size: 32, patch: 8, channels: 3}
  prefix: {cls: true}
  position: learned
  width: 64
  depth: 2
  block:
    heads: 4
    layers: [self_attention, mlp]
    norm: {kind: layernorm, placement: pre, eps: 1.0e-6}
    mlp: {ratio: 4, activation: gelu}
head: {kind: classifier, pool: cls, classes: 10}
"""

SEQ = """specvit: 1
name: seq
model: encoder_decoder
encoder:
  input: {kind: tokens, vocab: 100}
  position: sincos
  width: 32
  depth: 1
  block: {heads: 4, layers: [self_attention, mlp]}
decoder:
  input: {kind: tokens, vocab: 100}
  position: {kind: learned, max_len: 64}
  width: 32
  depth: 1
  block: {heads: 4, layers: [masked_self_attention, cross_attention, mlp]}
shared_embeddings: true
head: {kind: lm, tied: true}
"""

# (base, text to replace, replacement, the first problem exactly as printed)
BAD = [
    (
        VIT,
        "specvit: 1",
        "specvit: 2",
        "t.yaml:1:10: specvit: format version 2 is not supported by this specvit (this specvit reads format version 1; upgrade specvit to read newer specs)",
    ),
    (
        VIT,
        "specvit: 1\n",
        "",
        "t.yaml:1:1: specvit: missing required key 'specvit' (start the file with 'specvit: 1', the format version)",
    ),
    (
        VIT,
        "name: tiny",
        'name: "bad name!"',
        "t.yaml:2:7: name: 'bad name!' is not a valid name (use only letters, digits, '_', '.' and '-': the name becomes a file name)",
    ),
    (
        VIT,
        "model: encoder",
        "model: encodr",
        "t.yaml:3:8: model: 'encodr' is not one of encoder, decoder, encoder_decoder (did you mean 'encoder'?)",
    ),
    (
        VIT,
        "model: encoder",
        "model: decoder",
        "t.yaml:1:1: decoder: a model of kind decoder needs a decoder section (add decoder: with input, position, width, depth and block)",
    ),
    (
        VIT,
        "model: encoder",
        "model: encoder_decoder",
        "t.yaml:1:1: decoder: a model of kind encoder_decoder needs a decoder section (add decoder: with input, position, width, depth and block)",
    ),
    (
        VIT,
        "size: 32",
        "size: 30",
        "t.yaml:5:41: encoder.input.patch: image size 30 is not divisible by patch 8 (use a patch size that divides 30, such as 6 or 10)",
    ),
    (VIT, "patch: 8", "patch: 0", "t.yaml:5:41: encoder.input.patch: must be >= 1, got 0"),
    (
        VIT,
        "patch: 8",
        "patch: [8, 8, 8]",
        "t.yaml:5:41: encoder.input.patch: expected one integer or [height, width], got a list of 3",
    ),
    (VIT, "channels: 3", "channels: -1", "t.yaml:5:54: encoder.input.channels: must be >= 1, got -1"),
    (
        VIT,
        "channels: 3",
        'channels: "3"',
        "t.yaml:5:54: encoder.input.channels: expected an integer, got '3' (write the number without quotes: 3)",
    ),
    (
        VIT,
        "kind: image",
        "kind: imag",
        "t.yaml:5:17: encoder.input.kind: 'imag' is not one of image, tokens, features, signal, queries, siamese, unmask, latents, feature_map (did you mean 'image'?)",
    ),
    (
        VIT,
        "kind: image,",
        "channels2: 1, kind: image,",
        "t.yaml:5:11: encoder.input.channels2: unknown key 'channels2' (did you mean 'channels'?)",
    ),
    (
        VIT,
        "prefix: {cls: true}",
        "prefix: {cls: yes please}",
        "t.yaml:6:17: encoder.prefix.cls: expected true or false, got 'yes please' (write true or false without quotes)",
    ),
    (
        VIT,
        "prefix: {cls: true}",
        "prefix: {cls: true, registers: -4}",
        "t.yaml:6:34: encoder.prefix.registers: must be >= 0, got -4",
    ),
    (
        VIT,
        "position: learned",
        "position: learnd",
        "t.yaml:7:13: encoder.position.kind: 'learnd' is not one of none, learned, sincos, sincos2d, sine2d, alibi, disentangled, relative, relative2d, rope, rope2d, relative_decomposed (did you mean 'learned'?)",
    ),
    (
        VIT,
        "position: learned",
        "position: {kind: learned, max_len: 10}",
        "t.yaml:7:38: encoder.position.max_len: the image gives 17 positions, not 10 (remove max_len: it is derived from the image and patch sizes)",
    ),
    (
        VIT,
        "position: learned",
        "position: {kind: sincos2d, base: .nan}",
        "t.yaml:7:36: encoder.position.base: must be a finite number, got nan",
    ),
    (
        VIT,
        "width: 64",
        "width: 1000000000000000000000000000000",
        "t.yaml:8:10: encoder.width: must be <= 65536, got 1000000000000000000000000000000",
    ),
    (VIT, "width: 64", "width: 0", "t.yaml:8:10: encoder.width: must be >= 1, got 0"),
    (VIT, "width: 64", "width: 64.5", "t.yaml:8:10: encoder.width: expected an integer, got 64.5"),
    (
        VIT,
        "depth: 2",
        "depth: true",
        "t.yaml:9:10: encoder.depth: expected an integer, got true (booleans are not numbers here; write a number)",
    ),
    (
        VIT,
        "depth: 2",
        'depth: "2"',
        "t.yaml:9:10: encoder.depth: expected an integer, got '2' (write the number without quotes: 2)",
    ),
    (
        VIT,
        "  depth: 2\n",
        "",
        "t.yaml:4:1: encoder.depth: missing required key 'depth' (add depth: under encoder)",
    ),
    (
        VIT,
        "heads: 4",
        "heads: 5",
        "t.yaml:11:12: encoder.block.heads: width 64 is not divisible by 5 heads (use a divisor of 64 such as 4 or 8, or set block.head_dim)",
    ),
    (
        VIT,
        "heads: 4",
        "heads: 4\n    kv_heads: 3",
        "t.yaml:12:15: encoder.block.kv_heads: 4 heads are not divisible by kv_heads=3 (use a divisor of 4 such as 2 or 4)",
    ),
    (
        VIT,
        "heads: 4",
        "heads: 4\n    head_dim: 14\n    heads2: 1",
        "t.yaml:13:5: encoder.block.heads2: unknown key 'heads2' (did you mean 'heads'?)",
    ),
    (
        VIT,
        "heads: 4",
        "heads: 4\n    hedas: 4",
        "t.yaml:12:5: encoder.block.hedas: unknown key 'hedas' (did you mean 'heads'?)",
    ),
    (
        VIT,
        "[self_attention, mlp]",
        "[self_attention, mlp]\n    qkv_bias: [true, false]",
        "t.yaml:13:15: encoder.block.qkv_bias: qkv_bias lists the biases of q, k and v: 3 values, got 2 (write [true, false, true] for q and v biases without a k bias)",
    ),
    (
        VIT,
        "[self_attention, mlp]",
        "[self_attention, cross_attention, mlp]",
        "t.yaml:12:30: encoder.block.layers.1: cross_attention needs an encoder to attend to (cross_attention belongs in the decoder of an encoder_decoder model)",
    ),
    (VIT, "[self_attention, mlp]", "[]", "t.yaml:12:13: encoder.block.layers: needs at least 1 item, got 0"),
    (
        VIT,
        "[self_attention, mlp]",
        "[self_atention, mlp]",
        "t.yaml:12:14: encoder.block.layers.0: 'self_atention' is not one of self_attention, masked_self_attention, cross_attention, mlp, class_attention, sagan_attention (did you mean 'self_attention'?)",
    ),
    (
        VIT,
        "kind: layernorm",
        "kind: batchnorm",
        "t.yaml:13:18: encoder.block.norm.kind: 'batchnorm' is not one of layernorm, rmsnorm (use one of layernorm, rmsnorm)",
    ),
    (
        VIT,
        "placement: pre",
        "placement: middle",
        "t.yaml:13:40: encoder.block.norm.placement: 'middle' is not one of pre, post, sandwich, res_post (use one of pre, post, sandwich, res_post)",
    ),
    (VIT, "eps: 1.0e-6", "eps: 0", "t.yaml:13:50: encoder.block.norm.eps: must be > 0.0, got 0"),
    (
        VIT,
        "eps: 1.0e-6",
        "eps: .inf",
        "t.yaml:13:50: encoder.block.norm.eps: must be a finite number, got inf",
    ),
    (VIT, "ratio: 4", "ratio: -1", "t.yaml:14:18: encoder.block.mlp.ratio: must be > 0.0, got -1"),
    (
        VIT,
        "activation: gelu",
        "activation: gelo",
        "t.yaml:14:33: encoder.block.mlp.activation: 'gelo' is not one of gelu, gelu_tanh, quick_gelu, relu, relu2, silu, xielu, swiglu, geglu, geglu_tanh (did you mean 'gelu'?)",
    ),
    (
        VIT,
        "pool: cls",
        "pool: mean, classes2: 1",
        "t.yaml:15:38: head.classes2: unknown key 'classes2' (did you mean 'classes'?)",
    ),
    (
        VIT,
        "prefix: {cls: true}",
        "prefix: {cls: false}",
        "t.yaml:15:32: head.pool: pool cls needs a class token (set encoder.prefix.cls: true, or use pool: mean)",
    ),
    (VIT, "classes: 10", "classes: 0", "t.yaml:15:46: head.classes: must be >= 1, got 0"),
    (
        VIT,
        "kind: classifier",
        "kind: lm",
        "t.yaml:15:18: head.pool: unknown key 'pool' (valid keys: kind, vocab, tied, bias, ops, scale, softcap)",
    ),
    (
        VIT,
        "head: {kind: classifier, pool: cls, classes: 10}",
        "head: {pool: cls, classes: 10}",
        "t.yaml:15:7: head: needs a 'kind' key (add kind: one of classifier, lm, detection, patches, none, map, distilled, neck)",
    ),
    (
        VIT,
        "head: {kind: classifier, pool: cls, classes: 10}",
        "head: [1, 2]",
        "t.yaml:15:7: head: expected a mapping of keys, got a list (write the keys of this section indented below it)",
    ),
    (
        VIT,
        "encoder:\n",
        "encoder: 5\nx:\n",
        "t.yaml:4:10: encoder: expected a mapping of keys, got 5 (write the keys of this section indented below it)",
    ),
    (
        VIT,
        "position: learned",
        "position: rope\n  dropout: {attention: 1.5}",
        "t.yaml:8:24: encoder.dropout.attention: must be < 1.0, got 1.5",
    ),
    (
        SEQ,
        "model: encoder_decoder",
        "model: decoder",
        "s.yaml:5:3: encoder: a model of kind decoder has no encoder (remove the encoder section, or set model: encoder_decoder)",
    ),
    (
        SEQ,
        "{kind: tokens, vocab: 100}\n  position: sincos",
        "{kind: features, dim: 16, project: false}\n  position: sincos",
        "s.yaml:5:45: encoder.input.project: features of dim 16 cannot pass through to width 32 without a projection (set project: true, or make dim equal to width)",
    ),
    (
        SEQ,
        "position: sincos",
        "position: sincos2d",
        "s.yaml:6:13: encoder.position: sincos2d positions need an image input (a 2D grid of patches) (use sincos for tokens inputs)",
    ),
    (
        SEQ,
        "{heads: 4, layers: [self_attention, mlp]}",
        "{heads: 4, head_dim: 7, layers: [self_attention, mlp]}\n  position2: none",
        "s.yaml:10:3: encoder.position2: unknown key 'position2' (did you mean 'position'?)",
    ),
    (
        SEQ,
        "position: {kind: learned, max_len: 64}",
        "position: learned",
        "s.yaml:12:13: decoder.position.max_len: learned positions of a tokens input need a max_len (set the longest sequence, e.g. max_len: 512)",
    ),
    (
        SEQ,
        "[masked_self_attention, cross_attention, mlp]",
        "[masked_self_attention, mlp]",
        "s.yaml:15:29: decoder.block.layers: the decoder never reads the encoder (add cross_attention to the decoder's layers)",
    ),
    (
        SEQ,
        "input: {kind: tokens, vocab: 100}\n  position: {kind",
        "input: {kind: tokens, vocab: 100, padding_idx: 100}\n  position: {kind",
        "s.yaml:11:50: decoder.input.padding_idx: padding_idx 100 is outside the vocabulary of 100 (use an id below 100)",
    ),
    (
        SEQ,
        "input: {kind: tokens, vocab: 100}\n  position: {kind",
        "input: {kind: tokens, vocab: 50}\n  position: {kind",
        "s.yaml:16:20: shared_embeddings: encoder embeds 100x32 but decoder 50x32 (make vocab and width equal on both stacks, or set shared_embeddings: false)",
    ),
    (
        SEQ,
        "head: {kind: lm, tied: true}",
        "head: {kind: lm, tied: true, vocab: 99}",
        "s.yaml:17:37: head.vocab: a tied lm head has the embedding's vocab 100, not 99 (remove head.vocab, or set tied: false)",
    ),
    (
        SEQ,
        "head: {kind: lm, tied: true}",
        "head: {kind: classifier, classes: 3, pool: mean}\nextra: 1",
        "s.yaml:18:1: extra: unknown key 'extra' (valid keys: specvit, name, description, model, encoder, decoder, head, shared_embeddings, init)",
    ),
]


def _first_problem(text: str, source: str) -> str:
    with pytest.raises(SpecError) as info:
        specvit.parse_spec(text, source=source)
    return str(info.value.problems[0])


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_preset_validates_and_round_trips(preset: Path) -> None:
    spec = specvit.load_spec(preset)
    assert spec.name == preset.stem
    again = specvit.parse_spec(spec.to_yaml())
    assert again == spec
    assert again.to_yaml() == spec.to_yaml()


def test_bases_are_valid() -> None:
    assert specvit.parse_spec(VIT).encoder is not None
    assert specvit.parse_spec(SEQ).decoder is not None


@pytest.mark.parametrize(
    ("base", "old", "new", "expected"), BAD, ids=[f"{i}-{r[2][:30]}" for i, r in enumerate(BAD)]
)
def test_bad_spec_points_at_the_line(base: str, old: str, new: str, expected: str) -> None:
    assert old in base
    source = "t.yaml" if base is VIT else "s.yaml"
    assert _first_problem(base.replace(old, new, 1), source) == expected


def test_every_problem_is_reported_at_once() -> None:
    text = VIT.replace("heads: 4", "heads: 5").replace("depth: 2", "depth: -1").replace("gelu", "gelo")
    with pytest.raises(SpecError) as info:
        specvit.parse_spec(text, source="t.yaml")
    paths = [p.path for p in info.value.problems]
    assert paths == [
        "encoder.depth",
        "encoder.block.mlp.activation",
    ]  # field errors first; rules need a valid spec
    lines = str(info.value).splitlines()
    assert lines[0].startswith("t.yaml:9:10: encoder.depth: must be >= 0, got -1")


def test_rope_needs_even_head_dim() -> None:
    text = SEQ.replace("position: sincos", "position: rope").replace(
        "{heads: 4, layers: [self", "{heads: 4, head_dim: 7, layers: [self"
    )
    assert _first_problem(text, "s.yaml") == (
        "s.yaml:6:13: encoder.position: rope needs an even head dim, got 7 "
        "(pick heads (or head_dim) so that width/heads is even)"
    )


def test_spec_error_is_value_error_with_fields() -> None:
    with pytest.raises(ValueError) as info:
        specvit.parse_spec(VIT.replace("heads: 4", "heads: 5"), source="vit.yaml")
    problem = info.value.problems[0]  # type: ignore[attr-defined]
    assert (problem.path, problem.location.file, problem.location.line, problem.location.col) == (
        "encoder.block.heads",
        "vit.yaml",
        11,
        12,
    )
    assert "divisor of 64" in problem.hint


# ------------------------------------------------------------------------------------------------- YAML


def test_yaml_1e_notation_is_a_float() -> None:
    spec = specvit.parse_spec(VIT.replace("eps: 1.0e-6", "eps: 1e-5"))
    assert spec.encoder is not None and spec.encoder.block.norm.eps == 1e-5


def test_anchors_aliases_and_merge_keys_work() -> None:
    spec = specvit.load_spec(ROOT / "specs" / "transformer_base.yaml")
    assert spec.encoder is not None and spec.decoder is not None
    assert spec.decoder.width == spec.encoder.width == 512
    assert spec.decoder.block.layers == ["masked_self_attention", "cross_attention", "mlp"]
    assert spec.encoder.block.layers == ["self_attention", "mlp"]


def test_duplicate_keys_are_errors() -> None:
    text = VIT.replace("  depth: 2\n", "  depth: 2\n  depth: 3\n")
    assert _first_problem(text, "t.yaml") == (
        "t.yaml:10:3: encoder.depth: duplicate key 'depth' (first at line 9) "
        "(a key may appear once per mapping; delete one of them)"
    )


def test_object_tags_are_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    text = VIT.replace("name: tiny", f"name: !!python/object/apply:os.system ['touch {marker}']")
    msg = _first_problem(text, "t.yaml")
    assert msg.startswith("t.yaml:2:7: name: the tag !!python/object/apply:os.system is refused")
    assert not marker.exists()


def test_tabs_get_a_hint() -> None:
    msg = _first_problem(VIT.replace("    heads: 4", "\theads: 4"), "t.yaml")
    assert msg.startswith("t.yaml:11:1: a tab character")
    assert "indent with spaces" in msg


def test_syntax_error_has_line_and_column() -> None:
    msg = _first_problem(VIT.replace("size: 32, patch: 8", "size: [32, patch: 8"), "t.yaml")
    assert msg.startswith("t.yaml:5:") and "YAML syntax error" in msg


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "t.yaml:1:1: the file holds no YAML document"),
        ("# only a comment\n", "t.yaml:1:1: the file holds no YAML document"),
        ("- 1\n- 2\n", "t.yaml:1:1: the spec must be a mapping of keys at the top level, got a list"),
        ("42\n", "t.yaml:1:1: the spec must be a mapping of keys at the top level, got 42"),
    ],
    ids=["empty", "comment", "list", "scalar"],
)
def test_documents_that_are_not_specs(text: str, expected: str) -> None:
    assert _first_problem(text, "t.yaml").startswith(expected)


def test_not_utf8() -> None:
    msg = _first_problem(VIT.encode().replace(b"tiny", b"t\xffny"), "t.yaml")
    assert msg.startswith("t.yaml:2:8: the file is not UTF-8 text (byte 0xff")


def test_alias_bomb_fails_fast() -> None:
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    msg = _first_problem("\n".join(lines), "bomb.yaml")  # refused once 10,000 values are made, not 10^9
    assert "expands to more than 10000 values" in msg


def test_deep_nesting_is_refused() -> None:
    msg = _first_problem("a: " + "[" * 5000 + "]" * 5000, "deep.yaml")
    assert "nests deeper than 64 levels" in msg


def test_size_limit() -> None:
    msg = _first_problem("# " + "x" * MAX_BYTES, "big.yaml")
    assert "over the 1,048,576-byte limit" in msg


def test_read_yaml_keeps_positions() -> None:
    data, source = read_yaml("a:\n  b: [1, 2]\n", "f.yaml")
    assert data == {"a": {"b": [1, 2]}}
    assert str(source.locate(("a", "b", 1))) == "f.yaml:2:10"
    assert str(source.locate(("a", "b"), key=True)) == "f.yaml:2:3"


# ---------------------------------------------------------------------------------------------- extends


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_extends_merges_and_errors_point_into_the_base(tmp_path: Path) -> None:
    _write(tmp_path / "base.yaml", VIT)
    child = _write(
        tmp_path / "child.yaml", "specvit: 1\nextends: base.yaml\nname: child\nencoder:\n  depth: 6\n"
    )
    spec = specvit.load_spec(child)
    assert spec.name == "child" and spec.encoder is not None and spec.encoder.depth == 6
    assert spec.encoder.width == 64
    assert str(spec.locate("encoder.depth")).endswith("child.yaml:5:10")
    assert str(spec.locate("encoder.width")).endswith("base.yaml:8:10")

    _write(tmp_path / "base.yaml", VIT.replace("heads: 4", "heads: 5"))
    with pytest.raises(SpecError) as info:
        specvit.load_spec(child)
    assert str(info.value).split(": encoder.block.heads")[0].endswith("base.yaml:11:12")


def test_extends_cycle(tmp_path: Path) -> None:
    _write(tmp_path / "a.yaml", "specvit: 1\nextends: b.yaml\n")
    _write(tmp_path / "b.yaml", "specvit: 1\nextends: a.yaml\n")
    with pytest.raises(SpecError, match=r"extends forms a cycle: a.yaml -> b.yaml -> a.yaml"):
        specvit.load_spec(tmp_path / "a.yaml")


@pytest.mark.parametrize(("target", "message"), [("missing.yaml", "does not exist"), (".", "is a directory")])
def test_extends_bad_target(tmp_path: Path, target: str, message: str) -> None:
    child = _write(tmp_path / "c.yaml", f"specvit: 1\nextends: {target}\n")
    with pytest.raises(SpecError) as info:
        specvit.load_spec(child)
    assert message in str(info.value)
    assert "c.yaml:2:10" in str(info.value)


def test_spec_path_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="does not exist"):
        specvit.load_spec(tmp_path / "nope.yaml")
    with pytest.raises(SpecError, match="is a directory"):
        specvit.load_spec(tmp_path)
    if os.geteuid() != 0:  # root reads everything
        locked = _write(tmp_path / "locked.yaml", VIT)
        locked.chmod(0)
        with pytest.raises(SpecError, match="permission denied"):
            specvit.load_spec(locked)


# -------------------------------------------------------------------------------------------- overrides


def test_overrides_apply_last_and_are_validated(tmp_path: Path) -> None:
    path = _write(tmp_path / "v.yaml", VIT)
    spec = specvit.load_spec(path, overrides={"encoder.depth": 6, "encoder.block.layers.1": "mlp"})
    assert spec.encoder is not None and spec.encoder.depth == 6
    with pytest.raises(SpecError) as info:
        specvit.load_spec(path, overrides={"encoder.block.heads": 5})
    assert str(info.value.problems[0]).startswith(
        "<override encoder.block.heads>: encoder.block.heads: width 64"
    )


# -------------------------------------------------------------------------------------------------- CLI


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specvit.cli", *args], capture_output=True, text=True, cwd=ROOT
    )


def test_cli_validate_ok_and_no_torch() -> None:
    code = (
        "import sys, specvit.cli; rc = specvit.cli.main(['validate', 'specs/vit_base_patch16_224.yaml']); "
        "assert 'torch' not in sys.modules; sys.exit(rc)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == (
        "ok  vit_base_patch16_224: encoder, encoder image depth=12 width=768 heads=12, head=classifier"
    )


def test_cli_validate_errors_exit_2_without_traceback(tmp_path: Path) -> None:
    bad = _write(tmp_path / "bad.yaml", VIT.replace("heads: 4", "heads: 5").replace("gelu", "gelo"))
    run = _cli("validate", str(bad), "specs/mnist_vit.yaml", "--set", "name=renamed")
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert run.stderr.splitlines() == [
        f"{bad}:14:33: encoder.block.mlp.activation: 'gelo' is not one of gelu, gelu_tanh, quick_gelu, relu, "
        "relu2, silu, xielu, swiglu, geglu, geglu_tanh (did you mean 'gelu'?)"
    ]
    assert "ok  renamed: encoder" in run.stdout


def test_cli_set_errors() -> None:
    run = _cli("validate", "specs/mnist_vit.yaml", "--set", "encoder.depth")
    assert run.returncode == 2 and "'encoder.depth' is not KEY=VALUE" in run.stderr
    assert "specvit validate: error: argument --set:" in run.stderr  # a usage error, named for its command


def test_cli_schema_is_json_schema() -> None:
    import json

    run = _cli("schema")
    schema = json.loads(run.stdout)
    assert run.returncode == 0
    assert schema["title"] == "Spec"
    whole = schema["$defs"]["Spec"]  # a spec without extends; tests/test_json_schema.py checks the rest
    assert set(whole["required"]) == {"specvit", "name", "model"}
    assert whole["additionalProperties"] is False


def test_cli_help_reads_well() -> None:
    run = _cli("--help")
    assert run.returncode == 0
    for command in ("validate", "schema"):
        assert command in run.stdout


# ----------------------------------------------------------------------------------------- properties

_KEYS = [
    "specvit",
    "name",
    "model",
    "encoder",
    "decoder",
    "head",
    "input",
    "kind",
    "width",
    "depth",
    "block",
    "heads",
    "layers",
    "norm",
    "mlp",
    "position",
    "prefix",
    "cls",
    "vocab",
    "size",
    "patch",
    "extends",
]
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from(["image", "tokens", "learned", "rope2d", "mlp", "pre"]),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.one_of(st.sampled_from(_KEYS), st.text(max_size=8)), inner, max_size=5)
    ),
    max_leaves=20,
)


def _mutate(data: object, draw: st.DrawFn) -> object:
    if isinstance(data, dict) and data:
        key = draw(st.sampled_from(sorted(data)))
        action = draw(st.sampled_from(["drop", "replace", "recurse", "add"]))
        out = dict(data)
        if action == "drop":
            del out[key]
        elif action == "replace":
            out[key] = draw(_VALUES)
        elif action == "add":
            out[draw(st.sampled_from(_KEYS))] = draw(_VALUES)
        else:
            out[key] = _mutate(out[key], draw)
        return out
    if isinstance(data, list) and data:
        i = draw(st.integers(0, len(data) - 1))
        return [*data[:i], _mutate(data[i], draw), *data[i + 1 :]]
    return draw(_VALUES)


@st.composite
def _mutated_presets(draw: st.DrawFn) -> object:
    import yaml

    preset = draw(st.sampled_from([p for p in PRESETS if "extends" not in p.read_text()]))
    data = yaml.safe_load(preset.read_text())
    for _ in range(draw(st.integers(1, 3))):
        data = _mutate(data, draw)
    return data


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutated_presets())
def test_mutated_presets_give_spec_or_spec_error(data: object) -> None:
    import yaml

    for value in (data, yaml.safe_dump(data)):
        try:
            result = specvit.parse_spec(value)  # type: ignore[arg-type]
        except SpecError as exc:
            assert exc.problems
        else:
            assert isinstance(result, specvit.Spec)


@settings(max_examples=300, deadline=None)
@given(_VALUES)
def test_random_documents_give_spec_or_spec_error(data: object) -> None:
    import yaml

    try:
        specvit.parse_spec(yaml.safe_dump(data))
    except SpecError as exc:
        assert exc.problems
