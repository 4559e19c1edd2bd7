"""Trace the compiled decode step with the Triton launchers on a machine without a GPU: dynamo
must capture each step as one graph whose Triton launches are kernel nodes, with no break.

On a GPU, `load_model(..., compile=True)` replays each decode step as a CUDA graph; a graph break
inside it (a log call, a lazy import, a host read in a launcher) would split the step into many
graphs with eager code between them. One graph is the precondition this script checks; it does
not run inductor or CUDA graphs, and the models' tensors stay on the CPU (CUDA-only branches,
e.g. `F.linear` for CUDA in `kernels.linear`, are not traced). Dynamo only turns a
`kernel[grid](...)` launch into a graph node when it believes a Triton GPU backend is present, so
the script makes it believe so (triton's driver answers with an sm90 target, as in
compile_check.py), traces the step through AOT autograd (which functionalizes the kernels'
writes, as inductor would see them) into a backend that records the graph and runs nothing, and
prints the number of graphs, the breaks and the kernels launched, in fp32 and bf16.

    .venv/bin/python benchmarks/trace_check.py

Exits non-zero if any step breaks into more than one graph or launches no Triton kernel.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)
os.environ["ZOO_KERNELS"] = "triton"

import torch
import torch.utils._triton
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_check import NoGPU

import kernels.dispatch
from core.cli.bench import random_model

# Tiny shapes with the hub's config.json keys: GQA with tied embeddings; MLA with MoE layers.
SHAPES = {
    "llama": dict(
        model_type="llama",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    ),
    "deepseek_v2": dict(
        model_type="deepseek_v2",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=24,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    ),
}


def _no_run_backend(graphs: list):
    """Through AOT autograd, record the functional graph; return zeros shaped like its outputs
    instead of running it."""

    def forward(gm, example_inputs):
        graphs.append(gm)
        (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
        vals = [o.meta["val"] for o in outputs]
        return make_boxed_func(lambda *args: [torch.zeros(v.shape, dtype=v.dtype) for v in vals])

    return aot_autograd(fw_compiler=forward)


def trace(shape: dict, batch: int, dtype: torch.dtype) -> tuple[int, dict, Counter]:
    """(graphs, graph breaks, Triton kernels launched) of one compiled decode step."""
    graphs: list = []
    compile_ = torch.compile
    torch.compile = lambda fn, **kw: compile_(fn, backend=_no_run_backend(graphs), dynamic=False)
    try:
        model = random_model(
            shape, device="cpu", dtype=dtype, max_seq_len=256, max_batch_size=batch, compile=True
        )
    finally:
        torch.compile = compile_
    counters.clear()
    with torch.inference_mode():
        model.step(torch.zeros(batch, dtype=torch.long), torch.arange(batch) + 3, batch + 3)
    launched = Counter(
        kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__
        for g in graphs
        for n in g.graph.nodes
        if "triton_kernel_wrapper" in str(n.target)
    )
    return len(graphs), dict(counters["graph_break"]), launched


def main() -> int:
    driver.set_active(NoGPU(GPUTarget("cuda", 90, 32)))
    torch.utils._triton.has_triton = lambda: True  # dynamo's check for a Triton GPU backend
    kernels.dispatch._unsupported = lambda x: None  # the launchers accept these CPU tensors
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        for name, shape in SHAPES.items():
            for batch in (1, 4):
                graphs, breaks, launched = trace(shape, batch, dtype)
                ok &= graphs == 1 and not breaks and bool(launched)
                kinds = ", ".join(f"{k} x{v}" for k, v in sorted(launched.items()))
                head = f"{name:12s} {str(dtype)[6:]:8s} batch {batch}: {graphs} graph(s)"
                print(f"{head}, breaks {breaks or 'none'}: {kinds}")
    print("one graph per decode step" if ok else "FAILED: the decode step does not trace whole")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
