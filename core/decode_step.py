"""The decode step: one new token per row through the static cache, eager or compiled.

Compiled, the step is one `torch.compile` graph with static shapes, so nothing in it depends on
host values: positions are a (B,) tensor, and attention reads the cache up to a *bucket*, the
next power of two >= the longest row's length (at least 256), where per-row masks hide what
lies past each row. Each (batch size, bucket) pair compiles once per process (inductor also
caches the code on disk); on CUDA the graph is replayed as a CUDA graph (mode
"reduce-overhead"). On a CPU, inductor fuses the ~40 small ops of each layer into a few loops,
which is where the eager step spends a third of its time.
"""

from __future__ import annotations

import logging

import torch

import kernels.cpu
import kernels.dispatch
from core.config import DynamicRope
from core.cpu_step import FusedStep
from core.errors import ConfigError
from core.modeling import CausalLM

log = logging.getLogger("zoo")

MIN_BUCKET = 256
RECOMPILE_LIMIT = 64  # (batch size, bucket) pairs one process may compile


def bucket(end: int, max_seq_len: int) -> int:
    """The cache length a compiled step attends over for rows reaching position end - 1."""
    return min(max(MIN_BUCKET, 1 << (end - 1).bit_length()), max_seq_len)


class DecodeStep:
    """`step(tokens (B,), positions (B,), end) -> logits (B, vocab)`: feed each row's token at
    its position; `end` bounds every row's position + 1 (the caller tracks it on the host)."""

    def __init__(self, net: CausalLM, compile: bool = False):
        self.net = net
        self.compiled = None
        self.cuda_graphs = False
        weight = net.model.embed_tokens.weight
        # eager on a CPU: the blocks in one C call where they are of the plain kind
        self.fused = FusedStep(net) if weight.device.type == "cpu" and not compile else None
        if weight.device.type == "cpu":  # timed now (eager), not in a request or a trace
            kernels.cpu.split_pays(weight.dtype)
        if compile:
            if isinstance(net.config.rope, DynamicRope):
                raise ConfigError(
                    "compile=True cannot run dynamic NTK rope scaling (its frequencies follow "
                    "the exact sequence length); load the model without compile"
                )
            self.cuda_graphs = weight.device.type == "cuda"
            mode = "reduce-overhead" if self.cuda_graphs else None
            kernels.dispatch.prepare(weight.device, weight.dtype)  # no resolving in the trace
            torch.compiler.assume_constant_result(kernels.cpu.threads)  # no graph break
            cfg = torch._dynamo.config
            name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
            setattr(cfg, name, max(getattr(cfg, name), RECOMPILE_LIMIT))  # torch < 2.7: old name
            for bufs in net.kv_cache.layers:  # written in place: CUDA graphs may keep them
                for t in bufs:
                    torch._dynamo.mark_static_address(t)
            self.compiled = torch.compile(net.forward, dynamic=False, mode=mode)
            log.info("zoo: decode step compiled with torch.compile (mode=%s)", mode or "default")

    def takes_rows(self, rows: int) -> bool:
        """Whether a step of `rows` tokens may name the cache rows they belong to (`rows=` of
        `__call__`): the fused CPU step computes just those; the others compute rows [:B]."""
        fused = self.fused is not None and self.compiled is None
        return fused and self.fused.why_not(rows) is None

    def takes_chain(self, tokens: int) -> bool:
        """Whether a step of `tokens` tokens may name a cache row more than once (`rows=` of
        `__call__`): a chain, that row's tokens at consecutive positions in the order given,
        each attending to the row's cache up to its own (a sequence's drafted tokens verified
        in one call). The fused CPU step alone, on models of no recurrent layer nor a ring that
        wraps (`FusedStep.takes_chain`)."""
        fused = self.fused is not None and self.compiled is None
        return fused and self.fused.takes_chain(tokens)

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        end: int,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """rows: the cache rows of the B tokens (where `takes_rows(B)`), a row named more than
        once only where `takes_chain(B)`; None: rows 0..B-1."""
        if self.fused is not None and self.compiled is None:
            logits = self.fused(tokens, positions, end, rows)
            if logits is not None:
                return logits
        if rows is not None:  # only the fused step names its rows
            raise ValueError("this decode step computes cache rows 0..B-1 only")
        ids = tokens[:, None]
        if self.compiled is not None:
            if self.cuda_graphs:  # the last replay's outputs may be overwritten now
                torch.compiler.cudagraph_mark_step_begin()
            seq = self.net.kv_cache.max_seq_len
            return self.compiled(ids, positions, bucket(end, seq))[:, -1]
        if len(tokens) == 1 and tokens.device.type == "cpu":  # int positions: cheaper, no sync
            return self.net(ids, int(positions[0]))[:, -1]
        return self.net(ids, positions, end=end)[:, -1]
