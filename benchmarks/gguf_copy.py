"""A copy of a GGUF file with its weights in another format: every tensor the source stores in a
block format (Q4_1, Q4_K, ...), and every float weight of two or more dimensions whose rows split
into 32-value blocks, is written as KIND (Q8_0; F32, i.e. dequantized; F16; or Q4_K_M's mix) by
the `gguf` package's own quantizer (the K-quants, which it lacks, by `quantize_q4_k` /
`quantize_q6_k` here). The rest (norms, 1-D tensors, the MoE router `ffn_gate_inp`, which
llama.cpp's quantizer also leaves alone) is copied byte for byte, and so is a tensor already in
its target type. Metadata is copied key by key with its stored types, except
`general.file_type`, set to KIND's (0 F32, 1 F16, 7 Q8_0, 15 Q4_K_M); tensors keep their order,
names and shapes (the q/k rows stay permuted as stored), so llama.cpp loads the copy as it
loads the source.

Q4_K_M follows llama.cpp's recipe (llama_tensor_get_type): Q6_K for the output matrix (or a tied
embedding) and for attn_v and ffn_down in the first and last eighth of the layers and every
third between, Q4_K elsewhere; rows that do not split into 256-value super-blocks fall back to
Q5_0 (for Q4_K) and Q8_0 (for Q6_K), as there. The K-quant blocks are simpler than llama.cpp's
(each sub-block's scale and minimum from its range, no search), valid blocks all the same.

Used by the benchmark (llama.cpp on Q8_0 and F32 copies of the embedded SmolLM2 file) and by
tests/plugins/test_gguf_kept.py (a Q4_K_M copy judged teacher-forced; where llama-cpp-python is
installed, also one made by llama.cpp's own quantizer).

    python benchmarks/gguf_copy.py SRC DST --type q8_0|f32|f16|q4_k_m
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

Q4_K_M = "q4_k_m"  # a mix of types, chosen per tensor (`_recipe`)
KINDS = {"q8_0": T.Q8_0, "f32": T.F32, "f16": T.F16, Q4_K_M: Q4_K_M}
FILE_TYPE = {T.F32: gguf.LlamaFileType.ALL_F32, T.F16: gguf.LlamaFileType.MOSTLY_F16,
             T.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
             Q4_K_M: gguf.LlamaFileType.MOSTLY_Q4_K_M}  # fmt: skip
QK_K = 256
FLOATS = (T.F32, T.F16, T.BF16)
KEEP = ("ffn_gate_inp.weight",)  # float weights llama.cpp's quantizer keeps as they are
BLOCK = 32  # the smallest block of any format: a float row must split into these


def _target(t: gguf.ReaderTensor, kind, layers: int = 0) -> T:
    """The type tensor t gets in the copy (Q4_K_M: by `_recipe`; `layers`, the block count)."""
    block_format = gguf.GGML_QUANT_SIZES[t.tensor_type][0] > 1
    rows_split = len(t.shape) >= 2 and int(t.shape[0]) % BLOCK == 0  # shape[0]: the row length
    if not block_format and not (
        t.tensor_type in FLOATS and rows_split and not t.name.endswith(KEEP)
    ):
        return t.tensor_type
    return _recipe(t.name, int(t.shape[0]), layers) if kind == Q4_K_M else kind


def _recipe(name: str, row: int, layers: int) -> T:
    """llama.cpp's Q4_K_M type for tensor `name` with rows of `row` values."""
    parts = name.split(".")
    kind = T.Q4_K
    if name in ("output.weight", "token_embd.weight"):  # a tied embedding is the output too
        kind = T.Q6_K
    elif parts[-2] in ("attn_v", "ffn_down") and parts[1].isdigit():
        i = int(parts[1])  # llama.cpp's use_more_bits
        more = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
        kind = T.Q6_K if more else T.Q4_K
    if row % QK_K:
        kind = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}[kind]
    return kind


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """(n, 256k) floats -> Q4_K blocks (n, 144k bytes): per sub-block of 32, the scale and
    minimum of its range (the minimum at most 0), both to 6 bits under fp16 d and dmin."""
    n = x.shape[0]
    sub = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - lo) / 15, -lo  # (blocks, 8)
    d, dmin = _fp16(scale.max(-1) / 63), _fp16(mins.max(-1) / 63)
    sc = _steps(scale, d, 63)
    mn = _steps(mins, dmin, 63)
    step = d[:, None] * sc.astype(np.float32)
    shift = dmin[:, None] * mn.astype(np.float32)
    safe = np.where(step > 0, step, 1)[..., None]
    q = np.where(step[..., None] > 0, np.rint((sub + shift[..., None]) / safe), 0)
    q = q.clip(0, 15).astype(np.uint8)  # (blocks, 8, 32)
    scales = np.concatenate(
        [sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
         (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=-1)  # fmt: skip
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # run j: sub-blocks 2j, 2j + 1
    out = np.concatenate([_bytes(d), _bytes(dmin), scales, qs], axis=-1)
    return out.reshape(n, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """(n, 256k) floats -> Q6_K blocks (n, 210k bytes): per sub-block of 16, a scale of its
    largest magnitude (codes -32..31) to 8 bits under a fp16 d."""
    n = x.shape[0]
    sub = x.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(sub).max(-1) / 31  # (blocks, 16)
    d = _fp16(scale.max(-1) / 127)
    sc = _steps(scale, d, 127).astype(np.int8)
    step = d[:, None] * sc.astype(np.float32)
    safe = np.where(step > 0, step, 1)[..., None]
    q = np.where(step[..., None] > 0, np.rint(sub / safe), 0).clip(-32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # half h, chunk k of 32 columns, i
    ql = np.zeros((q.shape[0], 2, 64), np.uint8)
    qh = np.zeros((q.shape[0], 2, 32), np.uint8)
    for k in range(4):
        ql[:, :, 32 * (k % 2) : 32 * (k % 2) + 32] |= (q[:, :, k] & 15) << (4 * (k // 2))
        qh |= (q[:, :, k] >> 4) << (2 * k)
    out = np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _bytes(d)], axis=-1
    )
    return out.reshape(n, -1)


def _fp16(v: np.ndarray) -> np.ndarray:
    """fp16-rounded values, as float32."""
    return v.astype(np.float16).astype(np.float32)


def _steps(v: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    """v / unit rounded to 0..top (0 where unit is 0), as uint8."""
    safe = np.where(unit > 0, unit, 1)[:, None]
    return np.where(unit[:, None] > 0, np.rint(v / safe), 0).clip(0, top).astype(np.uint8)


def _bytes(v: np.ndarray) -> np.ndarray:
    """float32 (n,) -> their fp16 bytes (n, 2)."""
    return v.astype(np.float16).view(np.uint8).reshape(-1, 2)


K_QUANTIZERS = {T.Q4_K: quantize_q4_k, T.Q6_K: quantize_q6_k}


def _converted(t: gguf.ReaderTensor, kind: T) -> np.ndarray:
    """t's data in kind, as the 2-D byte (or float) array GGUFWriter writes."""
    if t.tensor_type == kind:
        return np.asarray(t.data)
    floats = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)  # shape (..., row)
    if kind in K_QUANTIZERS:
        rows = floats.reshape(-1, floats.shape[-1])
        return K_QUANTIZERS[kind](rows).reshape(*floats.shape[:-1], -1)
    return gguf.quants.quantize(floats, kind)


def _value(field: gguf.ReaderField):
    """A field's value as GGUFWriter packs it back to the same bytes; strings stay bytes."""
    main = field.types[0]
    if main == V.ARRAY:
        if len(field.types) != 2:
            raise ValueError(f"{field.name}: nested arrays are not copied")
        if not field.data:
            raise ValueError(f"{field.name}: GGUFWriter cannot write an empty array")
        if field.types[1] == V.STRING:
            return [bytes(field.parts[i]) for i in field.data]
        return [field.parts[i][0].item() for i in field.data]
    if main == V.STRING:
        return bytes(field.parts[field.data[0]])
    return field.parts[field.data[0]][0].item()


def copy_gguf(src, dst, kind) -> Path:
    """Write dst, a copy of the GGUF file src (a path, or a gguf.GGUFReader of it: reading the
    header takes seconds, so several copies may share one) with its weights in kind ("q8_0",
    "f32", "f16" or a GGMLQuantizationType); returns dst."""
    kind = KINDS[kind.lower()] if isinstance(kind, str) else T(kind)
    if kind not in FILE_TYPE:
        raise ValueError(f"kind {kind.name}: only Q8_0, F32, F16 and Q4_K_M are written")
    reader = src if isinstance(src, gguf.GGUFReader) else gguf.GGUFReader(src)
    arch_name = bytes(reader.fields[gguf.Keys.General.ARCHITECTURE].parts[-1]).decode()
    count = reader.fields.get(f"{arch_name}.block_count")
    layers = int(count.parts[count.data[0]][0]) if count else 0
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE]
    writer = gguf.GGUFWriter(dst, bytes(arch.parts[arch.data[0]]).decode())
    writer.kv_data[0].clear()  # the architecture comes back below, in the source's place
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    file_type = gguf.Keys.General.FILE_TYPE
    for key, field in fields.items():
        if key == file_type:
            writer.add_uint32(key, int(FILE_TYPE[kind]))
        elif key == gguf.Keys.General.ALIGNMENT:
            writer.add_custom_alignment(_value(field))  # the writer pads the data to it
        else:
            sub = field.types[1] if field.types[0] == V.ARRAY else None
            writer.add_key_value(key, _value(field), field.types[0], sub)
    if file_type not in fields:
        writer.add_uint32(file_type, int(FILE_TYPE[kind]))

    # tensor infos first (sizes follow from shapes), then one tensor in memory at a time
    plan = []
    for t in reader.tensors:
        to = _target(t, kind, layers)
        shape = [int(n) for n in reversed(t.shape)]  # numpy order: rows last
        block, size = gguf.GGML_QUANT_SIZES[to]
        nbytes = int(np.prod(shape[:-1])) * shape[-1] // block * size
        # a float dtype: the shape is taken as elements, not bytes
        writer.add_tensor_info(t.name, shape, np.dtype(np.float32), nbytes, raw_dtype=to)
        plan.append((t, to, nbytes))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t, to, nbytes in plan:
        data = np.ascontiguousarray(_converted(t, to))
        assert data.nbytes == nbytes, (t.name, data.nbytes, nbytes)
        writer.write_tensor_data(data)
    writer.close()
    return Path(dst)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--type", dest="kind", choices=sorted(KINDS), required=True)
    args = ap.parse_args(argv)
    copy_gguf(args.src, args.dst, args.kind)
    src, dst = gguf.GGUFReader(args.src), gguf.GGUFReader(args.dst)
    print(
        f"{args.dst}: {len(dst.tensors)} tensors, {args.dst.stat().st_size / 2**20:.1f} MiB "
        f"(source {args.src.stat().st_size / 2**20:.1f} MiB); "
        + ", ".join(f"{k.name} x{n}" for k, n in _census(dst).items())
        + f" (from {', '.join(f'{k.name} x{n}' for k, n in _census(src).items())})"
    )
    return 0


def _census(reader: gguf.GGUFReader) -> dict:
    out: dict = {}
    for t in reader.tensors:
        out[t.tensor_type] = out.get(t.tensor_type, 0) + 1
    return out


if __name__ == "__main__":
    sys.exit(main())
