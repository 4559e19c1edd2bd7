"""The core's layer kinds (core/layers/), registered through the same hook as a plugin's.

Modules are named as "module:Class" strings, imported only when a model is built, so that
listing plugins and models never imports torch.
"""

from core.config import (
    DenseMLPSpec,
    EmbeddingSpec,
    GQASpec,
    L2NormSpec,
    MLASpec,
    MoESpec,
    RMSNormSpec,
)
from core.config_kinds import (
    CompressedAttentionSpec,
    DenseMoESpec,
    GatedDeltaNetSpec,
    Mamba2Spec,
    ParallelMixerSpec,
    PerLayerInputSpec,
    ShortConvSpec,
    SparseMLASpec,
)
from core.hookspecs import hookimpl


@hookimpl
def zoo_register_layers(registry):
    registry.add_layer(EmbeddingSpec, "core.layers.embedding:Embedding")
    registry.add_layer(RMSNormSpec, "core.layers.norm:RMSNorm")
    registry.add_layer(GQASpec, "core.layers.attention:GQAAttention")
    registry.add_layer(MLASpec, "core.layers.mla:MLAAttention")
    registry.add_layer(GatedDeltaNetSpec, "core.layers.deltanet:GatedDeltaNet")
    registry.add_layer(Mamba2Spec, "core.layers.mamba2:Mamba2")
    registry.add_layer(ShortConvSpec, "core.layers.shortconv:ShortConv")
    registry.add_layer(ParallelMixerSpec, "core.layers.parallel_mixer:ParallelMixer")
    registry.add_layer(DenseMLPSpec, "core.layers.mlp:GatedMLP")
    registry.add_layer(MoESpec, "core.layers.moe:MoE")
    registry.add_layer(L2NormSpec, "core.layers.norm:L2Norm")
    registry.add_layer(SparseMLASpec, "core.layers.dsa:SparseMLAAttention")
    registry.add_layer(CompressedAttentionSpec, "core.layers.compressed:CompressedAttention")
    registry.add_layer(PerLayerInputSpec, "core.layers.per_layer:PerLayerInput")
    registry.add_layer(DenseMoESpec, "core.layers.dense_moe:DenseMoE")
