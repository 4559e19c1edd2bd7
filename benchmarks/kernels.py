"""Kernel benchmark: each Triton op vs its torch reference at Llama-3.2-1B and Llama-3.1-8B
shapes (and DeepSeek-V2-Lite for MLA / MoE), in bf16 on one CUDA GPU.

Memory-bound ops report achieved GB/s (bytes the op must move / time); compute-bound ones
(prefill attention, prefill MoE) TFLOP/s; both as a % of the device's peak. Every Triton result
is checked against the reference before it is timed. Prints a markdown table with the
hardware, date and command, ready for docs/kernels.md.

    .venv/bin/python benchmarks/kernels.py [--models 1b 8b dsv2lite] [--ctx 4096] [--prefill 2048]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

# the repo root first: this file's own folder would otherwise make `kernels` mean this script
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from kernels import reference
from kernels.dispatch import triton_op

# (peak memory bandwidth GB/s, dense bf16 TFLOP/s) by device name fragment, from vendor sheets
PEAKS = {
    "H200": (4800, 989),
    "H100 SXM": (3350, 989),
    "H100 80GB HBM3": (3350, 989),
    "H100 PCIe": (2000, 756),
    "H100 NVL": (3900, 835),
    "H100": (3350, 989),
    "A100-SXM4-80GB": (2039, 312),
    "A100 80GB PCIe": (1935, 312),
    "A100": (1555, 312),
    "L40S": (864, 362),
    "RTX 4090": (1008, 165),
}


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int


MODELS = {
    "1b": Model("Llama-3.2-1B", 2048, 32, 8, 64, 8192),
    "8b": Model("Llama-3.1-8B", 4096, 32, 8, 128, 14336),
}
# DeepSeek-V2-Lite: 16 heads, latent 512 + rope 64; 64 routed experts, top-6, 1408 wide
DSV2LITE = dict(heads=16, latent=512, rope=64, hidden=2048, experts=64, topk=6, inter=1408)
DEVICE = "cuda"


def peak() -> tuple[float, float, str]:
    name = torch.cuda.get_device_name()
    for frag, (gbs, tflops) in PEAKS.items():
        if frag in name:
            return gbs, tflops, name
    return float("nan"), float("nan"), name + " (peak unknown: pass --peak-gbs/--peak-tflops)"


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100)


def check(got, want, what: str) -> None:
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want, strict=True):
        err = ((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-6)).item()
        if err > 3e-2:
            raise SystemExit(f"{what}: Triton differs from the reference (rel err {err:.3g})")


def r(*shape, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(torch.bfloat16)


def cases(m: Model, ctx: int, prefill: int):
    """(op, shape, triton fn, torch fn, bytes moved, flops) per case; flops 0: memory-bound."""
    el = 2  # bf16
    for tokens, phase in ((1, "decode"), (prefill, "prefill")):
        x, res, w = r(tokens, m.hidden), r(tokens, m.hidden), r(m.hidden)
        nbytes = 3 * tokens * m.hidden * el
        yield (
            "rms_norm", f"{phase} {tokens}x{m.hidden}",
            lambda x=x, w=w: triton_op("rms_norm")(x, w, 1e-5),
            lambda x=x, w=w: reference.rms_norm(x, w, 1e-5), nbytes, 0,
        )  # fmt: skip
        yield (
            "rms_norm_residual", f"{phase} {tokens}x{m.hidden}",
            lambda x=x, res=res, w=w: triton_op("rms_norm_residual")(x, res, w, 1e-5),
            lambda x=x, res=res, w=w: reference.rms_norm_residual(x, res, w, 1e-5),
            4 * tokens * m.hidden * el, 0,
        )  # fmt: skip
        gu = r(tokens, 2 * m.inter, scale=3.0)
        yield (
            "swiglu", f"{phase} {tokens}x{2 * m.inter}",
            lambda gu=gu: triton_op("swiglu")(gu), lambda gu=gu: reference.swiglu(gu),
            3 * tokens * m.inter * el, 0,
        )  # fmt: skip
        hq, hk, d = m.heads, m.kv_heads, m.head_dim
        qkv = r(1, tokens, (hq + 2 * hk) * d)
        q = qkv[..., : hq * d].view(1, tokens, hq, d).transpose(1, 2)
        k = qkv[..., hq * d : (hq + hk) * d].view(1, tokens, hk, d).transpose(1, 2)
        ang = torch.rand(1, tokens, d // 2, device=DEVICE) * 100
        cos, sin = ang.cos(), ang.sin()
        yield (
            "apply_rope", f"{phase} T={tokens} {hq}+{hk}x{d}",
            lambda q=q, k=k, c=cos, s=sin: triton_op("apply_rope")(q, k, c, s, False),
            lambda q=q, k=k, c=cos, s=sin: reference.apply_rope(q, k, c, s, False),
            2 * tokens * (hq + hk) * d * el + 2 * tokens * d * 4, 0,
        )  # fmt: skip
    hq, hk, d = m.heads, m.kv_heads, m.head_dim
    for b in (1, 16):  # decode over a ctx-long cache slice of a (b+1, ..., ctx+64) cache
        q = r(b, hq, 1, d)
        kc, vc = r(b + 1, hk, ctx + 64, d), r(b + 1, hk, ctx + 64, d)
        k, v = kc[:b, :, :ctx], vc[:b, :, :ctx]
        yield (
            "attention decode", f"B={b} S={ctx} {hq}/{hk}x{d}",
            lambda q=q, k=k, v=v: triton_op("attention")(q, k, v, ctx - 1, d**-0.5),
            lambda q=q, k=k, v=v: reference.attention(q, k, v, ctx - 1, d**-0.5),
            2 * b * hk * ctx * d * el, 0,
        )  # fmt: skip
    t = prefill
    q, k, v = r(1, hq, t, d), r(1, hk, t, d), r(1, hk, t, d)
    flops = 4 * hq * d * t * (t + 1) / 2  # QK^T and PV over the causal half
    yield (
        "attention prefill", f"T={t} {hq}/{hk}x{d}",
        lambda q=q, k=k, v=v: triton_op("attention")(q, k, v, 0, d**-0.5),
        lambda q=q, k=k, v=v: reference.attention(q, k, v, 0, d**-0.5), 0, flops,
    )  # fmt: skip
    sdpa = torch.nn.functional.scaled_dot_product_attention
    yield (
        "  (torch: SDPA is_causal)", f"T={t} {hq}/{hk}x{d}",
        None, lambda q=q, k=k, v=v: sdpa(q, k, v, is_causal=True, enable_gqa=True), 0, flops,
    )  # fmt: skip


def deepseek_cases(ctx: int, prefill: int):
    c = DSV2LITE
    h, lat, rope = c["heads"], c["latent"], c["rope"]
    for b in (1, 16):
        ql, qp = r(b, h, 1, lat), r(b, h, 1, rope)
        latent, kpe = r(b, ctx, lat), r(b, ctx, rope)
        yield (
            "mla decode", f"B={b} S={ctx} H={h} {lat}+{rope}",
            lambda a=(ql, qp, latent, kpe): triton_op("mla_attention")(*a, ctx - 1, 0.07),
            lambda a=(ql, qp, latent, kpe): reference.mla_attention(*a, ctx - 1, 0.07),
            b * ctx * (lat + rope) * 2, 0,
        )  # fmt: skip
    e, k, hid, i = c["experts"], c["topk"], c["hidden"], c["inter"]
    gate_up, down = r(e, 2 * i, hid, scale=hid**-0.5), r(e, hid, i, scale=i**-0.5)
    for n in (1, prefill):
        x = r(n, hid)
        w, ids = torch.randn(n, e, device=DEVICE).softmax(-1).topk(k)
        w = w.bfloat16()
        used = min(e, n * k)  # experts whose weights must be read at least once
        yield (
            "moe_experts", f"N={n} E={e} top{k} {hid}x{i}",
            lambda a=(x, ids, w, gate_up, down): triton_op("moe_experts")(*a),
            lambda a=(x, ids, w, gate_up, down): reference.moe_experts(*a),
            used * 3 * hid * i * 2 if n == 1 else 0, 0 if n == 1 else n * k * 6 * hid * i,
        )  # fmt: skip


def rate(ms: float, nbytes: float, flops: float, gbs: float, tflops: float):
    """(achieved, its label, the matching peak): TFLOP/s when flops are given, else GB/s."""
    if flops:
        return flops / ms / 1e9, f"{flops / ms / 1e9:.0f} TFLOP/s", tflops
    return nbytes / ms / 1e6, f"{nbytes / ms / 1e6:.0f} GB/s", gbs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["1b", "8b", "dsv2lite"])
    ap.add_argument("--ctx", type=int, default=4096, help="cache length for decode attention")
    ap.add_argument("--prefill", type=int, default=2048, help="prompt tokens for prefill rows")
    ap.add_argument("--peak-gbs", type=float)
    ap.add_argument("--peak-tflops", type=float)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA GPU")
    import triton

    gbs, tflops, name = peak()
    gbs, tflops = args.peak_gbs or gbs, args.peak_tflops or tflops
    print(f"# Zoo kernel benchmark, {datetime.date.today()}")
    print(f"- GPU: {name}; peak {gbs:.0f} GB/s, {tflops:.0f} bf16 TFLOP/s")
    print(f"- torch {torch.__version__}, triton {triton.__version__}, {platform.platform()}")
    print(f"- command: `{' '.join([Path(sys.executable).name, *sys.argv])}`\n")
    print("| model | op | shape | Triton µs | torch µs | speedup | Triton | % peak | torch |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    groups = [
        (MODELS[k].name, cases(MODELS[k], args.ctx, args.prefill))
        for k in args.models
        if k in MODELS
    ]
    if "dsv2lite" in args.models:
        groups.append(("DeepSeek-V2-Lite", deepseek_cases(args.ctx, args.prefill)))
    for model, rows in groups:
        for op, shape, tri, ref, nbytes, flops in rows:
            if tri is not None:  # the reference first: apply_rope's kernel works in place
                want = ref()
                check(tri(), want, f"{model} {op} {shape}")
            t_tri = bench_ms(tri) if tri is not None else None
            t_ref = bench_ms(ref)
            _, ref_s, _ = rate(t_ref, nbytes, flops, gbs, tflops)
            if tri is None:  # a torch-only comparison row
                cells = ["–", f"{t_ref * 1e3:.1f}", "–", "–", "–", ref_s]
            else:
                val, tri_s, top = rate(t_tri, nbytes, flops, gbs, tflops)
                cells = [f"{t_tri * 1e3:.1f}", f"{t_ref * 1e3:.1f}", f"{t_ref / t_tri:.2f}x"]
                cells += [tri_s, f"{100 * val / top:.0f}%", ref_s]
            print(f"| {model} | {op} | {shape} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
