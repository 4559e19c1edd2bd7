"""The plugin registry in-process: built-ins, claims named on conflict, layer kinds, named models.

Discovery through entry points, the environment lists, laziness and spawn: test_plugin_loading.py.
"""

from __future__ import annotations

import pytest

from core import PluginError
from core.config import GQASpec, RMSNormSpec
from core.hookspecs import hookimpl
from core.layers.norm import RMSNorm
from core.plugins import (
    HOOKS,
    Registry,
    describe_plugins,
    merge_named_models,
    plugin_manager,
    registry,
)
from plugins.llama3 import LlamaConfig


def test_builtins_registered():
    reg = registry()
    assert reg.architectures["llama"].plugin == "plugins.llama3"
    assert reg.formats["safetensors"].plugin == "plugins.formats.safetensors"
    assert reg.layers[GQASpec].plugin == "plugins.core_layers"  # the core's own layer kinds
    assert plugin_manager().has_plugin("plugins.llama3")
    assert registry() is registry()  # loaded once per process


def test_every_hook_runs():
    assert set(HOOKS) == {n for n in plugin_manager().hook.__dict__ if n.startswith("zoo_")}


def test_two_plugins_claiming_one_model_type_are_named():
    reg = Registry()
    reg.current_plugin = "first-dist:first"
    reg.add_architecture("llama", LlamaConfig, {})
    reg.current_plugin = "second-dist:second"
    with pytest.raises(PluginError, match="'first-dist:first' and plugin 'second-dist:second'"):
        reg.add_architecture(["mistral", "llama"], LlamaConfig, {})


def test_two_plugins_claiming_one_model_name_are_named():
    reg = Registry()
    reg.current_plugin = "zoo-a:a"
    reg.add_model("tiny", repo="org/tiny", architecture="llama")
    reg.current_plugin = "zoo-b:b"
    with pytest.raises(PluginError, match=r"model name 'tiny' .* 'zoo-a:a' and plugin 'zoo-b:b'"):
        reg.add_model("tiny", package="zoo-b", file="tiny.gguf", architecture="llama")


def test_two_plugins_claiming_one_layer_spec_are_named():
    reg = Registry()
    reg.current_plugin = "zoo-a:a"
    reg.add_layer(RMSNormSpec, RMSNorm)
    reg.current_plugin = "zoo-b:b"
    with pytest.raises(PluginError, match=r"layer spec RMSNormSpec .* 'zoo-a:a' and plugin 'zoo-b"):
        reg.add_layer(RMSNormSpec, "zoo_b.layers:Norm")


def test_a_plugin_model_name_that_registry_yaml_has_is_an_error(monkeypatch):
    plugin_models = Registry()
    plugin_models.current_plugin = "zoo-a:a"
    plugin_models.add_model("llama3", repo="org/other", architecture="llama")
    monkeypatch.setattr("core.plugins.registry", lambda: plugin_models)
    with pytest.raises(PluginError, match=r"'llama3' is defined by both registry.yaml and plugin"):
        merge_named_models({"llama3": {"repo": "unsloth/x"}}, "registry.yaml")
    merged = merge_named_models({"qwen2": {"repo": "Qwen/x"}}, "registry.yaml")
    assert merged["llama3"] == {
        "repo": "org/other",
        "revision": "main",
        "architecture": "llama",
        "dtype": "bfloat16",
        "params": "?",
        "notes": "",
        "plugin": "zoo-a:a",
    }


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(architecture="llama"), ["repo=", "package="]),  # neither source
        (dict(repo="a/b", package="p", file="f", architecture="llama"), ["either"]),  # both
        (dict(package="p", architecture="llama"), ["file="]),
    ],
)
def test_add_model_names_what_is_missing(kw, words):
    reg = Registry()
    reg.current_plugin = "zoo-a:a"
    with pytest.raises(PluginError, match="plugin 'zoo-a:a'") as err:
        reg.add_model("m", **kw)
    assert all(w in str(err.value) for w in words)


def test_layer_kinds_resolve_lazily_and_name_their_culprit():
    reg = Registry()
    reg.current_plugin = "zoo-a:a"
    reg.add_layer(RMSNormSpec, "core.layers.norm:RMSNorm")
    assert reg.layer(RMSNormSpec(1e-6)) is RMSNorm
    with pytest.raises(PluginError, match=r"GQASpec: no layer module is registered .*add_layer"):
        reg.layer(GQASpec(4, 2, 8))
    reg.add_layer(GQASpec, "core.layers.nowhere:Attention")
    with pytest.raises(PluginError, match=r"plugin 'zoo-a:a': layer module 'core.layers.nowhere"):
        reg.layer(GQASpec(4, 2, 8))
    with pytest.raises(PluginError, match=r"'package.module:Class' string"):
        reg.add_layer(MLPSpec, "RMSNorm")
    with pytest.raises(PluginError, match="wants a spec class"):
        reg.add_layer(RMSNormSpec(1e-6), RMSNorm)


class MLPSpec:
    pass


def test_forget_drops_one_plugins_entries():
    reg = Registry()
    reg.current_plugin = "zoo-a:a"
    reg.add_architecture("a", LlamaConfig, {})
    reg.add_layer(MLPSpec, RMSNorm)
    reg.current_plugin = "zoo-b:b"
    reg.add_architecture("b", LlamaConfig, {})
    reg.forget("zoo-a:a")
    assert list(reg.architectures) == ["b"] and not reg.layers


def test_describe_plugins_lists_what_each_registers():
    rows = {row["name"]: row for row in describe_plugins()}
    assert rows["plugins.llama3"]["registers"] == {"architectures": ["llama"]}
    assert rows["plugins.llama3"]["distribution"] == "zoo"
    assert "RMSNormSpec" in rows["plugins.core_layers"]["registers"]["layers"]


class HalfNormSpec:
    """A norm kind the core lacks, as a plugin would bring it."""

    def __init__(self, eps: float):
        self.eps = eps


class HalfNorm(RMSNorm):
    def forward(self, x):
        return super().forward(x) / 2


def test_the_block_builds_every_module_from_its_spec_type(monkeypatch):
    from dataclasses import replace

    import torch

    from core.config import DenseMLPSpec, EmbeddingSpec
    from core.modeling import CausalLM

    live = registry()
    reg = Registry()
    reg.layers = dict(live.layers)
    reg.current_plugin = "zoo-half:half"
    reg.add_layer(HalfNormSpec, HalfNorm)
    monkeypatch.setattr("core.modeling.registry", lambda: reg)
    raw = dict(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=24)
    cfg = LlamaConfig.from_dict({**raw, "num_hidden_layers": 2, "num_attention_heads": 2})
    cfg = replace(cfg.to_runtime(), norm=HalfNormSpec(1e-6), embedding=EmbeddingSpec(2.0))
    with torch.device("meta"):
        net = CausalLM(cfg)
    block = net.model.layers[1]
    assert type(block.input_layernorm) is HalfNorm and type(net.model.norm) is HalfNorm
    assert net.model.embed_tokens.scale == 2.0
    assert type(block.mlp) is live.layer(DenseMLPSpec(24))
    monkeypatch.setattr("core.modeling.registry", lambda: live)
    with pytest.raises(PluginError, match="HalfNormSpec: no layer module is registered"):
        CausalLM(cfg)


def test_hookimpl_marker_is_zoo():
    assert hookimpl.project_name == "zoo"
