"""Quantized weights in a model: which weights may be kept quantized, how a checkpoint's blocks
become `QuantWeight`s at load, and quantizing float weights at load (`quantize="int8"|"int4"`).

A quantizable weight is the `weight` of a `Linear` (fused ones too), of the LM head or of the
token embedding, unless its module says `quantizable = False` (MLA's kv_b_proj, which attention
reads as a matrix). Such a parameter is swapped for a `QuantWeight` submodule of the same name
(gpt-fast's module swap, done on the weight instead of the layer), so the layers' code does not
change: `kernels.linear` dispatches on the weight's type. A MoE layer's stacked routed experts
stored as fp8 blocks (on GPUs that compute in fp8), MXFP4 (on GPUs) or GGML blocks (on CPUs)
are kept the same way, as one `QuantExperts` or `BlockExperts` (`stacked_experts`), which
`kernels.moe_experts` reads.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import Counter, defaultdict

import torch
from torch import nn

from core.errors import CheckpointError, RequestError
from core.layers import Embedding, Linear, LMHead
from core.layers.moe import StackedLinear
from kernels import blocks
from kernels.blocks import BlockExperts, BlockWeight
from kernels.qweight import FORMATS, FP8, QuantExperts, QuantStack, QuantWeight, cat_rows
from kernels.qweight import quantize as quantize_tensor

log = logging.getLogger("zoo")

AT_LOAD = ("int8", "int4")  # load_model(quantize=...)
MXFP4 = "mxfp4"  # e2m1 codes with e8m0 block scales (gpt-oss)
KEPT = [*(f for f in FORMATS if f not in AT_LOAD), FP8]  # formats a checkpoint may bring
FP8_CAPABILITY = (8, 9)  # Ada, Hopper and later compute in e4m3 (Triton's float8e4nv)


def fp8_native(device: torch.device) -> bool:
    """Whether fp8 weights stay fp8 on `device`: a CUDA GPU of compute capability 8.9+. On
    other devices a block-scaled fp8 checkpoint is dequantized at load."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


def keeps(fmt: str, device: torch.device) -> bool:
    """Whether a checkpoint's `fmt` blocks are kept on `device`: GGUF's everywhere, but MXFP4
    only where a kernel takes it (CUDA GPUs: Triton's `QuantWeight` / `QuantExperts`; CPUs: the
    C kernels' blocks); fp8 where the GPU computes in it (`fp8_native`)."""
    if fmt == MXFP4:
        device = torch.device(device)
        return device.type == "cuda" or (device.type == "cpu" and blocks.available())
    return fmt != FP8 or fp8_native(device)


def quantizable(net: nn.Module, target: str) -> bool:
    """Whether parameter `target` may be kept as a `QuantWeight`."""
    module_name, _, leaf = target.rpartition(".")
    module = net.get_submodule(module_name)
    return (
        leaf == "weight"
        and isinstance(module, (Linear, LMHead, Embedding))
        and getattr(module, "quantizable", True)
    )


def split_plan(
    net: nn.Module, ckpt, plan: list, device: torch.device
) -> tuple[dict[str, list], list]:
    """Split the loader's plan into the parameters kept quantized on `device` ({target:
    [(checkpoint name, index)] in row order}) and the rest. A block-format tensor whose format
    Zoo cannot keep is an error that names it (`dequantize=True` converts it to floats)."""
    fmt_of = getattr(ckpt, "quant_format", None)
    if fmt_of is None:
        return {}, plan
    by_target: dict[str, list] = defaultdict(list)
    for name, target, index in plan:
        by_target[target].append((name, index))
    kept: dict[str, list] = {}
    for target, parts in by_target.items():
        formats = [fmt_of(name) for name, _ in parts]
        experts = stacked_experts(net, target, formats, device)
        if any(f is None for f in formats) or not (experts or quantizable(net, target)):
            continue  # floats, or a weight that must be float: dequantized as before
        if not all(keeps(f, device) for f in formats):
            continue  # fp8 off a GPU that computes in it: dequantized
        for (name, _), fmt in zip(parts, formats, strict=True):
            if fmt not in KEPT:
                stored = getattr(ckpt, "stored_name", lambda n: n)(name)
                raise CheckpointError(
                    f"{ckpt.path}: tensor {stored!r} is stored as {fmt.upper()}, which Zoo cannot "
                    f"keep quantized (it keeps {', '.join(f.upper() for f in KEPT)}); "
                    "load with dequantize=True (zoo --dequantize) to convert it to floats"
                )
        if experts and _by_expert(parts):  # shards (e, rows) or (e,): by expert, then rows
            kept[target] = sorted(parts, key=lambda p: (p[1][0], _start(p[1][1:])))
        else:
            kept[target] = sorted(parts, key=lambda p: _start(p[1]))
    return kept, [p for p in plan if p[1] not in kept]


def held_bytes(net: nn.Module, ckpt, plan: list, dtype: torch.dtype, device: torch.device,
               keep_quantized: bool) -> tuple[int, int]:  # fmt: skip
    """(bytes, parameters kept quantized): what the weights of `net` take once loaded, each
    in the form it is held: a weight kept quantized as the checkpoint stores it (repacking keeps
    the size), others in `dtype` (float32 for parameters marked keep_fp32). `plan`: the
    loader's (`plan_load`)."""
    kept = split_plan(net, ckpt, plan, device)[0] if keep_quantized else {}
    stored = getattr(ckpt, "stored_bytes", None)
    total = 0
    for name, p in net.named_parameters():
        if name in kept and stored is not None:
            total += sum(stored(n) for n, _ in kept[name])
        else:
            total += p.numel() * (4 if getattr(p, "keep_fp32", False) else dtype.itemsize)
    return total, len(kept)


def _start(index: tuple) -> int:
    return index[0].start if index else 0


def stacked_experts(net: nn.Module, target: str, formats: list, device: torch.device) -> bool:
    """Whether `target` is a MoE layer's stacked routed experts kept as stored: fp8 blocks as
    a `QuantExperts` (GPUs that compute in fp8; no biases), MXFP4 on CUDA GPUs as a
    `QuantExperts` (gpt-oss's biases too), GGML blocks (GGUF's, MXFP4) on CPUs as a
    `BlockExperts` (GPUs dequantize GGUF's other formats)."""
    module_name, _, leaf = target.rpartition(".")
    module = net.get_submodule(module_name)
    if leaf != "weight" or not isinstance(module, StackedLinear):
        return False
    if all(f == FP8 for f in formats):  # (fp8 experts with biases: none ship, none tested)
        return not hasattr(module, "bias")
    if all(f == MXFP4 for f in formats) and torch.device(device).type == "cuda":
        return True
    cpu = torch.device(device).type == "cpu" and blocks.available()
    return cpu and all(f in blocks.FORMATS for f in formats)


def read_kept(ckpt, parts: list, dtype: torch.dtype, device: torch.device):
    """One parameter's blocks, its shards stacked in row order, on `device`; stacked experts'
    shards ((e, rows) indices), or a stacked tensor, become one `QuantExperts`. On CPUs, GGML
    blocks become `BlockWeight`s repacked for kernels/cpu/qdot.c (consecutive shards of one format
    together)."""
    if device.type == "cpu" and hasattr(ckpt, "blocks") and blocks.available():
        w = _repacked_experts(ckpt, parts) if _by_expert(parts) else None
        w = w or _repacked(ckpt, [name for name, _ in parts])
        if w is not None:
            for m in w.modules():
                m.dtype = dtype
            return w
    ws = [ckpt.read_quantized(name) for name, _ in parts]
    if _by_expert(parts):  # stacked experts, sorted by expert
        per_expert = defaultdict(list)
        for (_, index), w in zip(parts, ws, strict=True):
            per_expert[index[0]].append(w)
        w = QuantExperts([cat_rows(per_expert[e]) for e in sorted(per_expert)]).to(device)
    else:
        w = cat_rows(ws).to(device)
    for m in w.modules():
        m.dtype = dtype
    return w


def _by_expert(parts: list) -> bool:
    """Whether a kept parameter's shards are stacked experts' ((e, rows) or (e,) indices)."""
    return bool(parts[0][1]) and isinstance(parts[0][1][0], int)


def _repacked_experts(ckpt, parts: list) -> BlockExperts | None:
    """Stacked experts' shards (sorted by expert) as a `BlockExperts`: each expert's shards
    (gate, up) repacked together; the file's pages are released once all are copied."""
    names = defaultdict(list)
    for name, index in parts:
        names[index[0]].append(name)
    experts = [_repacked(ckpt, names[e], release=False) for e in sorted(names)]
    if any(w is None for w in experts):
        return None
    for name, _ in parts:
        _release(ckpt, name)
    return BlockExperts(experts)


def _release(ckpt, name: str, release: bool = True) -> None:
    """Let the tensor's pages in the checkpoint's mapping go (readers that map files)."""
    if release and hasattr(ckpt, "release"):
        ckpt.release(name)


def _repacked(
    ckpt, names: list[str], release: bool = True
) -> BlockWeight | QuantStack | BlockExperts | None:
    """The tensors `names` (stacked along the rows) as block weights, runs of one format in
    one `BlockWeight`; None where a format is not one the CPU kernels take (or a tensor is
    not a matrix). Each tensor's pages in the file's mapping are released once copied
    (unless not `release`)."""
    if any(ckpt.quant_format(name) not in blocks.FORMATS for name in names):
        return None  # (fp8: a QuantWeight of its own)
    read = [(name, *ckpt.blocks(name)) for name in names]  # (name, format, bytes, row order)
    if len(read) == 1 and read[0][2].ndim == 3:  # experts stored stacked: (E, rows, bytes)
        _, kind, raw, order = read[0]
        shape = ckpt.shape(names[0])[1:]
        out = BlockExperts([blocks.repack(kind, [r], shape, [order]) for r in raw])
        _release(ckpt, names[0], release)
        return out
    if any(raw.ndim != 2 for _, _, raw, _ in read):
        return None
    cols = ckpt.shape(names[0])[-1]
    out = []
    for kind, run in itertools.groupby(read, key=lambda r: r[1]):
        run = list(run)
        rows = sum(raw.shape[0] for _, _, raw, _ in run)
        out.append(blocks.repack(kind, [r[2] for r in run], (rows, cols), [r[3] for r in run]))
        for name, *_ in run:
            _release(ckpt, name, release)
    return out[0] if len(out) == 1 else QuantStack(out)


def install(net: nn.Module, target: str, w: QuantWeight | QuantStack) -> dict[str, torch.Tensor]:
    """Put `w` in place of parameter `target`; its buffers, for load_state_dict."""
    module_name, _, leaf = target.rpartition(".")
    module = net.get_submodule(module_name)
    delattr(module, leaf)
    setattr(module, leaf, w)
    return {f"{target}.{k}": v for k, v in w.state_dict().items()}


def check_kind(kind: str) -> None:
    """A `quantize=` value Zoo does not make is a `RequestError` naming the ones it does."""
    if kind not in AT_LOAD:
        raise RequestError(f"quantize={kind!r} is not one of {', '.join(AT_LOAD)}")


def quantize_model(net: nn.Module, kind: str) -> None:
    """Quantize every quantizable float weight of a loaded model (mlx-lm's `-q`, gpt-fast's
    int8 / int4) in groups of 32 columns: int8 symmetric, int4 with a minimum. Weights whose
    rows do not split into groups of 32 stay in float."""
    check_kind(kind)
    skipped = []
    for name, p in list(net.named_parameters()):
        if not quantizable(net, name) or p.dim() != 2:
            continue
        if p.shape[1] % 32:
            skipped.append(name)
            continue
        w = quantize_tensor(p.data, kind).to(p.device)
        w.dtype = p.dtype
        if p.device.type == "cpu" and blocks.available():  # the same blocks, for kernels/cpu/qdot.c
            w = blocks.from_quant(w)
        install(net, name, w)
    if skipped:
        log.info("zoo: %d weight(s) left in float (rows not a multiple of 32): %s",
                 len(skipped), ", ".join(skipped[:4]))  # fmt: skip


def weight_formats(net: nn.Module) -> dict[str, tuple[int, int]]:
    """{format: (parameters, resident bytes)} over the whole model: `zoo info`'s table.
    Float tensors count under their dtype's name (`float32`)."""
    out: Counter = Counter()
    nbytes: Counter = Counter()
    for m in net.modules():  # each module once, a tied embedding too
        if isinstance(m, QuantWeight | QuantExperts | BlockWeight):
            out[m.fmt.name] += math.prod(m.shape)
            nbytes[m.fmt.name] += m.nbytes
    for _, p in net.named_parameters():
        kind = str(p.dtype).removeprefix("torch.")
        out[kind] += p.numel()
        nbytes[kind] += p.numel() * p.element_size()
    return {k: (out[k], nbytes[k]) for k in sorted(out, key=lambda k: -nbytes[k])}
