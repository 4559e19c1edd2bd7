"""Load benchmark of a running OpenAI-compatible server (`zoo serve`, or vLLM's for comparison).

Clients send streamed `/v1/completions` with usage: prompts of random token ids (lengths uniform in
--input-len, as vLLM's "random" dataset) and answers of exact lengths (uniform in --output-len,
eos ignored), all drawn from --seed. Load is closed-loop (--concurrency N clients, each sending
its next request when the last ends) or open-loop (--rate R: Poisson arrivals, R requests/s,
at most --concurrency in flight if given). New requests start for --duration seconds; those in
flight then finish. Reports vLLM's `bench serve` figures under its names: TTFT (first text
chunk), TPOT ((latency - TTFT) / (output tokens - 1), per request), ITL (between text chunks),
E2EL: mean, median, p99 in ms; request throughput; output tokens/s.

    .venv/bin/python benchmarks/serve_load.py --url http://127.0.0.1:8000 --concurrency 4 \
        --duration 30 [--rate 2] [--input-len 16 256] [--output-len 16 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import openai


@dataclass
class Outcome:
    """One request as the client saw it (times in seconds from its send)."""

    input_len: int
    asked: int  # max_tokens
    ok: bool = False
    error: str = ""
    output_len: int = 0  # usage.completion_tokens
    prompt_tokens: int = 0  # usage.prompt_tokens
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def workload(seed: int, input_len: tuple[int, int], output_len: tuple[int, int], ids_range):
    """The i-th request's (prompt ids, max_tokens), forever: the same for the same seed."""
    rng = random.Random(seed)
    while True:
        n = rng.randint(*input_len)
        yield [rng.randrange(*ids_range) for _ in range(n)], rng.randint(*output_len)


async def one(client: openai.AsyncOpenAI, model: str, ids: list[int], max_tokens: int) -> Outcome:
    out = Outcome(len(ids), max_tokens)
    t0 = time.perf_counter()
    last = None
    try:
        stream = await client.completions.create(
            model=model,
            prompt=ids,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            # a text chunk, or the last one of an answer whose bytes never made a whole
            # character (a token can be part of one): its first token came then
            choice = chunk.choices[0] if chunk.choices else None
            if choice and (choice.text or (choice.finish_reason and last is None)):
                if last is None:
                    out.ttft = now - t0
                else:
                    out.itl.append(now - last)
                last = now
            if chunk.usage is not None:
                out.output_len = chunk.usage.completion_tokens
                out.prompt_tokens = chunk.usage.prompt_tokens
        out.latency = time.perf_counter() - t0
        out.ok = last is not None and out.output_len > 0
        out.error = "" if out.ok else "no finish_reason or no usage in the stream"
    except Exception as err:  # a failed request is counted, the run goes on
        out.error = f"{type(err).__name__}: {err}"
    return out


async def drive(args: argparse.Namespace) -> tuple[list[Outcome], float]:
    """All requests' outcomes, and the run's wall time (first send to last answer)."""
    client = openai.AsyncOpenAI(
        base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key, max_retries=0, timeout=600
    )
    model = args.model or (await client.models.list()).data[0].id
    work = workload(args.seed, tuple(args.input_len), tuple(args.output_len), args.ids)
    t0 = time.perf_counter()
    deadline = t0 + args.duration
    outcomes: list[Outcome] = []

    async def closed_client():
        while time.perf_counter() < deadline:
            outcomes.append(await one(client, model, *next(work)))

    if args.rate is None:
        await asyncio.gather(*(closed_client() for _ in range(args.concurrency)))
    else:
        gate = asyncio.Semaphore(args.concurrency or 1 << 30)
        rng = random.Random(args.seed + 1)

        async def gated(ids, max_tokens):
            async with gate:
                outcomes.append(await one(client, model, ids, max_tokens))

        tasks = []
        while time.perf_counter() < deadline:
            tasks.append(asyncio.create_task(gated(*next(work))))
            await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    await client.close()
    return outcomes, wall


def _stats(name: str, values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values) or [0.0]
    p99 = ms[min(len(ms) - 1, max(0, round(0.99 * len(ms) + 0.5) - 1))]
    return {
        f"mean_{name}_ms": statistics.fmean(ms),
        f"median_{name}_ms": statistics.median(ms),
        f"p99_{name}_ms": p99,
    }


def report(outcomes: list[Outcome], wall: float) -> dict:
    """vLLM's `bench serve` result keys, and each request's lengths."""
    done = [o for o in outcomes if o.ok]
    out_tokens = sum(o.output_len for o in done)
    in_tokens = sum(o.prompt_tokens for o in done)
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in done if o.output_len > 1]
    result = {
        "duration": wall,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "errors": sorted({o.error for o in outcomes if not o.ok}),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / wall,
        "output_throughput": out_tokens / wall,
        "total_token_throughput": (in_tokens + out_tokens) / wall,
        **_stats("ttft", [o.ttft for o in done]),
        **_stats("tpot", tpots),
        **_stats("itl", [x for o in done for x in o.itl]),
        **_stats("e2el", [o.latency for o in done]),
        "input_lens": [o.prompt_tokens for o in done],
        "output_lens": [o.output_len for o in done],
        "asked_output_lens": [o.asked for o in done],
    }
    return result


def print_report(r: dict, args: argparse.Namespace) -> None:
    load = f"rate {args.rate}/s" if args.rate else f"concurrency {args.concurrency}"
    print(f"{' Serving Benchmark Result ':=^50}  ({load}, {args.duration:g} s of sends)")
    rows = [
        ("Successful requests:", r["completed"]),
        ("Failed requests:", r["failed"]),
        ("Benchmark duration (s):", f"{r['duration']:.2f}"),
        ("Total input tokens:", r["total_input_tokens"]),
        ("Total generated tokens:", r["total_output_tokens"]),
        ("Request throughput (req/s):", f"{r['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{r['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{r['total_token_throughput']:.2f}"),
    ]
    for label, value in rows:
        print(f"{label:<40}{value:<10}")
    for key, title in [("ttft", "Time to First Token"), ("tpot", "Time per Output Token")]:
        print(f"{' ' + title + ' ':-^50}")
        for stat in ("mean", "median", "p99"):
            print(f"{f'{stat.capitalize()} {key.upper()} (ms):':<40}{r[f'{stat}_{key}_ms']:<10.2f}")
    for key, title in [("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")]:
        print(f"{' ' + title + ' ':-^50}")
        for stat in ("mean", "median", "p99"):
            print(f"{f'{stat.capitalize()} {key.upper()} (ms):':<40}{r[f'{stat}_{key}_ms']:<10.2f}")
    if r["errors"]:
        print("errors:", *r["errors"], sep="\n  ")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument("--model", help="model id to send (default: the server's first)")
    p.add_argument("--api-key", default="none")
    p.add_argument(
        "--concurrency", type=int, help="closed loop: clients (default 4 without --rate)"
    )
    p.add_argument("--rate", type=float, help="open loop: Poisson arrivals, requests/s")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of new requests")
    p.add_argument("--input-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    ids_help = "prompt token ids are drawn from [LOW, HIGH): inside every vocabulary"
    p.add_argument(
        "--ids", type=int, nargs=2, default=[20, 300], metavar=("LOW", "HIGH"), help=ids_help
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the result (and every request's lengths) here")
    args = p.parse_args(argv)
    if args.rate is None and args.concurrency is None:
        args.concurrency = 4
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    result = report(*asyncio.run(drive(args)))
    print_report(result, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **result}, f, indent=1)
    return result


if __name__ == "__main__":
    main()
