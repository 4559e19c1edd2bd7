"""Per op, per (device, dtype): run the Triton launcher or the torch reference.

`ZOO_KERNELS` picks the policy, read on every call so tests can flip it:
- `auto` (default): Triton for CUDA tensors where triton is installed and the GPU supports the
  dtype (bf16 needs sm80+); the torch reference everywhere else, except the small ops that
  `kernels.cpu.ops` runs as one C call each for eager fp32 CPU tensors (rms_norm, rope), and
  sparse_mla_attention, whose Triton path (not yet measured on a GPU) is `triton`'s only.
- `triton`: Triton always, also for CPU tensors under `TRITON_INTERPRET=1`; raises `KernelError`
  instead of falling back when a kernel cannot run.
- `torch`: the references in `kernels.reference` always.

The choice is cached per (op, policy, device, dtype, interpreter flag) and logged once on the
"zoo" logger (not when first made inside a torch.compile trace, where a log call would break
the graph), so the hot path costs two env lookups and one dict lookup. Triton modules are
imported only when first chosen (all of them when a compiled decode step is built: `prepare`):
importing `kernels` works without triton installed.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F

from kernels import cpu, reference
from kernels.blocks import BlockExperts, BlockWeight
from kernels.cpu import build as cpu_build
from kernels.cpu import ops as cpu_ops
from kernels.cpu import quant as cpu_quant
from kernels.qweight import QuantStack, QuantWeight

log = logging.getLogger("zoo")

ENV = "ZOO_KERNELS"
MODES = ("auto", "triton", "torch")
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class KernelError(Exception):
    """A Triton kernel was demanded (ZOO_KERNELS=triton) but cannot run, or got bad inputs.

    Kernels' own error type (`kernels` imports nothing from `core`): the core reports it to
    its users as a `core.ZooError` too (core.modeling.kernel_errors)."""


def require(ok: bool, op: str, msg: str) -> None:
    """Launcher-side argument check: raise KernelError("<op>: <msg>") unless ok."""
    if not ok:
        raise KernelError(f"{op}: {msg}")


def check_features(op, heads, device, window, softcap, sinks) -> None:
    """Launcher-side checks of attention's optional features (see reference.attention)."""
    require(window is None or (isinstance(window, int) and window >= 1), op, f"window {window!r}")
    require(softcap is None or softcap > 0, op, f"softcap {softcap!r} must be positive")
    if sinks is not None:
        require(sinks.shape == (heads,), op, f"sinks {tuple(sinks.shape)} != ({heads},)")
        require(sinks.device == device and sinks.is_contiguous(), op, "sinks on q's device")


def check_operands(op, q, qpe, k, kpe, v) -> None:
    """Launcher-side checks of attention's operands (q (B, Hq, [T,] D) over a cache k (B',
    Hkv, S, D), B' >= B; v, q_pe, k_pe or None): whole GQA groups, matching shapes, last dims
    contiguous, one device, the cache's dtype."""
    bsz, hq, d = q.shape[0], q.shape[1], q.shape[-1]
    hkv = k.shape[1]
    require(hq % hkv == 0, op, f"{hq} query heads are not a multiple of {hkv} kv heads")
    require(k.shape[0] >= bsz and k.shape[3] == d, op, f"k {tuple(k.shape)} vs q {q.shape}")
    for name, t in (("q", q), ("k", k), ("v", v), ("q_pe", qpe), ("k_pe", kpe)):
        if t is not None:
            require(t.stride(-1) == 1, op, f"{name} must be contiguous in its last dim")
            require(t.device == q.device, op, f"{name} on {t.device}, q on {q.device}")
            require(t.dtype == k.dtype, op, f"{name} is {t.dtype}, the cache is {k.dtype}")


def check_keep(op, keep, q, s: int) -> torch.Tensor | None:
    """Launcher-side check of a key selection keep (B, T, S) bool for q (B, H, T, D) over S
    cached keys -> the uint8 view the kernels read (1 = kept), contiguous in S; None: None."""
    if keep is None:
        return None
    want = (q.shape[0], q.shape[2], s)
    require(
        keep.shape == want and keep.dtype == torch.bool,
        op,
        f"keep must be {want} bool, got {tuple(keep.shape)} {keep.dtype}",
    )
    require(keep.device == q.device, op, f"keep on {keep.device}, q on {q.device}")
    return (keep if keep.stride(-1) == 1 else keep.contiguous()).view(torch.uint8)


def softcap_factors(scale: float, softcap: float | None) -> tuple[float, float]:
    """(cap_in, cap_out) such that the kernels' log2-domain score is cap_out * tanh(cap_in *
    q.k) = log2(e) * softcap * tanh(scale * q.k / softcap); (0, 0) without a soft-cap."""
    if softcap is None:
        return 0.0, 0.0
    return scale / softcap, softcap * 1.4426950408889634


def interpreting() -> bool:
    """Whether `@triton.jit` decorates into the CPU interpreter right now (TRITON_INTERPRET)."""
    try:
        from triton import knobs  # triton >= 3.4 reads the variable through knobs

        return bool(knobs.runtime.interpret)
    except ImportError:
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@cache
def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as e:  # triton ships for Linux only
        return f"triton is not installed ({e}); `pip install triton` on Linux"
    return None


def kernel_module(name: str):
    """Import a kernel module, re-decorating it if TRITON_INTERPRET changed since its import
    (`@triton.jit` reads the variable when it decorates)."""
    stale = False
    for n in ("kernels.casting", name):  # casting first: the kernel module imports its helpers
        mod = importlib.import_module(n)
        if stale or interpreting() != mod.INTERPRETED:
            mod, stale = importlib.reload(mod), True
    return mod


def _lens(start_pos: int | torch.Tensor) -> torch.Tensor | None:
    """Decode: per-row start positions -> per-row visible lengths; an int start_pos sees the
    whole cache slice (S = start_pos + 1), so no lengths are needed."""
    return start_pos + 1 if isinstance(start_pos, torch.Tensor) else None


def _attention_launcher() -> Callable:
    dec = kernel_module("kernels.decode_attention")
    pre = kernel_module("kernels.prefill_attention")

    def attention(q, k, v, start_pos, scale, window=None, softcap=None, sinks=None):
        extra = dict(window=window, softcap=softcap, sinks=sinks)
        if q.shape[2] == 1:  # one new token per row: split-K flash-decoding
            return dec.decode_attention(q, k, v, scale, seq_lens=_lens(start_pos), **extra)
        return pre.prefill_attention(q, k, v, start_pos, scale, **extra)

    return attention


def _mla_launcher() -> Callable:
    dec = kernel_module("kernels.decode_attention")
    pre = kernel_module("kernels.prefill_attention")

    def mla_attention(q_lat, q_pe, latent, k_pe, start_pos, scale):
        if q_lat.shape[2] == 1:
            return dec.mla_decode_attention(q_lat, q_pe, latent, k_pe, scale, _lens(start_pos))
        return pre.mla_prefill_attention(q_lat, q_pe, latent, k_pe, start_pos, scale)

    return mla_attention


def _sparse_mla_launcher() -> Callable:
    dec = kernel_module("kernels.decode_attention")
    pre = kernel_module("kernels.prefill_attention")

    def sparse_mla_attention(q_lat, q_pe, latent, k_pe, start_pos, scale, keep):
        if q_lat.shape[2] == 1:
            lens = _lens(start_pos)
            return dec.mla_decode_attention(q_lat, q_pe, latent, k_pe, scale, lens, keep=keep)
        return pre.mla_prefill_attention(q_lat, q_pe, latent, k_pe, start_pos, scale, keep)

    return sparse_mla_attention


# op -> the Triton launcher, loaded on first use
_TRITON: dict[str, Callable[[], Callable]] = {
    "rms_norm": lambda: kernel_module("kernels.rmsnorm").rms_norm,
    "rms_norm_residual": lambda: kernel_module("kernels.rmsnorm").rms_norm_residual,
    "apply_rope": lambda: kernel_module("kernels.rope").apply_rope,
    "swiglu": lambda: kernel_module("kernels.silu_mul").swiglu,
    "attention": _attention_launcher,
    "mla_attention": _mla_launcher,
    "sparse_mla_attention": _sparse_mla_launcher,
    "moe_experts": lambda: kernel_module("kernels.moe").moe_experts,
    "quant_linear": lambda: kernel_module("kernels.quant_matmul").quant_linear,
    "gated_delta_rule": lambda: kernel_module("kernels.delta_rule").gated_delta_rule,
}
OPS = tuple(_TRITON)


def triton_op(op: str) -> Callable:
    """The Triton implementation of `op`, for tests and benchmarks; KernelError without triton."""
    err = _triton_import_error()
    if err is not None:
        raise KernelError(f"{op}: {err}")
    return _TRITON[op]()


def _unsupported(x: torch.Tensor) -> str | None:
    """Why Triton cannot run on tensors like x, or None when it can."""
    err = _triton_import_error()
    if err is not None:
        return err
    if x.dtype not in KERNEL_DTYPES:
        return f"no kernel for dtype {x.dtype}"
    if x.device.type == "cuda":
        cap = torch.cuda.get_device_capability(x.device)
        if x.dtype == torch.bfloat16 and torch.version.hip is None and cap < (8, 0):
            return f"bfloat16 needs compute capability 8.0+ (Ampere); this GPU is {cap}"
        return None
    if x.device.type == "cpu" and interpreting():
        return None
    return f"{x.device.type} tensors need CUDA, or TRITON_INTERPRET=1 for CPU tensors"


_chosen: dict[tuple, Callable] = {}
_logged: set[tuple[str, str]] = set()


def _resolve(op: str, mode: str, x: torch.Tensor) -> Callable:
    if mode not in MODES:
        raise KernelError(f"{ENV}={mode!r} is not one of {', '.join(MODES)}")
    ref = getattr(reference, op)
    if mode == "torch":
        fn, path = ref, "torch (ZOO_KERNELS=torch)"
    elif mode == "auto" and x.device.type != "cuda":
        fn, path = ref, f"torch ({x.device.type} tensors)"
        if x.device.type == "cpu" and x.dtype == torch.float32 and op in cpu_ops.OPS:
            fn, path = getattr(cpu_ops, op), "C (kernels/cpu/ops.c), eager fp32"
    else:
        why = _unsupported(x)
        if why is None:
            fn, path = _TRITON[op](), "triton"
        elif mode == "triton":
            raise KernelError(f"{ENV}=triton, but {op} cannot run in Triton: {why}")
        else:
            fn, path = ref, f"torch ({why})"
    if (op, path) not in _logged and not torch.compiler.is_compiling():  # a log call breaks graphs
        _logged.add((op, path))
        log.info("zoo kernels: %s -> %s [%s %s]", op, path, x.device, x.dtype)
    return fn


def pick(op: str, x: torch.Tensor) -> Callable:
    """The implementation of `op` for inputs like x under the current ZOO_KERNELS policy."""
    mode = os.environ.get(ENV) or "auto"
    if mode == "auto" and not x.is_cuda:  # the interpreter flag cannot change this choice
        key = (op, mode, x.device.type, x.dtype)
    else:
        key = (op, mode, x.device, x.dtype, os.environ.get("TRITON_INTERPRET"))
    fn = _chosen.get(key)
    if fn is None:
        fn = _chosen[key] = _resolve(op, mode, x)
    return fn


def prepare(device: torch.device, dtype: torch.dtype) -> None:
    """Resolve every op for tensors on (device, dtype) now, eagerly. A compiled step traced
    afterwards only reads the cache: a Triton module imported inside a trace breaks the graph.
    This imports every op's Triton module, also those of ops the model never calls (MLA, MoE
    for a Llama): a few modules, for a choice that cannot then differ inside the graph."""
    x = torch.empty(0, device=device, dtype=dtype)
    for op in OPS:
        pick(op, x)
    if device.type == "cpu":
        cpu_build.library()  # the quantized-weight kernel: compiled (or found) now


# --- the ops the core layers call: same signatures as kernels.reference -----------------------
def linear(
    x: torch.Tensor,
    weight: torch.Tensor | QuantWeight | BlockWeight | QuantStack,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias. cuBLAS needs no help; on CPUs a few rows are split over the
    threads (kernels/cpu/split.py) unless ZOO_KERNELS=torch asks for the plain reference. A
    quantized weight takes its own kernels: a `BlockWeight` (CPUs) kernels/cpu/qdot.c, a
    `QuantWeight` Triton on GPUs, the dequantizing reference otherwise."""
    if isinstance(weight, QuantStack):  # parts of different formats
        y = torch.cat([linear(x, part, None) for part in weight.parts], dim=-1)
        return y if bias is None else y + bias
    if isinstance(weight, BlockWeight):  # GGML blocks on the CPU (kernels/cpu/qdot.c)
        if os.environ.get(ENV) == "torch":
            return F.linear(x, weight.dequantize().to(x.dtype), bias)
        return cpu_quant.block_linear(x, weight, bias)
    if isinstance(weight, QuantWeight):
        return _quant_linear(x, weight, bias)
    if x.device.type == "cpu" and os.environ.get(ENV) != "torch":
        return cpu.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None):
    # on CPUs a QuantWeight (Triton's layout) is the reference's: block weights are CPUs' own
    return pick("quant_linear", x)(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x's last dim, fp32 accumulation, output in x's dtype (see reference)."""
    return pick("rms_norm", x)(x, weight, eps)


def rms_norm_residual(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass."""
    return pick("rms_norm_residual", x)(x, residual, weight, eps)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first 2*cos.shape[-1] dims of q and k; Triton does it in place."""
    return pick("apply_rope", q)(q, k, cos, sin, interleaved)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused (..., 2I) [gate | up] tensor."""
    return pick("swiglu", gate_up)(gate_up)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start_pos: int | torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention over the cache, start_pos an int or per-row (B,) tensor, with an
    optional sliding window, logit soft-cap and per-head sinks (see reference); Triton routes
    T == 1 to decode, T > 1 to prefill."""
    return pick("attention", q)(q, k, v, start_pos, scale, window, softcap, sinks)


def mla_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    start_pos: int | torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Absorbed multi-head latent attention over the latent cache (see reference)."""
    return pick("mla_attention", q_lat)(q_lat, q_pe, latent, k_pe, start_pos, scale)


def sparse_mla_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    start_pos: int | torch.Tensor,
    scale: float,
    keep: torch.Tensor,
) -> torch.Tensor:
    """`mla_attention` restricted to the keys `keep` (B, T, S) bool marks (DeepSeek sparse
    attention): the Triton MLA kernels masking the unselected keys under ZOO_KERNELS=triton,
    the torch reference (dense scores, masked) under `torch` and, until the kernels are
    measured on a GPU, under `auto` too (logged once)."""
    if (os.environ.get(ENV) or "auto") != "auto":
        return pick("sparse_mla_attention", q_lat)(
            q_lat, q_pe, latent, k_pe, start_pos, scale, keep
        )
    path = ("sparse_mla_attention", "torch (ZOO_KERNELS=auto: the Triton path is opt-in)")
    if path not in _logged and not torch.compiler.is_compiling():
        _logged.add(path)
        log.info("zoo kernels: %s -> %s [%s %s]", *path, q_lat.device, q_lat.dtype)
    return reference.sparse_mla_attention(q_lat, q_pe, latent, k_pe, start_pos, scale, keep)


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    clamp: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Routed SwiGLU experts, weighted and summed over each token's top-k (see reference),
    with optional expert biases and gpt-oss's clamped SwiGLU. Experts kept in GGML blocks on
    CPUs (`BlockExperts`) run each chosen expert's block products."""
    args = (x, topk_ids, topk_weights, gate_up, down, gate_up_bias, down_bias, clamp)
    if isinstance(gate_up, BlockExperts) or isinstance(down, BlockExperts):  # CPUs' blocks
        return reference.moe_experts(*args)
    return pick("moe_experts", x)(*args)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Gated DeltaNet's linear attention over T tokens from `state` (B, Hv, Dk, Dv) fp32,
    which is overwritten with the state after them (see reference); Triton routes T == 1 to
    the recurrent step, T > 1 to the chunked kernel."""
    return pick("gated_delta_rule", v)(q, k, v, g, beta, state, scale)


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    bm: torch.Tensor,
    cm: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """Mamba2's state-space scan over T tokens from `state` (B, H, P, N) fp32, which is
    overwritten with the state after them (see reference); returns y (B, T, H, P) fp32, without
    the D skip. The torch reference until the Triton kernels (kernels/ssd.py) join `_TRITON`."""
    return reference.ssd_scan(x, dt, a, bm, cm, state, chunk)


def quant_linear(
    x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W.T + bias for one quantized W (kernels/qweight.py), as `linear` runs it: Triton or
    the dequantizing reference by `pick` (CPU tensors reach Triton under ZOO_KERNELS=triton, in
    the interpreter; on CPUs weights kept quantized are `BlockWeight`s, which `linear` sends to
    kernels/cpu/qdot.c)."""
    return _quant_linear(x, weight, bias)
