"""The `zoo` command. Errors print one line and exit 1; `--debug` shows the traceback."""

from __future__ import annotations

import argparse
import logging
import sys

from core.errors import ZooError


def _info(args: argparse.Namespace) -> None:
    from core import load_model

    m = load_model(args.model, device=args.device, dtype=args.dtype, max_seq_len=16)
    c = m.config
    params = sum(p.numel() for p in m.net.parameters())
    print(f"model        {m.path}")
    print(f"architecture {c.model_type}")
    print(f"parameters   {params:,}")
    print(f"layers       {c.num_layers} x hidden {c.hidden_size}, vocab {c.vocab_size}")
    a = c.attention
    print(f"attention    {a.num_heads} heads, {a.num_kv_heads} kv heads, head_dim {a.head_dim}")
    print(f"rope         {type(c.rope).__name__} theta={c.rope.theta:g}")
    print(f"dtype        {c.dtype} (loaded as {str(m.dtype).removeprefix('torch.')})")
    print(f"KV bytes     {c.kv_bytes_per_token(m.dtype.itemsize):,} per token")


def _list(args: argparse.Namespace) -> None:
    from core.catalog import named_models

    for name, entry in named_models().items():
        arch, size = entry.get("architecture", "?"), entry.get("params", "?")
        print(f"{name:<22} {arch:<12} {size:>7}  {entry.get('repo', '')}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zoo", description="Run decoder-only LLMs.")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="describe a model: architecture, sizes, KV bytes per token")
    info.add_argument("model", help="a local checkpoint folder")
    info.add_argument("--device", default=None)
    info.add_argument("--dtype", default=None)
    info.set_defaults(func=_info)
    lst = sub.add_parser("list", help="the named models of registry.yaml")
    lst.set_defaults(func=_list)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING, format="%(message)s"
    )
    try:
        args.func(args)
    except ZooError as err:
        if args.debug:
            raise
        print(f"zoo: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
