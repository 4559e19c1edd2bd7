"""Time to first token of a chat's second turn through `Model.generate`, with the prefix cache
(load_model's `prefix_cache`, on by default) and without: a conversation of about --history
tokens (chat-templated, as `zoo chat` sends it) and its reply, then the next user message. With
the cache, the turn resumes from the row that holds the first turn's prompt and reply; cold,
it reads the whole prompt. Each greedy reply must be the cold run's, token for token. Medians
of --repeat runs (each from a reset cache: the first turn untimed). Prints a markdown table.

    .venv/bin/python benchmarks/chat_reuse.py [--model smollm2] [--history 1500] [--repeat 3]
        [--cpu-time]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root

import torch

from core import load_model

REPLY = 16  # tokens of each reply


def conversation(tok, history: int) -> list[dict]:
    """User / assistant turns of plain notes, about `history` tokens once templated."""
    messages, i = [], 0
    while len(tok.apply_chat_template(messages or [{"role": "user", "content": ""}])) < history:
        notes = " ".join(
            f"Note {i + k}: the review of project {i + k} moved to room {(i + k) * 7 % 31}."
            for k in range(8)
        )
        messages += [
            {"role": "user", "content": f"Please remember these notes. {notes}"},
            {"role": "assistant", "content": f"Noted: {notes}"},
        ]
        i += 8
    return messages


def turn(model, prompt: list[int], cached: bool, clock) -> tuple[float, object]:
    """(seconds to the first token by `clock`, the result) of one greedy reply."""
    model.prefix_cache = cached
    t0 = clock()
    first = model.generate(prompt, max_new_tokens=1, temperature=0.0)
    ttft = clock() - t0
    model.prefix_cache = True
    return ttft, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--history", type=int, default=1500)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cpu-time", action="store_true", help="time the process's CPU time")
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    model = load_model(args.model, max_seq_len=4096)
    tok = model.tokenizer
    messages = conversation(tok, args.history)
    messages.append({"role": "user", "content": "Which room is the review of project 12 in?"})
    greedy = dict(max_new_tokens=REPLY, temperature=0.0, ignore_eos=True)
    cold, warm, rows = [], [], None
    for _ in range(args.repeat + 1):  # the first: warm-up, untimed
        model.reset()
        first_prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        reply = model.generate(first_prompt, **greedy)
        nxt = [*messages, {"role": "assistant", "content": reply.text}]
        nxt.append({"role": "user", "content": "And the review of project 20?"})
        prompt = tok.apply_chat_template(nxt, add_generation_prompt=True)
        t_warm, got = turn(model, prompt, True, clock)
        t_cold, want = turn(model, prompt, False, clock)
        assert got.token_ids == want.token_ids, "the reused turn answered otherwise than cold"
        cold.append(t_cold)
        warm.append(t_warm)
        rows = (len(first_prompt), len(prompt), got.cached_tokens)
    c, w = statistics.median(cold[1:]), statistics.median(warm[1:])
    what = "CPU time of the process" if args.cpu_time else "wall clock"
    print(f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{model.device}, {str(model.dtype).removeprefix('torch.')}, "
          f"{datetime.date.today()}; {args.model}; {what}\n")  # fmt: skip
    print("| history tokens | turn-2 prompt tokens | cached | TTFT cold (ms) | TTFT reused (ms) "
          "| speed-up |\n|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    print(f"| {rows[0]} | {rows[1]} | {rows[2]} | {c * 1e3:.1f} | {w * 1e3:.1f} | {c / w:.1f}x |")


if __name__ == "__main__":
    main()
