"""Two latency cases of a running `zoo serve` (issue 21's targets), printed as one JSON object:

- short-while-long: a short request (8 prompt ids, 8 tokens) alone, then again while a long
  answer (--long tokens) streams. A wave scheduler makes it wait for the long answer; rows
  admitted between steps let it in at once. Also the long stream's median gap between chunks
  alone (about one decode step), to compare the two latencies with.
- shared prefix: --prefix random ids + an 8-id question. Cold (a new prefix), warm (the same
  prefix, another question) and the cold prompt again: TTFT of each, the prompt tokens the
  server reports cached (usage.prompt_tokens_details), and whether the repeated prompt's
  greedy answer equals the cold one.

    .venv/bin/python benchmarks/serve_cases.py --url http://127.0.0.1:8000 [--json out.json]

Prompts are random token ids from --seed (a new seed: a prefix no row holds yet); eos ignored,
greedy, streamed with usage.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

import openai


def ask(client: openai.OpenAI, model: str, ids: list[int], n: int, on_chunk=None) -> dict:
    """One streamed greedy completion: latency, TTFT, text, usage."""
    t0 = time.perf_counter()
    out = {"ttft": None, "text": "", "gaps": []}
    last = None
    stream = client.completions.create(
        model=model,
        prompt=ids,
        max_tokens=n,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and (chunk.choices[0].text or chunk.choices[0].finish_reason):
            out["text"] += chunk.choices[0].text
            if last is None:
                out["ttft"] = now - t0
            else:
                out["gaps"].append(now - last)
            last = now
            if on_chunk is not None:
                on_chunk(len(out["gaps"]) + 1)
        if chunk.usage is not None:
            details = chunk.usage.prompt_tokens_details
            out["cached"] = details.cached_tokens if details else None
            out["prompt_tokens"] = chunk.usage.prompt_tokens
            out["completion_tokens"] = chunk.usage.completion_tokens
    out["latency"] = time.perf_counter() - t0
    return out


def short_while_long(client, model, rng, long_tokens: int) -> dict:
    ids = lambda n: [rng.randrange(1000, 20000) for _ in range(n)]  # noqa: E731
    idle = [ask(client, model, ids(8), 8)["latency"] for _ in range(3)]
    started = threading.Event()
    long_out = {}

    def run_long():
        long_out.update(
            ask(client, model, ids(16), long_tokens, lambda k: k >= 10 and started.set())
        )

    t = threading.Thread(target=run_long)
    t.start()
    started.wait()
    busy = ask(client, model, ids(8), 8)
    t.join()
    step = statistics.median(long_out["gaps"][:8])  # gaps while it streamed alone
    return {
        "short_idle_latency_s": statistics.median(idle),
        "short_busy_latency_s": busy["latency"],
        "long_latency_s": long_out["latency"],
        "busy_over_long": busy["latency"] / long_out["latency"],
        "long_alone_chunk_gap_s": step,
        "busy_minus_idle_in_steps": (busy["latency"] - statistics.median(idle)) / step,
    }


def shared_prefix(client, model, rng, prefix_len: int) -> dict:
    prefix = [rng.randrange(1000, 20000) for _ in range(prefix_len)]
    q1, q2 = ([rng.randrange(1000, 20000) for _ in range(8)] for _ in range(2))
    cold = ask(client, model, prefix + q1, 16)
    warm = ask(client, model, prefix + q2, 16)
    again = ask(client, model, prefix + q1, 16)
    return {
        "prompt_tokens": cold["prompt_tokens"],
        "cold_ttft_s": cold["ttft"],
        "warm_ttft_s": warm["ttft"],
        "warm_over_cold": warm["ttft"] / cold["ttft"],
        "cached_cold_warm_again": [cold["cached"], warm["cached"], again["cached"]],
        "warm_cached_fraction": (warm["cached"] or 0) / warm["prompt_tokens"],
        "again_ttft_s": again["ttft"],
        "again_text_equals_cold": again["text"] == cold["text"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--long", type=int, default=320, help="tokens of the long answer")
    ap.add_argument("--prefix", type=int, default=1000, help="shared prefix, token ids")
    ap.add_argument("--seed", type=int, default=None, help="default: from the clock")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.url + "/v1", api_key="-", max_retries=0, timeout=900)
    model = client.models.list().data[0].id
    seed = args.seed if args.seed is not None else time.time_ns()
    rng = random.Random(seed)
    result = {"seed": seed, **short_while_long(client, model, rng, args.long)}
    result.update(shared_prefix(client, model, rng, args.prefix))
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
