"""Reasoning split from answers: think blocks (streamed in any cut, or opened by the prompt);
gpt-oss's analysis channel: tests/core/test_harmony.py."""

from __future__ import annotations

import pytest

from core.chat.reasoning import ThinkSplitter, split

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
