"""Reasoning split from answers: think blocks (streamed in any cut, or opened by the prompt) and
gpt-oss's analysis channel."""

from __future__ import annotations

import pytest

from core.reasoning import ThinkSplitter, split, split_harmony

ANSWER = "<think>\nThe capital of France... Paris.\n</think>\n\nParis."


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 100])
def test_a_streamed_think_block_splits_alike_in_any_cut(size):
    s = ThinkSplitter()
    pieces = [s.feed(ANSWER[i : i + size]) for i in range(0, len(ANSWER), size)]
    pieces.append(s.flush())
    reasoning = "".join(r for r, _ in pieces)
    content = "".join(c for _, c in pieces)
    assert reasoning.strip() == "The capital of France... Paris." and content == "Paris."


def test_whole_answers():
    assert split(ANSWER) == ("The capital of France... Paris.", "Paris.")
    assert split("Hmm.\n</think>\n\nParis.", opened=True) == ("Hmm.", "Paris.")  # R1's prompt
    assert split("Paris. <think> is a tag") == ("", "Paris. <think> is a tag")  # not at the start
    assert split("<think>cut short by max_tokens") == ("cut short by max_tokens", "")
    assert split("a < b") == ("", "a < b")


def test_harmony_channels():
    raw = (
        "<|channel|>analysis<|message|>3+3 is 6.<|end|><|start|>assistant"
        "<|channel|>final<|message|>6<|return|>"
    )
    assert split_harmony(raw) == ("3+3 is 6.", "6")
    assert split_harmony("<|channel|>analysis<|message|>still think") == ("still think", "")
