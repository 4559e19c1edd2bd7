"""A copy of a GGUF file with its weights in another format: every tensor the source stores in a
block format (Q4_1, Q4_K, ...), and every float weight of two or more dimensions whose rows split
into 32-value blocks, is written as KIND (Q8_0; F32, i.e. dequantized; or F16) by the `gguf`
package's own quantizer. The rest (norms, 1-D tensors, the MoE router `ffn_gate_inp`, which
llama.cpp's quantizer also leaves alone) is copied byte for byte, and so is a tensor already in
KIND. Metadata is copied key by key with its stored types, except `general.file_type`, set to
KIND's (0 F32, 1 F16, 7 Q8_0); tensors keep their order, names and shapes (the q/k rows stay
permuted as stored), so llama.cpp loads the copy as it loads the source.

Used by the benchmark (llama.cpp on a Q8_0 and an F32 copy of the embedded SmolLM2 file) and by
tests/plugins/test_gguf_kept.py.

    python benchmarks/gguf_copy.py SRC DST --type q8_0|f32|f16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

KINDS = {"q8_0": T.Q8_0, "f32": T.F32, "f16": T.F16}
FILE_TYPE = {T.F32: gguf.LlamaFileType.ALL_F32, T.F16: gguf.LlamaFileType.MOSTLY_F16,
             T.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}  # fmt: skip
FLOATS = (T.F32, T.F16, T.BF16)
KEEP = ("ffn_gate_inp.weight",)  # float weights llama.cpp's quantizer keeps as they are
BLOCK = 32  # the smallest block of any format: a float row must split into these


def _target(t: gguf.ReaderTensor, kind: T) -> T:
    """The type tensor t gets in the copy."""
    if gguf.GGML_QUANT_SIZES[t.tensor_type][0] > 1:  # a block format
        return kind
    rows_split = len(t.shape) >= 2 and int(t.shape[0]) % BLOCK == 0  # shape[0]: the row length
    if t.tensor_type in FLOATS and rows_split and not t.name.endswith(KEEP):
        return kind
    return t.tensor_type


def _converted(t: gguf.ReaderTensor, kind: T) -> np.ndarray:
    """t's data in kind, as the 2-D byte (or float) array GGUFWriter writes."""
    if t.tensor_type == kind:
        return np.asarray(t.data)
    floats = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)  # shape (..., row)
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
        raise ValueError(f"kind {kind.name}: only Q8_0, F32 and F16 are written")
    reader = src if isinstance(src, gguf.GGUFReader) else gguf.GGUFReader(src)
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
        to = _target(t, kind)
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
