"""zoo-stablelm's hooks: StableLM's layer kind, the architecture, and a named model."""

from core.hookspecs import hookimpl
from plugins.llama3 import WEIGHT_MAP as LLAMA3_WEIGHT_MAP
from zoo_stablelm.config import LayerNormSpec, StableLmConfig

# differs from llama3: nothing; the checkpoint names are Llama's (q/k/v and gate/up fused), the
# norms' biases reach the LayerNorm's `bias` by the same names
WEIGHT_MAP = dict(LLAMA3_WEIGHT_MAP)


@hookimpl
def zoo_register_layers(registry):
    # a string: torch is imported only when a model is built, never by `zoo plugins`
    registry.add_layer(LayerNormSpec, "zoo_stablelm.layers:LayerNorm")


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture("stablelm", StableLmConfig, WEIGHT_MAP)


@hookimpl
def zoo_register_models(registry):
    registry.add_model(
        "stablelm2-1.6b-chat",
        repo="stabilityai/stablelm-2-1_6b-chat",
        revision="main",
        architecture="stablelm",
        dtype="bfloat16",
        params="1.64B",
        notes="StableLM 2 1.6B chat (LayerNorm, rope on a quarter of each head, q/k/v biases); "
        "from the zoo-stablelm plugin",
    )
