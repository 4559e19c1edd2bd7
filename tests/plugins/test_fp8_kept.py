"""DeepSeek's block-scaled fp8 weights kept in fp8 (on GPUs of compute capability 8.9+) rather
than dequantized at load: the choice (core/quantize.py), and the tiny V3 of test_fp8.py loaded
with fp8 kept, its fp8 linear weights run by the Triton kernels (kernels/quant_matmul.py) and
its fp8 routed experts by the grouped GEMMs (kernels/moe.py), under the interpreter on CPU
tensors, against the same checkpoint dequantized and against transformers. The other ops run
their torch references (ZOO_KERNELS=torch), which keeps the interpreter's time to the fp8 ops
and the comparison to them alone."""

from __future__ import annotations

import pytest
import torch
from parity import check_greedy, ids, rel_err
from safetensors.torch import load_file, save_file
from test_deepseek import VOCAB
from test_fp8 import make_fp8

from core import CheckpointError, load_model, quantize
from core.cli.commands import main
from kernels import dispatch, quant_matmul, reference
from kernels.dispatch import kernel_module
from kernels.qweight import FP8, QuantExperts, QuantWeight

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    return make_fp8(tmp_path_factory.mktemp("fp8_kept"))


@pytest.fixture
def kept(monkeypatch) -> list:
    """fp8 kept as if on an sm89+ GPU, the quantized linears and the fp8 experts through the
    Triton kernels (the interpreter here); returns the list of their calls' weights."""
    calls = []
    moe, torch_moe = kernel_module("kernels.moe"), reference.moe_experts

    def triton_quant_linear(x, w, bias=None):
        calls.append(w)
        return quant_matmul.quant_linear(x, w, bias)

    def triton_moe_experts(x, ids, weights, gate_up, down, *rest):
        if not isinstance(gate_up, QuantExperts):  # the dequantized model: the reference
            return torch_moe(x, ids, weights, gate_up, down, *rest)
        assert all(r is None for r in rest)  # DeepSeek's experts: no biases, plain SwiGLU
        calls.extend([gate_up, down])
        return moe.moe_experts(x, ids, weights, gate_up, down)

    monkeypatch.setattr(quantize, "fp8_native", lambda device: True)
    monkeypatch.setenv("ZOO_KERNELS", "torch")
    monkeypatch.setattr(dispatch, "_chosen", {})
    monkeypatch.setattr(reference, "quant_linear", triton_quant_linear)
    monkeypatch.setattr(reference, "moe_experts", triton_moe_experts)
    return calls


def fp8_weights(m) -> list[QuantWeight | QuantExperts]:
    return [w for w in m.net.modules() if isinstance(w, QuantWeight | QuantExperts)]


@pytest.mark.parametrize(
    "device,capability,keep",
    [("cuda", (8, 9), True), ("cuda", (9, 0), True), ("cuda", (8, 6), False),
     ("cuda", (8, 0), False), ("cpu", None, False)],
)  # fmt: skip
def test_fp8_is_kept_only_on_gpus_that_compute_in_it(monkeypatch, device, capability, keep):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    assert quantize.fp8_native(torch.device(device)) is keep
    assert quantize.keeps(FP8, torch.device(device)) is keep
    assert quantize.keeps("q4_k", torch.device(device))  # GGUF blocks: kept everywhere


def test_dequantized_at_load_off_such_a_gpu(fp8_checkpoint):
    m = load_model(fp8_checkpoint[0], max_seq_len=16)
    assert not fp8_weights(m) and FP8 not in quantize.weight_formats(m.net)


def test_kept_fp8_matches_the_dequantized_model(fp8_checkpoint, kept):
    root, ref, deq, _ = fp8_checkpoint
    # fp8 is kept on GPUs only (faked here on the CPU, whose default cache for quantized weights
    # is fp16): the cache in fp32, as the float model's
    m = load_model(root, max_seq_len=64, max_batch_size=2, kv_dtype="float32")
    ws = fp8_weights(m)
    # every projection but MLA's kv_b_proj (read as a matrix)
    attn = m.net.model.layers[0].self_attn
    assert isinstance(attn.q_a_proj.weight, QuantWeight) and attn.q_a_proj.weight.fmt.name == FP8
    assert isinstance(attn.kv_b_proj.weight, torch.nn.Parameter)
    assert torch.equal(
        attn.o_proj.weight.dequantize(), deq["model.layers.0.self_attn.o_proj.weight"]
    )
    # the routed experts too, stacked (E, out, in): expert 5's gate and up rows, its down
    experts = m.net.model.layers[1].mlp.experts
    gate_up, down = experts.gate_up_proj.weight, experts.down_proj.weight
    assert isinstance(gate_up, QuantExperts) and isinstance(down, QuantExperts)
    assert gate_up.codes.shape == (16, 48, 136) and gate_up.scales.shape == (16, 48, 2)
    name = "model.layers.1.mlp.experts.5.{}_proj.weight"
    assert torch.equal(
        gate_up.dequantize(5), torch.cat([deq[name.format(p)] for p in ("gate", "up")])
    )
    assert torch.equal(down.dequantize(5), deq[name.format("down")])
    assert ws and all(w.fmt.name == FP8 and w.codes.dtype == torch.uint8 for w in ws)
    n, nbytes = quantize.weight_formats(m.net)[FP8]
    assert n == sum(w.codes.numel() for w in ws) and n < nbytes < 1.2 * n  # + fp32 scales
    routed = sum(w.codes.numel() for w in ws if isinstance(w, QuantExperts))
    assert routed == 2 * 16 * 3 * 24 * 136  # 2 MoE layers, 16 experts: gate, up, down

    x = ids(VOCAB, 2, 40)
    plain = load_model(root, max_seq_len=64, max_batch_size=2, dequantize=True)
    assert not fp8_weights(plain)
    with torch.no_grad():
        got, want, hf = m.forward(x), plain.forward(x), ref(x).logits
    assert rel_err(got, want) < 1e-5  # the same fp32 weights; only the sums' order differs
    assert rel_err(got, hf) < 1e-4  # transformers on the dequantized weights
    assert {id(w) for w in kept} == {id(w) for w in ws}  # every fp8 weight ran in Triton
    assert sum(isinstance(w, QuantExperts) for w in kept) == 4  # 2 MoE layers' grouped GEMMs
    check_greedy(m, ref, ids(VOCAB, 1, 7, seed=3), n=6)  # decode steps: the split-K GEMV


@pytest.mark.usefixtures("kept")
def test_zoo_info_shows_fp8_and_its_bytes(fp8_checkpoint, capsys):
    assert main(["info", str(fp8_checkpoint[0])]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.strip().startswith(FP8))
    n, nbytes = (int(v.replace(",", "")) for v in line.split()[1::2][:2])
    assert line.split()[2] == "parameters" and n < nbytes < 1.2 * n


@pytest.mark.parametrize("keep", [True, False])
def test_a_nan_byte_is_a_damaged_file(fp8_checkpoint, tmp_path, monkeypatch, keep):
    """e4m3's NaN (0x7F / 0xFF) never comes out of a quantizer that clamps to +-448: refused,
    kept or dequantized, naming the tensor."""
    monkeypatch.setattr(quantize, "fp8_native", lambda device: keep)
    root = fp8_checkpoint[0]
    for f in root.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    state = load_file(root / "model.safetensors")
    name = "model.layers.1.mlp.shared_experts.up_proj.weight"
    w = state[name].view(torch.uint8).clone()
    w[3, 7] = 0xFF
    state[name] = w.view(torch.float8_e4m3fn)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name}.*1 NaN value.*download it again"):
        load_model(tmp_path, max_seq_len=16)
