"""Llama 3 / 3.1 / 3.2 (model_type `llama`): the reference architecture of the core.

The core's parameters already carry the hub's Llama names; the only differences are the
fused projections: q/k/v go into one `qkv_proj`, gate/up into one `gate_up_proj`.
"""

from typing import Literal

from core.hfconfig import DecoderConfig
from core.hookspecs import hookimpl


class LlamaConfig(DecoderConfig):
    model_type: Literal["llama"] = "llama"


WEIGHT_MAP = {
    "model.layers.{}.self_attn.q_proj": ("model.layers.{}.self_attn.qkv_proj", "q"),
    "model.layers.{}.self_attn.k_proj": ("model.layers.{}.self_attn.qkv_proj", "k"),
    "model.layers.{}.self_attn.v_proj": ("model.layers.{}.self_attn.qkv_proj", "v"),
    "model.layers.{}.mlp.gate_proj": ("model.layers.{}.mlp.gate_up_proj", "gate"),
    "model.layers.{}.mlp.up_proj": ("model.layers.{}.mlp.gate_up_proj", "up"),
    "model.layers.{}.self_attn.rotary_emb": None,  # old checkpoints saved inv_freq buffers
}


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture(("llama",), LlamaConfig, WEIGHT_MAP)
