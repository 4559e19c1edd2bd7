"""A CPU model's weights moved into transparent huge pages (core/hugepages.py): the same values,
tied weights still one tensor, the memory asked for huge pages, and load_model doing it."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from conftest import LLAMA32, make_checkpoint

from core import load_model
from core.hugepages import available, move_to_huge_pages

pytestmark = pytest.mark.skipif(not available(), reason="no transparent huge pages here")


def thp_eligible(ptr: int) -> bool:
    """Whether the mapping holding address ptr may have huge pages (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {ptr:#x}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    spec = dict(LLAMA32, vocab_size=512, tie_word_embeddings=True)  # 128 KiB tied embedding
    return make_checkpoint(tmp_path_factory.mktemp("huge"), spec)[0]


def test_load_model_puts_the_weights_in_huge_pages(folder):
    m = load_model(folder, max_seq_len=64)
    net = m.net
    embed = net.model.embed_tokens.weight
    assert thp_eligible(embed.data_ptr())
    assert thp_eligible(net.model.layers[0].mlp.gate_up_proj.weight.data_ptr())
    # the tied head still reads the embedding's memory
    assert net.lm_head.tied_to[0].weight.data_ptr() == embed.data_ptr()


def test_moving_keeps_values_sharing_and_the_mapping_alive(folder, monkeypatch):
    monkeypatch.setattr("core.api.move_to_huge_pages", lambda net: 0)
    m = load_model(folder, max_seq_len=64)  # where torch's allocator put the weights
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    before = m.forward(ids, 0).clone()
    tensors = {n: t.clone() for n, t in m.net.state_dict().items()}
    ptr = m.net.model.layers[1].self_attn.o_proj.weight.data_ptr()
    moved = move_to_huge_pages(m.net, min_bytes=0)  # every tensor, however small
    gc.collect()  # nothing but the tensors holds the mapping now
    assert moved >= sum(p.numel() * p.element_size() for p in m.net.parameters())
    assert m.net.model.layers[1].self_attn.o_proj.weight.data_ptr() != ptr
    for name, t in m.net.state_dict().items():
        assert torch.equal(t, tensors[name]), name
    for name, p in m.net.named_parameters():
        assert thp_eligible(p.data_ptr()), name
    assert torch.equal(m.forward(ids, 0), before)
    embed = m.net.model.embed_tokens.weight
    assert m.net.lm_head.tied_to[0].weight.data_ptr() == embed.data_ptr()
    assert thp_eligible(embed.data_ptr())
