"""`zoo chat` through a subprocess with the embedded smollm2: /system, a multi-line message, and
a second turn that starts from what the first left in the cache (the stats line's "cached")."""

from __future__ import annotations

import re
import subprocess
import sys


def test_chat_takes_a_system_prompt_and_a_multi_line_message():
    typed = (
        '/system Answer briefly.\n"""\nWhat is the capital\nof France?\n"""\nAnd Italy?\n/exit\n'
    )
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
    stats = re.findall(r"\[(\d+) prompt tokens(?: \((\d+) cached\))? at .*?, (\d+) new", out.stderr)
    assert len(stats) == 2  # the three lines made one message
    (prompt, cached, new), (_, again, _) = stats
    # the second turn resumes after the first's prompt and answer (all but its last token)
    assert cached == "" and int(again) == int(prompt) + int(new) - 1
