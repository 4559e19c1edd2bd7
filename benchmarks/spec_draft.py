"""Decode tokens/s of speculative decoding with a draft model (core/spec_draft.py) against plain
decoding of the same model: SmolLM2-135M (the embedded GGUF) drafting for itself.

No larger model of SmolLM2's tokenizer is available offline, and a target with random weights
would accept ~0 of the drafts (its tokens have nothing to do with the draft's), so this
measures the other end: a self-draft, whose every draft is accepted (acceptance 1.0), and the
figure is what drafting costs. A draft model k times smaller than its target costs about 1/k of
that per drafted token. Runs alternate (plain, speculative, plain, ...) in one process on one
model (its speculator switched off for plain runs); medians over --repeat runs of each, after
one untimed warm-up of each. Greedy: the tokens must be plain decoding's. Prints a markdown
table and the share of a speculative run spent drafting.

    .venv/bin/python benchmarks/spec_draft.py [--model smollm2] [--draft NAME] [--k 4]
        [--new 128] [--repeat 5]
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

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. Explain "
    "in a few paragraphs how this changed the way books were made and read in Europe."
)


def timed_drafting(proposer) -> list[tuple[float, int]]:
    """(seconds, tokens drafted) of each `propose` of `proposer` from now (appended to the
    returned list)."""
    spent, propose = [], proposer.propose

    def timed(seq, k):
        t0 = time.perf_counter()
        out = propose(seq, k)
        spent.append((time.perf_counter() - t0, len(out.tokens)))
        return out

    proposer.propose = timed
    return spent


def run(model, spec, prompt: list[int], new: int) -> tuple[float, float, list[int]]:
    """(decode tokens/s, wall seconds, tokens) of one greedy reply; spec None: plain."""
    model.speculator = spec
    t0 = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new, temperature=0.0, ignore_eos=True)
    return out.timings["decode_tokens_per_s"], time.perf_counter() - t0, out.token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--draft", default=None, help="the draft model (default: --model itself)")
    ap.add_argument("--k", type=int, default=4, help="tokens drafted per step (fixed)")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    draft = args.draft or args.model
    spec = {"method": "draft", "draft": draft, "k": args.k, "adaptive": False}
    model = load_model(args.model, max_seq_len=1024, prefix_cache=False, speculative=spec)
    speculator = model.speculator
    prompt = model.tokenizer.encode(PROMPT)
    drafting = timed_drafting(speculator.proposer)
    rates = {"plain": [], "draft": []}
    walls = {"plain": [], "draft": []}
    share, per_token, want = [], [], None
    for i in range(args.repeat + 1):  # the first of each: warm-up, untimed
        for kind, s in (("plain", None), ("draft", speculator)):
            drafting.clear()
            rate, wall, tokens = run(model, s, prompt, args.new)
            want = want or tokens
            assert tokens == want, f"{kind} decoding gave other tokens than plain decoding"
            if i:
                rates[kind].append(rate)
                walls[kind].append(wall)
                if kind == "draft":
                    seconds, tokens = (sum(x) for x in zip(*drafting, strict=True))
                    share.append(seconds / wall)
                    per_token.append(seconds / tokens)
    model.speculator = speculator
    st = speculator.stats
    plain, drafted = statistics.median(rates["plain"]), statistics.median(rates["draft"])
    print(f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{model.device}, {str(model.dtype).removeprefix('torch.')}, {datetime.date.today()}; "
          f"target {args.model}, draft {draft}, k={args.k}, {len(prompt)}-token prompt, "
          f"{args.new} new tokens, medians of {args.repeat} alternating runs\n")  # fmt: skip
    print("| decoding | decode tokens/s | wall s | acceptance | mean accepted length |\n"
          "|---|---:|---:|---:|---:|")  # fmt: skip
    print(f"| plain | {plain:.1f} | {statistics.median(walls['plain']):.2f} | | |")
    print(f"| draft ({'self' if draft == args.model else draft}) | {drafted:.1f} | "
          f"{statistics.median(walls['draft']):.2f} | {st.acceptance_rate:.2f} | "
          f"{st.mean_accepted_length:.2f} |")  # fmt: skip
    print(f"\nspeculative / plain: {drafted / plain:.2f}x; drafting took "
          f"{100 * statistics.median(share):.0f}% of a speculative run's wall time, "
          f"{1e3 * statistics.median(per_token):.1f} ms per drafted token (a plain step of the "
          f"target: {1e3 / plain:.1f} ms)")  # fmt: skip
    if draft == args.model:
        print("(a self-draft: every draft is accepted, and each costs a step of the target "
              "itself; this is the overhead of drafting, not a speed-up. A target with random "
              "weights would accept ~0 of a real draft's tokens; no larger model of this "
              "tokenizer is available offline.)")  # fmt: skip


if __name__ == "__main__":
    main()
