"""The two sides of `zoo bench --compare llama.cpp` (core/cli/bench_llamacpp.py), each run in a
process of its own: `python -m core.cli.bench_worker zoo|llama.cpp CONFIG`. A worker loads the
model, makes one untimed run, then answers "run" (one timed greedy run) and "exit" (its peak
RSS) on stdin with JSON lines. Nothing here imports torch or llama_cpp at the top: the llama.cpp
worker never loads torch, so its RSS is llama.cpp's own."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any


def _zoo(cfg: dict[str, Any]):
    """(info, run) for Zoo: `load_model` with the command's options, `Model.generate`."""
    import torch

    from core import load_model
    from core.quantize import weight_formats

    t = time.perf_counter()
    # each timed run prefills the whole prompt, as the llama.cpp side does
    model = load_model(cfg["path"], max_seq_len=cfg["n_ctx"], prefix_cache=False, **cfg["load"])
    load_s = time.perf_counter() - t
    prompt, n = cfg["prompt"], cfg["new_tokens"]

    def run() -> dict[str, Any]:
        t = time.perf_counter()
        res = model.generate(prompt, max_new_tokens=n, temperature=0.0, ignore_eos=True)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        keys = ("time_to_first_token_s", "prefill_tokens_per_s", "decode_tokens_per_s")
        out = {k: res.timings[k] for k in keys}
        return {**out, "tokens_per_s": n / (time.perf_counter() - t), "tokens": res.token_ids}

    info = {
        "load_s": load_s,
        "threads": torch.get_num_threads(),
        "weight_bytes": sum(nbytes for _, nbytes in weight_formats(model.net).values()),
        "settings": {
            "device": str(model.device),
            "dtype": str(model.dtype).removeprefix("torch."),
            "compiled": model.step.compiled is not None,
        },
    }
    return info, run


def _llama(cfg: dict[str, Any]):
    """(info, run) for llama.cpp through llama-cpp-python's C API: the prompt ids as one batch,
    then one token per batch, each chosen by a greedy sampler."""
    import llama_cpp as L

    L.llama_log_set(_quiet(L), None)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = cfg["n_gpu_layers"]
    if any(f[0] == "use_extra_bufts" for f in L.llama_model_params._fields_):
        mp.use_extra_bufts = cfg["use_extra_bufts"]  # AMX / repacked weight layouts
    t = time.perf_counter()  # as Zoo's: the weights loaded and the KV cache made
    model = L.llama_model_load_from_file(cfg["path"].encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {cfg['path']}")
    prompt, n = cfg["prompt"], cfg["new_tokens"]
    cp = L.llama_context_default_params()
    cp.n_ctx = cfg["n_ctx"]
    cp.n_batch = len(prompt) + n
    cp.n_ubatch = min(cfg["n_ubatch"], cp.n_batch)
    cp.n_threads = cp.n_threads_batch = cfg["n_threads"]
    on, off = L.LLAMA_FLASH_ATTN_TYPE_ENABLED, L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.flash_attn_type = on if cfg["flash_attn"] else off
    ctx = L.llama_init_from_model(model, cp)
    load_s = time.perf_counter() - t
    greedy = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    L.llama_sampler_chain_add(greedy, L.llama_sampler_init_greedy())
    memory = L.llama_get_memory(ctx)
    ids, one = (L.llama_token * len(prompt))(*prompt), (L.llama_token * 1)()

    def decode(batch) -> None:
        if (rc := L.llama_decode(ctx, batch)) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def run() -> dict[str, Any]:
        L.llama_memory_clear(memory, True)
        L.llama_sampler_reset(greedy)
        t0 = time.perf_counter()
        decode(L.llama_batch_get_one(ids, len(prompt)))
        tokens = [L.llama_sampler_sample(greedy, ctx, -1)]
        t1 = time.perf_counter()  # as Zoo's timings: the first token ends the prefill
        for _ in range(n - 1):
            one[0] = tokens[-1]
            decode(L.llama_batch_get_one(one, 1))
            tokens.append(L.llama_sampler_sample(greedy, ctx, -1))
        t2 = time.perf_counter()
        return {
            "time_to_first_token_s": t1 - t0,
            "prefill_tokens_per_s": len(prompt) / (t1 - t0),
            "decode_tokens_per_s": (n - 1) / max(t2 - t1, 1e-9),
            "tokens_per_s": n / (t2 - t0),
            "tokens": tokens,
        }

    keys = ("n_threads", "n_ubatch", "use_extra_bufts", "flash_attn", "n_gpu_layers")
    settings = {k: cfg[k] for k in keys} | {"n_ubatch": cp.n_ubatch}
    info = {
        "load_s": load_s,
        "version": L.__version__,
        "threads": cfg["n_threads"],
        "weight_bytes": int(L.llama_model_size(model)),
        "settings": settings,
        "system": L.llama_print_system_info().decode().strip(),
    }
    return info, run


def _quiet(L):
    global _QUIET  # kept alive: llama.cpp calls it for as long as the process lives
    _QUIET = L.llama_log_callback(lambda level, text, user: None)
    return _QUIET


def _peak_rss() -> int:
    """This program's peak resident bytes: VmHWM, which starts afresh at exec, where Linux's
    ru_maxrss carries on from the process that forked it (here: the parent's)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) * 1024  # kB
    except (OSError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main(argv: list[str]) -> None:
    """Worker: load, run once (untimed), then answer "run" and "exit" lines with JSON lines."""
    engine, cfg = argv[0], json.loads(argv[1])
    # llama.cpp 0.3.36 may die on a multi-token batch (AMX: bench_llamacpp.py): no core file
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    reply = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's own channel ...
    os.dup2(2, 1)  # ... and whatever a library prints goes to stderr

    def send(obj: dict) -> None:
        reply.write(json.dumps(obj) + "\n")

    info, run = (_zoo if engine == "zoo" else _llama)(cfg)
    send({"info": info, "warmup": run()})
    for line in sys.stdin:
        if line.strip() == "run":
            send(run())
        else:  # "exit"
            send({"peak_rss_bytes": _peak_rss()})
            return


if __name__ == "__main__":
    main(sys.argv[1:])
