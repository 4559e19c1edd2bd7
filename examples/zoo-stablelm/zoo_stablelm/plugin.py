"""zoo-gemma's hooks: Gemma's layer kinds, the architecture, and a named model."""

from core.hookspecs import hookimpl
from plugins.llama3 import WEIGHT_MAP as LLAMA3_WEIGHT_MAP
from zoo_gemma.config import GeGLUSpec, GemmaConfig, GemmaRMSNormSpec

# differs from llama3: nothing; the checkpoint names are Llama's (q/k/v and gate/up fused)
WEIGHT_MAP = dict(LLAMA3_WEIGHT_MAP)


@hookimpl
def zoo_register_layers(registry):
    # strings: torch is imported only when a model is built, never by `zoo plugins`
    registry.add_layer(GemmaRMSNormSpec, "zoo_gemma.layers:GemmaRMSNorm")
    registry.add_layer(GeGLUSpec, "zoo_gemma.layers:GeGLU")


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture("gemma", GemmaConfig, WEIGHT_MAP)


@hookimpl
def zoo_register_models(registry):
    registry.add_model(
        "gemma-2b-it",
        repo="google/gemma-2b-it",  # gated: accept the license on the hub, then set HF_TOKEN
        revision="main",
        architecture="gemma",
        dtype="bfloat16",
        params="2.51B",
        notes="Gemma 2B instruct (gated repo: needs a hub token); from the zoo-gemma plugin",
    )
