"""`zoo chat` through a subprocess with the embedded smollm2: /system, a multi-line message."""

from __future__ import annotations

import subprocess
import sys


def test_chat_takes_a_system_prompt_and_a_multi_line_message():
    typed = '/system Answer briefly.\n"""\nWhat is the capital\nof France?\n"""\n/exit\n'
    out = subprocess.run(
        [sys.executable, "-m", "core.cli", "chat", "--max-new-tokens", "24", "--temperature", "0"],
        input=typed,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "(system prompt set)" in out.stderr and "/system TEXT" in out.stderr  # the help line
    assert "Paris" in out.stdout
    assert out.stderr.count(" prompt tokens at ") == 1  # the three lines made one message
