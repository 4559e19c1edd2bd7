"""`zoo bench`: load time, prefill and decode throughput, memory, and achieved bandwidth, with an
optional same-run comparison against transformers. A benchmark prints figures; it asserts
nothing about speed."""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.cli import speculation
from core.errors import RequestError

# Peak memory bandwidth (GB/s) of devices we can name, for "fraction of peak".
PEAK_GBPS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0, "L40S": 864.0, "A10G": 600.0}


@dataclass
class BenchReport:
    model: str
    device: str
    dtype: str
    load_s: float
    params: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    prefill: dict[int, dict[str, float]] = field(default_factory=dict)  # prompt len -> figures
    decode: dict[int, dict[str, float]] = field(default_factory=dict)  # batch -> figures
    peak_memory_bytes: int = 0
    peak_bandwidth_gbps: float | None = None
    compare: dict[str, Any] = field(default_factory=dict)
    compiled: bool = False  # decode step compiled (load_model(compile=True), --compile)
    peak_source: str = ""  # where peak_bandwidth_gbps comes from
    speculative: str = ""  # the method decoding drafts with ("": none); acceptance per batch


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA; a no-op on CPUs), so a timer reads it whole."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gbps(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_GBPS.items() if k in name), None)


# A CPU has no datasheet figure we can look up: its peak is measured as the rate a one-row
# fp32 product through the layers' own `kernels.linear` (so the split over the threads where
# it pays) streams a weight far larger than any cache: what a memory-bound decode step can
# reach here. 1 GiB: above the 260 MiB L3 of the CI Xeons.
CPU_PROBE_BYTES = 1 << 30


def read_per_step(net, weight_bytes: int, rows: int) -> float:
    """The weight bytes a decode step of `rows` rows reads: all of them, less the routed experts
    no row chose (of E experts, k per row chosen at random: E (1 - (1 - k / E) ^ rows) read)
    and, untied from the head, the token embedding (a row per token)."""
    from core.layers.hash_moe import HashMoE
    from core.layers.moe import MoE

    unread = 0.0
    if net.lm_head.tied_to[0] is None:
        unread += _nbytes(net.model.embed_tokens.weight)
    for m in net.modules():
        if isinstance(m, MoE | HashMoE):  # (DeepSeek V4's hash-routed layers: the same count)
            spec, ex = m.gate.spec, m.experts
            held = sum(_nbytes(p.weight) for p in (ex.gate_up_proj, ex.down_proj))
            unread += held * (1 - spec.top_k / spec.num_experts) ** rows
    return weight_bytes - unread


def _nbytes(w) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes


def cpu_stream_gbps(nbytes: int = CPU_PROBE_BYTES, repeat: int = 5) -> float:
    """GB/s of a one-row fp32 `kernels.linear` over an `nbytes` weight (best of `repeat`)."""
    import kernels

    w = torch.empty(nbytes // 4 // 1024, 1024).uniform_()
    x = torch.ones(1, 1024)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeat + 1):  # the first run faults the pages in
            t = time.perf_counter()
            kernels.linear(x, w)
            best = min(best, time.perf_counter() - t)
    return w.nbytes / best / 1e9


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def random_model(
    shape: dict[str, Any],
    *,
    device,
    dtype,
    max_seq_len: int,
    max_batch_size: int,
    compile=False,
    snapshots: int = 0,
):
    """A `Model` of a registry entry's shape (its config.json keys) with random weights; its
    cache keeps `snapshots` of each row's recurrent state (none: a benchmark of steps reuses no
    prefix, and a large shape's snapshots would take memory that its check does not count)."""
    from core.api import resolve_device_dtype
    from core.model import Model
    from core.modeling import CausalLM
    from core.plugins import registry

    arch = registry().architecture(shape.get("model_type"), source="registry shape")
    cfg = arch.config.from_dict(shape, source="registry shape").to_runtime()
    dev, dt = resolve_device_dtype(device, dtype, "bfloat16")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        with dev, torch.no_grad():
            net = CausalLM(cfg)
            for p in net.parameters():
                p.normal_(0.0, 0.02)
            for m in net.modules():  # DeepSeek V4's hash routing: each token's k distinct
                table = getattr(m, "tid2eid", None)  # expert ids (noise would send all to 0),
                if table is not None:  # in fp32 as the loader keeps them (exact past 256)
                    draw = torch.rand(table.shape[0], m.spec.num_experts).argsort(dim=-1)
                    table.data = draw[:, : table.shape[1]].to(torch.float32)
    finally:
        torch.set_default_dtype(default)
    net.setup_caches(max_batch_size, max_seq_len, snapshots=snapshots)
    return Model(net.eval(), None, Path(f"<random {cfg.model_type}>"), compile=compile)


def check_shape_fits(
    name: str, shape: dict[str, Any], *, device, dtype, max_seq_len: int, max_batch_size: int
) -> tuple[torch.device, int]:
    """Refuse, before allocating anything, a registry shape whose random weights and KV cache
    do not fit in the free memory of the device (a 284B shape would otherwise fill a machine's
    RAM page by page as the weights are drawn, until the kernel kills a process). The margin
    is load_model's: a tenth of the free memory and 512 MiB kept for everything else.
    Returns the device and the bytes of the weights."""
    from core.api import FIT_SHARE, FIT_SPARE, available_memory, resolve_device_dtype
    from core.modeling import CausalLM
    from core.plugins import registry

    arch = registry().architecture(shape.get("model_type"), source="registry shape")
    cfg = arch.config.from_dict(shape, source="registry shape").to_runtime()
    dev, dt = resolve_device_dtype(device, dtype, "bfloat16")
    with torch.device("meta"):
        net = CausalLM(cfg)
    params = sum(p.numel() for p in net.parameters())
    weights = params * dt.itemsize
    cache = cfg.kv_bytes(dt.itemsize, max_seq_len, max_batch_size)
    free = available_memory(dev)
    if free is None or weights + cache <= FIT_SHARE * free - FIT_SPARE:
        return dev, weights
    gib = 2**30
    room = FIT_SHARE * free - FIT_SPARE  # for the weights of the shapes suggested
    fits = [n for n, e in _named_shapes().items() if _params(e) * dt.itemsize < room]
    raise RequestError(
        f"--random-weights {name!r}: {params / 1e9:.1f}B parameters need {weights / gib:.1f} GiB "
        f"in {str(dt).removeprefix('torch.')} (+ {cache / gib:.2f} GiB of KV cache), but only "
        f"{free / gib:.1f} GiB is free on {dev}; bench a smaller shape"
        + (f" ({', '.join(fits)})" if fits else "")
        + " or on a device with more memory"
    )


# A generous CPU memory bandwidth (GB/s), which few CPUs reach: a floor on a decode step's time
CPU_FAST_GBPS = 50.0


def slow_run_note(weights: int, *, batches: list[int], decode_tokens: int, repeat: int) -> str:
    """A note for stderr where the decode figures alone take over a minute on a CPU (each step
    reads every weight; each figure runs repeat + 1 times, the first untimed); else ''."""
    steps = len(batches) * decode_tokens * (repeat + 1)
    floor = steps * weights / (CPU_FAST_GBPS * 1e9)
    if floor < 60:
        return ""
    return (
        f"zoo bench: note: {weights / 2**30:.1f} GiB of weights on the CPU, read by each of "
        f"{steps} decode steps: at least {floor / 60:.0f} min at {CPU_FAST_GBPS:g} GB/s; "
        "--prompt-lens 128 --batches 1 --decode-tokens 8 --repeat 1 for a short run"
    )


def _named_shapes() -> dict[str, dict[str, Any]]:
    from core.catalog import named_models

    return {n: e for n, e in named_models().items() if e.get("shape")}


def _params(entry: dict[str, Any]) -> float:
    """registry.yaml's `params` ('135M', '4.63B', '1026B') as a number (inf when unreadable)."""
    text = str(entry.get("params", ""))
    scale = {"M": 1e6, "B": 1e9, "T": 1e12}.get(text[-1:])
    try:
        return float(text[:-1]) * scale if scale else float("inf")
    except ValueError:
        return float("inf")


def random_checkpoint(shape: dict[str, Any], folder: Path, *, device, dtype, seed: int = 0) -> Path:
    """Write a registry shape with random weights as a hub-style checkpoint (config.json and
    safetensors, by transformers' `save_pretrained`), for `--random-weights --compare`: Zoo and
    transformers then load the same weights from disk, each its own way, with no download.

    The model is built on the CPU (so that only the benchmarked copies occupy a GPU) in the
    dtype the run uses (as `load_model` picks it: bf16 on GPUs, fp32 on CPUs, unless given);
    `folder` needs room for the weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from core.api import resolve_device_dtype

    _, dt = resolve_device_dtype(device, dtype, "bfloat16")
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape), dtype=dt)
    hf.save_pretrained(folder)
    return folder


def random_prompt(vocab: int, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 1, (batch, length), generator=g).tolist()


def measure(
    model, *, prompt_lens, batches, decode_tokens: int, repeat: int, peak_gbps: float | None = None
) -> BenchReport:
    """Prefill and decode figures through `Model.generate` (what users get), best of `repeat`.

    peak_gbps: the device's peak memory bandwidth; by default a datasheet figure for GPUs we
    can name, and measured on CPUs (`cpu_stream_gbps`). Every run prefills its whole prompt:
    the model's prefix cache is turned off (repeats share their prompts)."""
    from core.quantize import weight_formats

    model.prefix_cache = False

    dev, cfg = model.device, model.config
    itemsize = model.net.kv_cache.dtype.itemsize  # the cache's own (fp16 on CPUs, quantized)
    formats = weight_formats(model.net).values()  # quantized weights are no parameters
    weight_bytes = sum(nbytes for _, nbytes in formats)
    report = BenchReport(
        model=str(model.path),
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        dtype=str(model.dtype).removeprefix("torch."),
        load_s=0.0,
        params=sum(n for n, _ in formats),
        weight_bytes=weight_bytes,
        kv_bytes_per_token=cfg.kv_bytes_per_token(itemsize),
        kv_cache_bytes=model.net.kv_cache.nbytes,
        compiled=model.step.compiled is not None,
        speculative=speculation.method(model),
    )
    greedy = {"temperature": 0.0, "ignore_eos": True}
    # Each figure's first run is not timed: it builds what that shape needs (kernels; compiled,
    # the batch size's graph and, on CUDA, its capture as a CUDA graph on a later call).
    for n in prompt_lens:
        runs = []
        for r in range(repeat + 1):
            prompt = random_prompt(cfg.vocab_size, 1, n, r)[0]
            res = model.generate(prompt, max_new_tokens=1, **greedy)
            runs.append(res.timings["time_to_first_token_s"])
        best = min(runs[1:])
        report.prefill[n] = {"time_to_first_token_s": best, "tokens_per_s": n / best}
    for b in batches:
        prompts = random_prompt(cfg.vocab_size, b, 32)
        rates, drafts = [], speculation.snapshot(model)
        for _ in range(repeat + 1):
            res = model.generate(
                prompts if b > 1 else prompts[0], max_new_tokens=decode_tokens, **greedy
            )
            rates.append((res if b == 1 else res[0]).timings["decode_tokens_per_s"])
        tps = max(rates[1:])
        step_s = b / tps
        context = 32 + decode_tokens / 2  # average tokens attended per row
        bytes_per_step = read_per_step(model.net, weight_bytes, b)
        bytes_per_step += b * context * report.kv_bytes_per_token
        gbps = bytes_per_step / step_s / 1e9
        report.decode[b] = {"tokens_per_s": tps, "step_ms": step_s * 1e3, "achieved_gbps": gbps}
        report.decode[b].update(speculation.since(model, drafts))  # (the runs' drafts)
    synchronize(dev)
    report.peak_memory_bytes = _peak_memory(dev)
    if peak_gbps:
        report.peak_bandwidth_gbps, report.peak_source = peak_gbps, "given"
    elif sheet := _peak_gbps(dev):
        report.peak_bandwidth_gbps, report.peak_source = sheet, "datasheet"
    elif dev.type == "cpu":  # after reading peak memory: the probe's 1 GiB is not the model's
        report.peak_bandwidth_gbps = cpu_stream_gbps()
        report.peak_source = "measured: one-row fp32 kernels.linear over a 1 GiB weight"
    for row in report.decode.values():
        if report.peak_bandwidth_gbps:
            row["fraction_of_peak"] = row["achieved_gbps"] / report.peak_bandwidth_gbps
    return report


def compare_transformers(model, source: Path, *, prompt: list[int], decode_tokens: int,
                         repeat: int, compile_hf: bool) -> dict[str, Any]:  # fmt: skip
    """Greedy generate of the same prompt on the same weights, alternating Zoo and
    transformers; returns median end-to-end tokens/s of each and the ratio. Zoo's prefix cache
    is turned off: each run prefills the whole prompt, as transformers' does."""
    model.prefix_cache = False
    from transformers import AutoModelForCausalLM

    kw = {"dtype": model.dtype}
    if source.is_file():  # GGUF
        kw["gguf_file"] = source.name
        source = source.parent
    hf = AutoModelForCausalLM.from_pretrained(source, **kw).to(model.device).eval()
    if compile_hf:
        # transformers' fastest setting: a static cache, whose decode steps `generate` compiles
        # itself (its CompileConfig: mode "reduce-overhead", CUDA graphs on GPUs); on GPUs only,
        # unless told to compile on any device
        from transformers import CompileConfig

        hf.generation_config.cache_implementation = "static"
        hf.generation_config.compile_config = CompileConfig()
        hf.generation_config.compile_config._compile_all_devices = True
    # eos ignored as Zoo's `ignore_eos` does: it may be chosen, and generation goes on after it
    # (min_new_tokens would instead forbid it, and the two would part at the first eos)
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([prompt], device=model.device)
    hf_kw = dict(max_new_tokens=decode_tokens, do_sample=False)

    def run_hf() -> tuple[float, list[int]]:
        synchronize(model.device)
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), **hf_kw)
        synchronize(model.device)
        return decode_tokens / (time.perf_counter() - t), out[0, len(prompt) :].tolist()

    def run_zoo() -> tuple[float, list[int]]:
        t = time.perf_counter()
        res = model.generate(prompt, max_new_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
        synchronize(model.device)
        return decode_tokens / (time.perf_counter() - t), res.token_ids

    # warm-up (and compilation) outside the timed runs; its tokens show both ran the same model
    (_, hf_tokens), (_, zoo_tokens) = run_hf(), run_zoo()
    same = 0  # greedy tokens equal before the first difference (bf16 may flip a near-tie)
    while same < min(len(zoo_tokens), len(hf_tokens)) and zoo_tokens[same] == hf_tokens[same]:
        same += 1
    zoo, theirs = [], []
    for _ in range(repeat):  # alternate, so drift in clocks or load hits both alike
        zoo.append(run_zoo()[0])
        theirs.append(run_hf()[0])
    z, h = statistics.median(zoo), statistics.median(theirs)
    compiled = hasattr(hf, "_compiled_call")  # what generate compiled, not what was asked
    return {
        "peer": "transformers" + (" (static cache + torch.compile)" if compiled else ""),
        "prompt_tokens": len(prompt),
        "new_tokens": decode_tokens,
        "same_tokens": same,
        "zoo_tokens_per_s": z,
        "transformers_tokens_per_s": h,
        "speedup": z / h,
        "runs": {"zoo": zoo, "transformers": theirs},
    }


def render(report: BenchReport) -> str:
    """The report as a plain-text table."""
    gib = 2**30
    lines = [
        f"model    {report.model}  ({report.params / 1e6:,.0f}M parameters, {report.dtype}"
        f"{', decode step compiled' if report.compiled else ''}"
        f"{', speculative ' + report.speculative if report.speculative else ''})",
        f"device   {report.device}; load {report.load_s:.2f} s; peak memory "
        f"{report.peak_memory_bytes / gib:.2f} GiB",
        f"weights  {report.weight_bytes / gib:.2f} GiB; KV {report.kv_bytes_per_token:,} B/token, "
        f"cache {report.kv_cache_bytes / gib:.3f} GiB",
    ]
    if report.peak_bandwidth_gbps:
        lines.append(f"peak     {report.peak_bandwidth_gbps:,.1f} GB/s ({report.peak_source})")
    lines += [
        "",
        f"{'prefill':>10} {'TTFT ms':>10} {'tokens/s':>12}",
    ]
    for n, r in report.prefill.items():
        lines.append(
            f"{n:>10} {r['time_to_first_token_s'] * 1e3:>10.1f} {r['tokens_per_s']:>12,.0f}"
        )
    spec = f" {'accepted':>9} {'tok/step':>9}" if report.speculative else ""
    lines += ["", f"{'decode B':>10} {'step ms':>10} {'tokens/s':>12} {'GB/s':>10} {'of peak':>8}"
              + spec]  # fmt: skip
    for b, r in report.decode.items():
        frac = f"{r['fraction_of_peak']:.0%}" if "fraction_of_peak" in r else "n/a"
        lines.append(
            f"{b:>10} {r['step_ms']:>10.2f} {r['tokens_per_s']:>12,.1f} "
            f"{r['achieved_gbps']:>10.1f} {frac:>8}" + (speculation.columns(r) if spec else "")
        )
    if spec:
        lines.append("   (speculative: step ms and GB/s per token, as if each took a step)")
    if report.compare.get("peer") == "llama.cpp":
        from core.cli.bench_llamacpp import render_lines

        lines += ["", *render_lines(report.compare)]
    elif report.compare:
        c = report.compare
        lines += [
            "",
            f"vs {c['peer']}: {c['prompt_tokens']}-token prompt, {c['new_tokens']} new tokens, "
            f"end to end: zoo {c['zoo_tokens_per_s']:.1f} tok/s, transformers "
            f"{c['transformers_tokens_per_s']:.1f} tok/s -> {c['speedup']:.2f}x",
            f"   greedy tokens the same as transformers': the first {c['same_tokens']} of "
            f"{c['new_tokens']}",
        ]
    return "\n".join(lines)


def write_json(report: BenchReport, path: str) -> None:
    data = json.dumps(asdict(report), indent=2)
    if path == "-":
        print(data, file=sys.stdout)
    else:
        Path(path).write_text(data + "\n")


def parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise RequestError(f"--{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise RequestError(f"--{what} needs positive integers, got {text!r}")
    return values
