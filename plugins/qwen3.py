"""Qwen3 (model_type `qwen3`), as a delta of Qwen2.

Same checkpoint names as Llama plus `self_attn.q_norm` / `self_attn.k_norm`, which keep their
hub names in the core (identity in the weight map). Sliding-window keys as Qwen2's.
"""

from dataclasses import replace
from typing import Literal

from pydantic import PositiveInt

from core.config import GQASpec, RMSNormSpec
from core.hfconfig import DecoderConfig
from core.hookspecs import hookimpl
from plugins.qwen2 import WEIGHT_MAP as QWEN2_WEIGHT_MAP
from plugins.qwen2 import Qwen2Config


class Qwen3Config(Qwen2Config):
    """Defaults are transformers' Qwen3Config's."""

    model_type: Literal["qwen3"] = "qwen3"
    head_dim: PositiveInt = 128  # differs from qwen2: explicit (0.6B: 16 heads x 128 > 1024)

    def attention_spec(self) -> GQASpec:
        # differs from qwen2: biases follow attention_bias (as llama3's), and q and k are
        # RMS-normed per head over head_dim, before rope
        spec = DecoderConfig.attention_spec(self)
        return replace(spec, qk_norm=RMSNormSpec(self.rms_norm_eps))


# differs from qwen2: nothing; q_norm / k_norm keep their names
WEIGHT_MAP = dict(QWEN2_WEIGHT_MAP)


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture(("qwen3",), Qwen3Config, WEIGHT_MAP)
