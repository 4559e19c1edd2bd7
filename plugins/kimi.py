"""Kimi K2 (`kimi_k2`: K2 Instruct / Base / Thinking) and Kimi K2.5 (`kimi_k25`, multimodal: its
`text_config` is a kimi_k2), as DeepSeek V3.

Moonshot's K2 is DeepSeek V3's network (MLA, sigmoid noaux_tc routing, YaRN), shipped with
DeepSeek's remote code under its own model_type so that engines can tell it apart; it differs
from DeepSeek V3 only in its sizes (384 experts, one expert group, 64 heads, one dense layer),
which its config.json spells out. K2.5 wraps that text model beside a vision tower and
projector, which are not loaded.
"""

from __future__ import annotations

from typing import Any, Literal

from core.errors import ConfigError
from core.hfconfig import text_model, text_model_weights
from core.hookspecs import hookimpl
from plugins.deepseek import WEIGHT_MAP as DEEPSEEK_WEIGHT_MAP
from plugins.deepseek import DeepseekV3Config

TEXT_MODELS = ("kimi_k2", "deepseek_v3")  # a kimi_k25 config's text_config.model_type


class KimiK2Config(DeepseekV3Config):
    """Kimi K2: DeepSeek V3 under another name (defaults: DeepSeek V3's, as its remote code)."""

    model_type: Literal["kimi_k2"] = "kimi_k2"


class KimiK25Config(KimiK2Config):
    """Kimi K2.5: the kimi_k2 text model in `text_config`. Its released weights are int4
    (compressed-tensors, declared in text_config.quantization_config), which Zoo does not read:
    that is a ConfigError naming the field; a bf16 conversion loads."""

    model_type: Literal["kimi_k25"] = "kimi_k25"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> KimiK25Config:
        text = text_model(raw, source, "kimi_k25")
        kind = raw["text_config"].get("model_type")
        if kind not in TEXT_MODELS:
            raise ConfigError(
                f"{source}: field 'text_config.model_type' is {kind!r}; a kimi_k25 text model "
                f"is one of {', '.join(TEXT_MODELS)}"
            )
        qc = raw["text_config"].get("quantization_config")
        if qc is not None and "quantization_config" not in raw:
            method = qc.get("quant_method") if isinstance(qc, dict) else qc
            raise ConfigError(
                f"{source}: field 'text_config.quantization_config' declares {method!r} weights "
                "(Kimi K2.5's int4 experts), which Zoo does not read; use a bf16 conversion"
            )
        return super().from_dict(text, source)


# K2.5's text model under language_model.*; its vision tower and projector are not run
KIMI_K25_WEIGHT_MAP = text_model_weights(
    DEEPSEEK_WEIGHT_MAP, ("vision_tower", "mm_projector", "multi_modal_projector")
)


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture("kimi_k2", KimiK2Config, DEEPSEEK_WEIGHT_MAP)
    registry.add_architecture("kimi_k25", KimiK25Config, KIMI_K25_WEIGHT_MAP)
