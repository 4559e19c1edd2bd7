"""Speculative decoding against plain decoding on tasks whose answer repeats the prompt (edit
a code snippet, rewrite a paragraph with one change) and on one whose answer does not (a
story: drafts are rarely accepted, adaptive k must keep the cost near zero). Greedy, chat-
templated as `zoo run` sends it; decode tokens/s (after the first token) of each, medians of
--repeat runs alternating plain and speculative in one process; each speculative answer must
be the plain one, token for token. Prints a markdown table.

    .venv/bin/python benchmarks/spec_decode.py [--model smollm2] [--spec ngram] [--k 8]
        [--repeat 3] [--tasks code-edit rewrite story] [--fixed] [--temperature 1.0]

With --temperature the answers are sampled (the same seed, but speculation draws differently):
"same" is not checked, only the rates compared.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root

import torch

from core import load_model
from core.speculative import Draft, Proposer, SpecConfig, SpecStats, make_speculator

CODE = '''def load_orders(path):
    """Read orders from a CSV file: one order per line, id, customer, amount."""
    orders = []
    with open(path) as f:
        for line in f:
            order_id, customer, amount = line.strip().split(",")
            orders.append({"id": int(order_id), "customer": customer, "amount": float(amount)})
    return orders


def compute_total(orders, customer):
    """The total amount a customer spent over all their orders."""
    total = 0.0
    for order in orders:
        if order["customer"] == customer:
            total += order["amount"]
    return total


def top_customers(orders, n=3):
    """The n customers who spent the most, with what they spent, largest first."""
    spent = {}
    for order in orders:
        spent[order["customer"]] = spent.get(order["customer"], 0.0) + order["amount"]
    ranked = sorted(spent.items(), key=lambda item: item[1], reverse=True)
    return ranked[:n]


if __name__ == "__main__":
    orders = load_orders("orders.csv")
    print(compute_total(orders, "alice"))
    for name, amount in top_customers(orders):
        print(name, amount)
'''
PARAGRAPH = (
    "On Monday morning the team met in the small room on the third floor to plan the move "
    "of the archive. Anna had counted four hundred boxes, most of them labelled by year, and "
    "a few dozen that nobody could place. The van would come on Thursday at nine, so every "
    "box had to be sealed, numbered and listed by Wednesday evening. Tom offered to write the "
    "list, Maria took the labels, and Anna kept the keys to the basement, where the oldest "
    "boxes had waited for almost twenty years. By noon the first shelf was empty, and the "
    "corridor smelled of dust, tape and cold coffee."
)
TASKS = {
    "code-edit": "```python\n" + CODE + "```\n\nRewrite the code above with the function "
    "compute_total renamed to total_spent. Output the complete code.",
    "rewrite": "Rewrite this paragraph exactly, word for word, except that Monday becomes "
    "Tuesday:\n\n" + PARAGRAPH,
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


class Noise(Proposer):
    """Uniformly random drafts: what speculation costs when nothing is accepted."""

    def __init__(self, vocab: int):
        self.vocab, self.g = vocab, torch.Generator().manual_seed(0)

    def propose(self, seq, k: int) -> Draft:
        return Draft(torch.randint(0, self.vocab, (k,), generator=self.g).tolist())


def run(model, prompt: list[int], new: int, temperature: float):
    """(decode tokens/s, the result); sampling runs all `new` tokens (ignore_eos, seeded)."""
    if temperature:
        sample = dict(temperature=temperature, top_p=0.95, seed=0, ignore_eos=True)
        r = model.generate(prompt, max_new_tokens=new, **sample)
    else:
        r = model.generate(prompt, max_new_tokens=new, temperature=0.0)
    return r.timings["decode_tokens_per_s"], r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument(
        "--spec",
        default="ngram",
        choices=["ngram", "mtp", "random"],
        help="random: drafts uniformly random tokens (accepted ~never), for the cost "
        "of speculation that does not pay",
    )
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--ngram-max", type=int, default=None, help="prompt lookup's longest n")
    ap.add_argument("--fixed", action="store_true", help="always k drafts (no adaptive k)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--new", type=int, default=400, help="most tokens per answer")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample (top-p 0.95, seeded, every token of --new): answers differ",
    )
    args = ap.parse_args()

    model = load_model(args.model, max_seq_len=2048)
    method = "ngram" if args.spec == "random" else args.spec
    more = {} if args.ngram_max is None else {"ngram_max": args.ngram_max}
    config = SpecConfig(method=method, k=args.k, adaptive=not args.fixed, **more)
    spec = make_speculator(config, model)
    if args.spec == "random":
        spec.proposer = Noise(model.config.vocab_size)
    print(
        f"# {args.model}, {args.spec} k={args.k}{' fixed' if args.fixed else ' adaptive'}; "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"{datetime.date.today()}\n"
    )
    print("| task | prompt | answer | plain tok/s | spec tok/s | speed-up | accepted "
          "| tokens/step | same |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for task in args.tasks:
        ids = model.tokenizer.apply_chat_template([{"role": "user", "content": TASKS[task]}])
        plain, fast, same, stats = [], [], True, SpecStats()
        for _ in range(args.repeat):  # alternating, each from a cold cache
            model.speculator = None
            model.reset()
            rate, want = run(model, ids, args.new, args.temperature)
            plain.append(rate)
            model.speculator = spec
            model.reset()
            rate, got = run(model, ids, args.new, args.temperature)
            fast.append(rate)
            same &= got.token_ids == want.token_ids or bool(args.temperature)
            if got.speculation is not None:  # (over every run of the task)
                stats.merge(got.speculation)
        p, s = statistics.median(plain), statistics.median(fast)
        acc = f"{stats.acceptance_rate:.0%}" if stats.drafts else "-"
        per = f"{stats.mean_accepted_length:.2f}" if stats.drafts else "-"
        print(f"| {task} | {len(ids)} | {len(want.token_ids)} | {p:.1f} | {s:.1f} | "
              f"{s / p:.2f}x | {acc} | {per} | {'yes' if same else 'NO'} |")  # fmt: skip


if __name__ == "__main__":
    main()
