"""Plugin discovery, each case in a fresh interpreter: entry points, ZOO_PLUGINS /
ZOO_DISABLE_PLUGINS, broken plugins, loading once, laziness, and `spawn` subprocesses."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import textwrap

# Every hook at once, so that `zoo plugins` has something of each kind to show.
FULL_PLUGIN = """
    from dataclasses import dataclass
    from core.hookspecs import hookimpl
    from plugins.llama3 import LlamaConfig, WEIGHT_MAP

    CALLS = []

    @dataclass(frozen=True)
    class TinyNormSpec:
        eps: float

    @hookimpl
    def zoo_register_formats(registry):
        registry.add_format("{name}-format", detect=lambda path: False, open=None)

    @hookimpl
    def zoo_register_layers(registry):
        registry.add_layer(TinyNormSpec, "core.layers.norm:RMSNorm")

    @hookimpl
    def zoo_register_architectures(registry):
        CALLS.append(1)
        registry.add_architecture("{name}", LlamaConfig, WEIGHT_MAP)

    @hookimpl
    def zoo_register_models(registry):
        registry.add_model("{name}-tiny", repo="org/{name}-tiny", architecture="{name}")
"""

REPORT = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from core import ZooError
from core.plugins import describe_plugins, registry, skipped_plugins
try:
    reg = registry()
except ZooError as err:
    print(json.dumps({"error": str(err)}))
    sys.exit(0)
print(json.dumps({
    "architectures": sorted(reg.architectures),
    "plugins": {row["name"]: row for row in describe_plugins()},
    "skipped": {p.name: p.skipped for p in skipped_plugins()},
}))
"""


def write_dist(site, dist: str, module: str, body: str, entry_points: str = "") -> None:
    """A minimal installed distribution (version 0.1) with a `zoo.plugins` entry point."""
    (site / f"{module}.py").write_text(textwrap.dedent(body))
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"  # as a wheel names it
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[zoo.plugins]\n{entry_points or f'{module} = {module}'}\n"
    )


def run_py(site, code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", **env}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120
    )


def report(site, **env: str) -> tuple[dict, str]:
    out = run_py(site, REPORT, **env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


def test_entry_point_plugin_registers_every_kind(tmp_path):
    write_dist(tmp_path, "zoo-toyarch", "zoo_toyarch", FULL_PLUGIN.format(name="toyarch"))
    got, _ = report(tmp_path)
    row = got["plugins"]["zoo-toyarch:zoo_toyarch"]
    assert (row["distribution"], row["version"]) == ("zoo-toyarch", "0.1")
    assert row["registers"] == {
        "architectures": ["toyarch"],
        "formats": ["toyarch-format"],
        "layers": ["TinyNormSpec"],
        "models": ["toyarch-tiny"],
    }


HALF_PLUGIN = """
    from core.hookspecs import hookimpl
    from plugins.llama3 import LlamaConfig

    @hookimpl
    def zoo_register_architectures(registry):
        registry.add_architecture("half", LlamaConfig, {})
        raise KeyError("hidden_size")
"""


def test_broken_plugins_are_skipped_with_a_warning(tmp_path):
    write_dist(tmp_path, "zoo-broken", "zoo_broken", "raise ImportError('needs libfoo')\n")
    write_dist(tmp_path, "zoo-half", "zoo_half", HALF_PLUGIN)  # its hook raises half way
    got, err = report(tmp_path)
    assert "llama" in got["architectures"]
    assert "zoo-broken" in err and "needs libfoo" in err
    assert "needs libfoo" in got["skipped"]["zoo-broken:zoo_broken"]
    assert "half" not in got["architectures"]  # what it added before failing is dropped
    assert "zoo-half" in err and "KeyError" in err and "hidden_size" in err
    assert "zoo_register_architectures failed" in got["skipped"]["zoo-half:zoo_half"]
    assert "zoo-half:zoo_half" not in got["plugins"]


def test_misspelled_hook_fails_check_pending(tmp_path):
    body = """
        from core.hookspecs import hookimpl

        @hookimpl
        def zoo_register_architecture(registry):  # a typo: no such hook
            pass
    """
    write_dist(tmp_path, "zoo-typo", "zoo_typo", body)
    got, _ = report(tmp_path)
    assert "zoo-typo" in got["error"] and "hook" in got["error"]


def test_two_entry_point_plugins_claiming_one_name_are_named(tmp_path):
    write_dist(tmp_path, "zoo-a", "zoo_a", FULL_PLUGIN.format(name="toyarch"))
    write_dist(tmp_path, "zoo-b", "zoo_b", FULL_PLUGIN.format(name="toyarch"))
    got, _ = report(tmp_path)
    assert "registered by both plugin 'zoo-" in got["error"]
    assert "zoo-a:zoo_a" in got["error"] and "zoo-b:zoo_b" in got["error"]


# (environment, which of plugins a and b load, why the others are skipped)
SCENARIOS = [
    ({}, ["a", "b"], {}),
    ({"ZOO_PLUGINS": "Zoo_A"}, ["a"], {"b": "not named in ZOO_PLUGINS"}),
    ({"ZOO_PLUGINS": "zoo-b:zoo_b, zoo-a"}, ["a", "b"], {}),
    ({"ZOO_PLUGINS": ""}, [], {"a": "ZOO_PLUGINS", "b": "ZOO_PLUGINS"}),
    ({"ZOO_DISABLE_PLUGINS": "zoo_b"}, ["a"], {"b": "disabled by ZOO_DISABLE_PLUGINS"}),
    ({"ZOO_PLUGINS": "zoo-a,zoo-b", "ZOO_DISABLE_PLUGINS": "zoo-a"}, ["b"], {"a": "DISABLE"}),
    ({"ZOO_DISABLE_PLUGINS": "zoo-aa"}, ["a", "b"], {}),  # a typo: warned about
]
SCENARIO_RUNNER = """
import json, os, sys
import core.plugins
out = []
for env in json.loads(sys.argv[1]):
    for var in ("ZOO_PLUGINS", "ZOO_DISABLE_PLUGINS"):
        os.environ.pop(var, None)
    os.environ.update(env)
    core.plugins._loaded = None  # load afresh, as a new process would
    reg = core.plugins.registry()
    out.append({"architectures": sorted(reg.architectures),
                "skipped": {p.name: p.skipped for p in core.plugins.skipped_plugins()}})
print(json.dumps(out))
"""


def test_allow_and_deny_lists(tmp_path):
    write_dist(tmp_path, "zoo-a", "zoo_a", FULL_PLUGIN.format(name="a"))
    write_dist(tmp_path, "zoo-b", "zoo_b", FULL_PLUGIN.format(name="b"))
    envs = json.dumps([env for env, _, _ in SCENARIOS])
    out = run_py(tmp_path, SCENARIO_RUNNER, envs)
    assert out.returncode == 0, out.stderr
    for (env, loaded, skipped), got in zip(SCENARIOS, json.loads(out.stdout), strict=True):
        assert [a for a in ("a", "b") if a in got["architectures"]] == loaded, env
        assert "llama" in got["architectures"]  # built-ins always load
        for name, why in skipped.items():
            assert why in got["skipped"][f"zoo-{name}:zoo_{name}"], env
    assert "ZOO_DISABLE_PLUGINS names 'zoo-aa', which matches no installed plugin" in out.stderr


def test_plugins_load_once(tmp_path):
    # two entry points of one distribution naming the same module: registered once
    eps = "first = zoo_once\nsecond = zoo_once"
    write_dist(tmp_path, "zoo-once", "zoo_once", FULL_PLUGIN.format(name="once"), eps)
    code = """
import json, zoo_once
from core.catalog import named_models
from core.plugins import describe_plugins, plugin_manager, registry, skipped_plugins
reg = registry()
assert registry() is reg and plugin_manager() is plugin_manager()
describe_plugins(); named_models(); describe_plugins()
print(json.dumps({"calls": len(zoo_once.CALLS), "models": sorted(named_models()),
                  "skipped": {p.name: p.skipped for p in skipped_plugins()}}))
"""
    out = run_py(tmp_path, code)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["calls"] == 1
    assert "once-tiny" in got["models"] and "llama3" in got["models"]  # merged with registry.yaml
    assert "already loaded as plugin 'zoo-once:first'" in got["skipped"]["zoo-once:second"]


HEAVY = ("torch", "kernels", "triton", "core.modeling", "core.layers", "zoo_stablelm.layers")


def test_listing_imports_no_torch_and_no_kernels(tmp_path):
    """`zoo plugins` and `zoo list` load every plugin (example packages included, if
    installed) but import no torch, kernel or layer module."""
    code = f"""
import json, sys
from core.cli.commands import main
main(["plugins"]); main(["list"])
print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))
"""
    out = run_py(tmp_path, code, HF_HUB_OFFLINE="1", HOME=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "plugins.llama3" in out.stdout and "llama3" in out.stdout
    heavy = json.loads(out.stdout.splitlines()[-1])
    assert heavy == [], f"listing plugins or models imported {heavy}"


def test_plugins_resolve_in_a_spawned_process(tmp_path, monkeypatch):
    """A fresh `spawn` interpreter finds the same plugins: built-ins, entry points on its
    sys.path (inherited from the parent) and the installed example packages."""
    write_dist(tmp_path, "zoo-spawned", "zoo_spawned", FULL_PLUGIN.format(name="spawned"))
    monkeypatch.syspath_prepend(str(tmp_path))
    from core.plugins import describe_plugins

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        rows = pool.apply(describe_plugins)
    archs = {a for row in rows for a in row["registers"].get("architectures", [])}
    assert {"llama", "qwen2", "deepseek_v2", "spawned"} <= archs
    missing = {"granite", "stablelm"} - archs
    assert not missing, (
        f"{missing}: install the example packages: pip install -e examples/zoo-granite "
        "-e examples/zoo-stablelm"
    )
