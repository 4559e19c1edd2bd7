"""Weight files from strangers: every corruption ends in a CheckpointError that says what it is."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from conftest import LLAMA31
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from core import CheckpointError, load_model
from plugins.safetensors import SafetensorsCheckpoint, check_file


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


# --- fuzzing: a mutated file either loads the same tensors or raises CheckpointError ----------
def small_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    tensors = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return d, tensors, (d / "model.safetensors").read_bytes()


def read_all(folder):
    ckpt = SafetensorsCheckpoint(folder)
    try:
        return {n: ckpt.read(n).clone() for n in ckpt.tensor_names()}
    finally:
        ckpt.close()


def check_mutant(folder, tensors, mutant: bytes):
    (folder / "model.safetensors").write_bytes(mutant)
    try:
        got = read_all(folder)
    except CheckpointError:
        return
    # loaded: a mutation in the data section may change values, never names, shapes or dtypes
    assert {n: (t.shape, t.dtype) for n, t in got.items()} == {
        n: (t.shape, t.dtype) for n, t in tensors.items()
    }


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_fuzz_byte_mutations(tmp_path_factory, data):
    folder, tensors, blob = small_file(tmp_path_factory)
    n = data.draw(st.integers(1, 8))
    mutant = bytearray(blob)
    for _ in range(n):
        i = data.draw(st.integers(0, len(mutant) - 1))
        mutant[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(mutant)))
    check_mutant(
        folder, tensors, bytes(mutant[:cut]) if data.draw(st.booleans()) else bytes(mutant)
    )


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    header=st.recursive(
        st.none() | st.booleans() | st.integers(-5, 100) | st.text(max_size=6),
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
        ),
        max_leaves=12,
    )
)
def test_fuzz_headers(tmp_path_factory, header):
    folder, tensors, blob = small_file(tmp_path_factory)
    real = json.loads(blob[8 : 8 + struct.unpack("<Q", blob[:8])[0]])
    name = next(k for k in real if k != "__metadata__")
    for candidate in (header, {**real, name: header}):
        b = json.dumps(candidate).encode()
        check_mutant(folder, tensors, struct.pack("<Q", len(b)) + b + bytes(64))
