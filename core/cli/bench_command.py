"""`zoo bench`: the flags checked, the model loaded (or random weights of a registry shape), the
figures measured and printed (core/cli/bench.py), and the comparison with another engine
(transformers, or llama.cpp on the same GGUF file: core/cli/bench_llamacpp.py)."""

from __future__ import annotations

import argparse
import sys

from core.cli.common import load, prompt_ids, ranks
from core.cli.speculation import speculative

# --compare peer -> (module to import, what to pip install)
PEERS = {
    "transformers": ("transformers", "transformers"),
    "llama.cpp": ("llama_cpp", "llama-cpp-python (the extra zoo[llama-cpp]; builds from source)"),
}


def check_before_ranks(args: argparse.Namespace) -> None:
    """What --tp N refuses before it starts the ranks (each would say it, after loading)."""
    from core.errors import RequestError

    if args.random_weights and not args.compare:
        raise RequestError(RANDOM_TP)


RANDOM_TP = "--random-weights runs in one process; drop --tp or --random-weights"


def bench_command(args: argparse.Namespace) -> None:
    import importlib.util
    import tempfile
    from pathlib import Path

    from core.cli import bench
    from core.errors import RequestError

    module, dist = PEERS.get(args.compare, (None, None))
    if module and importlib.util.find_spec(module) is None:
        raise RequestError(f"--compare {args.compare}: not installed; pip install {dist}")
    if args.compare == "llama.cpp":
        _check_gguf(args)
    lens = bench.parse_ints(args.prompt_lens, "prompt-lens")
    batches = bench.parse_ints(args.batches, "batches")
    sizes = {"max_seq_len": max(max(lens), 64) + args.decode_tokens, "max_batch_size": max(batches)}
    with tempfile.TemporaryDirectory(prefix="zoo-bench-") as tmp:
        model, load_s = _bench_model(args, Path(tmp), sizes)
        compare_ids = None
        if args.compare == "transformers":  # said before the figures are measured
            compare_ids = _compare_prompt(model, args)
            _check_compare_room(model, args, len(compare_ids))
        report = bench.measure(
            model,
            prompt_lens=lens,
            batches=batches,
            decode_tokens=args.decode_tokens,
            repeat=args.repeat,
            peak_gbps=args.peak_gbps,
        )
        report.load_s = load_s
        if args.random_weights:  # not the temporary folder they may have been written to
            report.model = f"<random {model.config.model_type}>"
        if args.compare == "transformers":
            report.compare = bench.compare_transformers(
                model, model.path, prompt=compare_ids,
                decode_tokens=args.decode_tokens, repeat=args.repeat, compile_hf=args.hf_compile,
            )  # fmt: skip
        elif args.compare == "llama.cpp":
            from core.cli.bench_llamacpp import compare_llama_cpp

            path, ids = model.path, _compare_prompt(model, args, lens[0])
            del model  # the two engines' own processes load it; this one waits
            keys = ("device", "dtype", "compile", "dequantize", "quantize", "kv_dtype")  # as load
            options = {k: getattr(args, k) for k in keys} | {"speculative": speculative(args)}
            report.compare = compare_llama_cpp(
                path, prompt=ids, decode_tokens=args.decode_tokens, repeat=args.repeat,
                load=options, ctx=args.ctx,
            )  # fmt: skip
    print(bench.render(report))
    if args.json:
        bench.write_json(report, args.json)


def _compare_prompt(model, args: argparse.Namespace, length: int = 0) -> list[int]:
    """--prompt as the chat-templated ids Zoo builds (a fixed 42 random ids without a tokenizer),
    followed by seeded random ids up to `length` tokens where it is shorter."""
    from core.cli import bench

    if model.tokenizer is None:
        prompt = bench.random_prompt(model.config.vocab_size, 1, 42)[0]
    else:
        prompt = prompt_ids(model, [{"role": "user", "content": args.prompt}], None)
        prompt = prompt if isinstance(prompt, list) else model.encode_prompt(prompt)
    if len(prompt) < length:
        prompt += bench.random_prompt(model.config.vocab_size, 1, length - len(prompt))[0]
    return prompt


def _check_compare_room(model, args: argparse.Namespace, n: int) -> None:
    """The chat-templated --prompt and --decode-tokens within the cache that --prompt-lens
    sized, or one line with the --prompt-lens that holds them."""
    from core.errors import RequestError

    need = n + args.decode_tokens
    if need > model.max_seq_len:
        raise RequestError(
            f"--compare: the chat-templated --prompt is {n} tokens; with --decode-tokens "
            f"{args.decode_tokens} that is {need}, past the cache of {model.max_seq_len} "
            f"that --prompt-lens sizes; pass --prompt-lens {n} or more, or a shorter --prompt"
        )


def _check_gguf(args: argparse.Namespace) -> None:
    """--compare llama.cpp needs a GGUF file; said before anything loads."""
    from core.errors import RequestError
    from core.hub import resolve

    if args.random_weights:
        raise RequestError("--compare llama.cpp runs on a .gguf file; --random-weights makes none")
    path = resolve(args.model, revision=args.revision, offline=True if args.offline else None)
    magic = b""
    if path.is_file():
        with path.open("rb") as f:
            magic = f.read(4)
    if magic != b"GGUF":
        raise RequestError(f"--compare llama.cpp needs a .gguf file; {path} is not one")


def _bench_model(args: argparse.Namespace, tmp, sizes: dict):
    """(model, load seconds): the named model, or random weights of a registry shape. With
    --compare those are written to `tmp` as a checkpoint, which Zoo and transformers both load."""
    import time

    from core.catalog import named_models
    from core.cli import bench
    from core.errors import RequestError

    shape, path = None, None
    if args.random_weights:
        name = args.shape or args.model
        shape = named_models().get(name, {}).get("shape")
        if not shape:
            known = ", ".join(n for n, e in named_models().items() if e.get("shape"))
            raise RequestError(f"no shape for {name!r} in registry.yaml; known shapes: {known}")
        dev, weights = bench.check_shape_fits(
            name, shape, device=args.device, dtype=args.dtype, **sizes
        )
        note = dev.type == "cpu" and bench.slow_run_note(
            weights,
            batches=bench.parse_ints(args.batches, "batches"),
            decode_tokens=args.decode_tokens,
            repeat=args.repeat,
        )
        if note:
            print(note, file=sys.stderr)
        if args.compare:
            path = str(bench.random_checkpoint(shape, tmp, device=args.device, dtype=args.dtype))
            shape = None
    t0 = time.perf_counter()
    if shape and ranks(args) > 1:
        raise RequestError(RANDOM_TP)
    if shape:
        model = bench.random_model(
            shape, device=args.device, dtype=args.dtype, compile=args.compile, **sizes
        )
        _speculate(model, args, sizes)
    else:
        model = load(args, path, **sizes)
    return model, time.perf_counter() - t0


def _speculate(model, args: argparse.Namespace, sizes: dict) -> None:
    """--spec / --draft on random weights (built without load_model): the speculator that
    load_model(speculative=...) would give them."""
    from core.speculative import SpecConfig, make_speculator

    config = SpecConfig.of(speculative(args))
    draft = dict(device=model.device, dtype=model.dtype, **sizes)  # (a draft model's load)
    model.speculator = make_speculator(config, model, **draft)
