"""Weight files from strangers: every corruption ends in a CheckpointError that says what it is."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from conftest import LLAMA31
from hypothesis import example, given, settings
from hypothesis import strategies as st

from core import CheckpointError, ZooError, load_model
from plugins.formats.safetensors import check_file


@pytest.fixture
def root(checkpoint):
    return checkpoint(LLAMA31)[0]


def weights(root):
    return root / "model.safetensors"


def expect(root, *words):
    with pytest.raises(CheckpointError) as exc:
        load_model(root)
    msg = str(exc.value)
    assert str(weights(root)) in msg
    for w in words:
        assert w in msg
    return msg


def test_truncated(root):
    data = weights(root).read_bytes()
    weights(root).write_bytes(data[: len(data) // 2])
    expect(root, "truncated")


def test_empty(root):
    weights(root).write_bytes(b"")
    expect(root, "empty", "0 bytes")


def test_git_lfs_pointer(root):
    weights(root).write_text(
        "version https://git-lfs.github.com/spec/v1\n"
        "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
        "size 2471645608\n"
    )
    expect(root, "git-LFS pointer", "git lfs pull")


def test_html_page(root):
    weights(root).write_text("<!DOCTYPE html>\n<html><body>Access denied</body></html>")
    expect(root, "HTML page")


def test_header_larger_than_file(root):
    data = weights(root).read_bytes()
    weights(root).write_bytes(struct.pack("<Q", len(data) * 10) + data[8:])
    expect(root, "header claims", "truncated")


def raw_file(path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_overlapping_offsets(tmp_path):
    f = tmp_path / "x.safetensors"
    raw_file(
        f,
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        },
        bytes(12),
    )
    with pytest.raises(CheckpointError, match="'a' and 'b' overlap"):
        check_file(f)


def test_out_of_range_offsets(tmp_path):
    f = tmp_path / "x.safetensors"
    raw_file(f, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8))
    with pytest.raises(CheckpointError, match="'a' has offsets \\[0, 16\\) outside the 8"):
        check_file(f)


# --- fuzzing: a mutated checkpoint either loads (with the model's exact names and shapes) or
# raises a ZooError; never another exception, a crash or a hang. Bounded so `make test` stays fast.
FUZZ = settings(max_examples=120, deadline=None)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    from conftest import make_checkpoint

    root, _ = make_checkpoint(tmp_path_factory.mktemp("fuzz"), LLAMA31)
    blob = weights(root).read_bytes()
    header_end = 8 + struct.unpack("<Q", blob[:8])[0]
    shapes = {n: tuple(p.shape) for n, p in load_model(root).net.named_parameters()}
    return root, blob, header_end, shapes


def load_mutant(root, mutant: bytes, shapes) -> None:
    weights(root).write_bytes(mutant)
    try:
        m = load_model(root, max_seq_len=8)
    except ZooError:
        return
    assert {n: tuple(p.shape) for n, p in m.net.named_parameters()} == shapes
    assert m.forward(torch.tensor([[5, 6, 7]])).shape == (1, 3, LLAMA31["vocab_size"])


@FUZZ
@given(data=st.data())
def test_fuzz_byte_mutations(pristine, data):
    root, blob, header_end, shapes = pristine
    mutant = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 6))):
        # mostly the 8-byte length and the JSON header, where a flip changes the structure
        i = data.draw(st.integers(0, header_end + 64) | st.integers(0, len(mutant) - 1))
        mutant[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        mutant = mutant[: data.draw(st.integers(0, len(mutant)))]
    load_mutant(root, bytes(mutant), shapes)


@FUZZ
@given(
    value=st.recursive(
        st.none() | st.booleans() | st.integers(-5, 10**6) | st.text(max_size=6),
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
        ),
        max_leaves=10,
    ),
    field=st.sampled_from(["dtype", "shape", "data_offsets", None]),
)
@example(value=[68824, 111038, "0"], field="shape")  # found by this test: int * str, 7.6 GB
def test_fuzz_headers(pristine, value, field):
    root, blob, header_end, shapes = pristine
    header = json.loads(blob[8:header_end])
    name = "model.norm.weight"
    header[name] = value if field is None else {**header[name], field: value}
    b = json.dumps(header).encode()
    load_mutant(root, struct.pack("<Q", len(b)) + b + blob[header_end:], shapes)
