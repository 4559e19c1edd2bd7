"""The `zoo` command. Errors print one line and exit 1; `--debug` shows the traceback."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from core.chat.reasoning import Reasoner, reader
from core.cli import info, speculation
from core.cli.bench_command import PEERS, bench_command, check_before_ranks
from core.cli.common import DEFAULT_MODEL, load, prompt_ids, ranks, sampling
from core.errors import ConfigError, RequestError, ZooError


def _reasoning(text: str) -> None:
    """Reasoning goes to stderr (dimmed on a terminal), apart from the answer on stdout."""
    dim = sys.stderr.isatty()
    print(f"\033[2m{text}\033[0m" if dim else text, end="", file=sys.stderr, flush=True)


def _answer(
    model,
    prompt,
    params: dict,
    chat: bool = True,
    hide_reasoning: bool = False,
    pieces: list[str] | None = None,
    cut: str | None = None,
) -> str:
    """Stream one answer to stdout; timing to stderr. Returns the answer's text, and gathers it
    in `pieces` as it comes (what was shown before a Ctrl-C). A reasoning model's thinking (a
    <think> block, gpt-oss's analysis channel) goes to stderr, or nowhere with
    `hide_reasoning`, and never into the returned text: the answer is read as the server reads
    it (core.chat.reasoning.reader). `cut`: what was asked for (--json), warned about on stderr
    when the token limit ends the answer."""
    chat = chat and isinstance(prompt, list)
    reasoner = Reasoner.for_request(model.tokenizer, prompt) if chat else None
    rd = None
    if reasoner is not None:
        rd, params = reader(reasoner), {**params, **reasoner.params()}
    stream = model.stream(prompt, **params)
    pieces = [] if pieces is None else pieces

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
        t, res = stream.result.timings, stream.result
        n = len(res.token_ids)
        prefill, decode = t["prefill_tokens_per_s"], t["decode_tokens_per_s"]
        cached = f" ({res.cached_tokens} cached)" if res.cached_tokens else ""
        print(
            f"[{res.prompt_tokens} prompt tokens{cached} at {prefill:.1f} tok/s, "
            f"{n} new tokens at {decode:.1f} tok/s{speculation.stats_note(model, res)}]",
            file=sys.stderr,
        )
        if cut and stream.result.finish_reason == "length":
            print(
                f"zoo: warning: the answer reached --max-new-tokens ({n} tokens) before its "
                f"end: the {cut} is cut off; pass a larger --max-new-tokens",
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


def _the_prompt(args: argparse.Namespace) -> str:
    """`zoo run MODEL "prompt"` or `-p "prompt"`: one of the two."""
    if args.prompt is not None and args.text is not None:
        raise RequestError(
            f"two prompts: {args.text!r} and -p {args.prompt!r}; give it once, as an argument "
            "or with -p"
        )
    prompt = args.text if args.prompt is None else args.prompt
    if prompt is None:  # `zoo run "What is 2+2?"`: the one argument is the model's
        read = f" ({args.model!r} was read as the model)" if args.model != DEFAULT_MODEL else ""
        raise RequestError(f'no prompt: zoo run MODEL "PROMPT", or -p "PROMPT"{read}')
    return prompt


def _run(args: argparse.Namespace) -> None:
    text = _the_prompt(args)
    params, cut = sampling(args), None
    if args.json_schema:
        params["json_schema"], cut = _schema_file(args.json_schema), "JSON"
    elif args.json:
        params["json_object"], cut = True, "JSON"
    model = load(args)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": text}
    ]
    prompt = prompt_ids(model, messages, text if args.raw else None)
    _check_room(model, prompt, args.max_new_tokens)
    _answer(model, prompt, params, not args.raw, args.hide_reasoning, cut=cut)


def _check_room(model, prompt: list[int] | str, max_new: int) -> None:
    """The prompt's ids in the model's vocabulary (else its tokenizer is another model's), and
    prompt + --max-tokens within the context the model was loaded with, or one line with the
    flag that fixes it (where load_model's own error names load_model's arguments)."""
    ids = prompt if isinstance(prompt, list) else model.encode_prompt(prompt)
    bad = [i for i in ids if i >= model.config.vocab_size]  # (chat-templated ids)
    if bad:
        raise RequestError(model.foreign_tokenizer(bad))
    n = len(ids)
    if n + max_new <= model.max_seq_len:
        return
    room = model.max_seq_len - n
    fix = f"pass --max-tokens {room} or fewer" if room > 0 else "shorten the prompt"
    raise RequestError(
        f"prompt ({n} tokens) + --max-tokens {max_new} = {n + max_new} exceeds the context of "
        f"{model.max_seq_len} tokens this model runs with; {fix}"
    )


def _chat(args: argparse.Namespace) -> None:
    from core.cli.chat_session import HELP, Session, read_message

    model = load(args)
    session = Session(model, args.system, args.max_new_tokens)
    print(HELP, file=sys.stderr)
    while True:
        try:
            line = read_message()
        except EOFError:
            print()
            return
        except KeyboardInterrupt:  # at the prompt: leave as a shell's Ctrl-C does (130)
            print()
            raise
        line = session.command(line)
        if line is None:
            return
        if not line:
            continue
        session.history.append({"role": "user", "content": line})
        pieces: list[str] = []
        try:
            prompt = session.prompt(lambda messages: prompt_ids(model, messages, None))
            _answer(model, prompt, sampling(args), True, args.hide_reasoning, pieces)
        except KeyboardInterrupt:  # the answer so far stays: the next turn sees what was shown
            print("\n(stopped)", file=sys.stderr)
        except ZooError as err:  # (a message too long for the context): say so, keep chatting
            print(f"zoo: error: {err}", file=sys.stderr)
            pieces.clear()
        session.answered("".join(pieces))


def _serve(args: argparse.Namespace) -> None:
    from core.serve.app import listen, serve

    sock = listen(args.host, args.port) if os.environ.get("RANK", "0") == "0" else None
    model = load(args, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len)
    serve(model, args.model, sock, api_key=args.api_key, max_queue=args.max_queue, task=args.task)


def _download(args: argparse.Namespace) -> None:
    from core.hub import resolve

    print(resolve(args.model, revision=args.revision, offline=True if args.offline else None))


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
    p.add_argument(
        "--snapshots",
        type=int,
        default=None,
        metavar="N",
        help="models with recurrent layers: copies of each row's state kept (every 256 "
        "tokens), from which a prompt sharing a prefix resumes; 0: off (default: 8)",
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
    p.add_argument(
        "--max-new-tokens",
        "--max-tokens",
        dest="max_new_tokens",
        type=int,
        default=256,
        help="the answer's length limit in tokens (--max-tokens: the server's name)",
    )
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


def _add_run(sub) -> None:
    run = sub.add_parser("run", help="answer one prompt, streamed to stdout")
    _model_options(run)
    _compile_option(run)
    speculation.add_options(run)
    run.add_argument("text", nargs="?", metavar="PROMPT", help="the prompt (or -p PROMPT)")
    run.add_argument("--prompt", "-p", default=None)
    run.add_argument("--raw", action="store_true", help="send the prompt without chat template")
    fmt = run.add_mutually_exclusive_group()
    fmt.add_argument(
        "--json-schema", metavar="FILE", help="answer with JSON that matches this JSON schema"
    )
    fmt.add_argument("--json", action="store_true", help="answer with a JSON object")
    _sampling_options(run)
    run.set_defaults(func=_run)


def _add_chat(sub) -> None:
    chat = sub.add_parser("chat", help="an interactive chat in the terminal")
    _model_options(chat)
    _compile_option(chat)
    speculation.add_options(chat)
    _sampling_options(chat)
    chat.set_defaults(func=_chat)


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (see docs/serve.md)")
    _model_options(serve)
    _compile_option(serve)
    speculation.add_options(serve)
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
        "--task",
        choices=("generate", "embed"),
        default=None,
        help="embed: serve /v1/embeddings too (default: embed when the checkpoint has "
        "sentence-transformers files, modules.json; else generate)",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("ZOO_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $ZOO_API_KEY)",
    )
    serve.set_defaults(func=_serve)


def _add_bench(sub) -> None:
    b = sub.add_parser("bench", help="throughput, latency, memory and bandwidth figures")
    _model_options(b)
    _compile_option(b)
    speculation.add_options(b)
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
    b.set_defaults(func=bench_command, before_ranks=check_before_ranks)


def build_parser() -> argparse.ArgumentParser:
    """The `zoo` command's parser: one subcommand each, its handler in `func`."""
    p = argparse.ArgumentParser(prog="zoo", description="Download and run decoder-only LLMs.")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = p.add_subparsers(dest="command", required=True)  # each _add_*: one subcommand
    _add_run(sub)
    _add_chat(sub)
    _add_serve(sub)

    download = sub.add_parser("download", help="fetch a model into the hub cache")
    _model_options(download, optional=False)
    download.set_defaults(func=_download)

    about = sub.add_parser("info", help="architecture, parameters, dtype, KV bytes per token")
    _model_options(about, optional=False)
    about.set_defaults(func=info.info)

    _add_bench(sub)

    listing = sub.add_parser("list", help="the named models of registry.yaml")
    listing.set_defaults(func=info.list_models)
    sub.add_parser("plugins", help="loaded plugins and what they register").set_defaults(
        func=info.plugins
    )
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, read by `build_parser`. `zoo run MODEL --flag ... "PROMPT"`: argparse
    fills the optional positionals from one run of words only, so a prompt after the flags
    comes back unrecognized; it is the prompt."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "text", "") is None and len(rest) == 1 and not rest[0].startswith("-"):
        args.text, rest = rest[0], []
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    level = logging.DEBUG if args.debug else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s")
    tp = getattr(args, "tp", None) or 1
    try:
        speculation.speculative(args)  # its flags refused before a port, a rank or a load
        if tp > 1 and "LOCAL_RANK" not in os.environ:  # not a rank yet: start N of them
            from core.parallel.distributed import launch

            check = getattr(args, "before_ranks", None)  # said once, before N ranks say it
            if check is not None:
                check(args)
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
        if "LOCAL_RANK" in os.environ and ranks(args) > 1:  # rank 0 releases the others
            from core.parallel import distributed

            distributed.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
