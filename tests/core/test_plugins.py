"""The plugin manager: built-ins and entry points through one path, duplicate claims named."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from core import PluginError
from core.hookspecs import hookimpl
from core.plugins import Registry, plugin_manager, registry
from plugins.llama3 import LlamaConfig


def test_builtins_registered():
    reg = registry()
    assert reg.architectures["llama"].plugin == "plugins.llama3"
    assert reg.formats["safetensors"].plugin == "plugins.safetensors"
    assert plugin_manager().has_plugin("plugins.llama3")


def test_two_plugins_claiming_one_model_type_are_named():
    reg = Registry()
    reg.current_plugin = "first-dist:first"
    reg.add_architecture("llama", LlamaConfig, {})
    reg.current_plugin = "second-dist:second"
    with pytest.raises(PluginError, match="'first-dist:first' and plugin 'second-dist:second'"):
        reg.add_architecture(["mistral", "llama"], LlamaConfig, {})


def write_dist(site, dist: str, module: str, body: str) -> None:
    """A minimal installed distribution with one `zoo.plugins` entry point."""
    (site / f"{module}.py").write_text(textwrap.dedent(body))
    info = site / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[zoo.plugins]\n{module} = {module}\n")


def run_py(site, code: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


PLUGIN = """
    from core.hookspecs import hookimpl
    from plugins.llama3 import LlamaConfig, WEIGHT_MAP

    @hookimpl
    def zoo_register_architectures(registry):
        registry.add_architecture("mistral", LlamaConfig, WEIGHT_MAP)
"""


def test_entry_point_plugin_is_registered(tmp_path):
    write_dist(tmp_path, "zoo_mistral", "zoo_mistral", PLUGIN)
    code = "from core.plugins import registry; print(registry().architectures['mistral'].plugin)"
    out = run_py(tmp_path, code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "zoo_mistral:zoo_mistral"


def test_broken_plugin_is_skipped_with_a_warning(tmp_path):
    write_dist(tmp_path, "zoo_broken", "zoo_broken", "raise ImportError('needs libfoo')\n")
    out = run_py(
        tmp_path, "from core.plugins import registry; print(sorted(registry().architectures))"
    )
    assert out.returncode == 0, out.stderr
    assert "llama" in out.stdout
    assert "zoo_broken" in out.stderr and "needs libfoo" in out.stderr


def test_misspelled_hook_fails_check_pending(tmp_path):
    body = """
        from core.hookspecs import hookimpl

        @hookimpl
        def zoo_register_architecture(registry):  # a typo: no such hook
            pass
    """
    write_dist(tmp_path, "zoo_typo", "zoo_typo", body)
    out = run_py(
        tmp_path,
        "import json\nfrom core import ZooError\nfrom core.plugins import registry\n"
        "try:\n    registry()\nexcept ZooError as e:\n    print(json.dumps(str(e)))\n",
    )
    assert out.returncode == 0, out.stderr
    assert "zoo_typo" in json.loads(out.stdout) and "hook" in json.loads(out.stdout)


def test_hookimpl_marker_is_zoo():
    assert hookimpl.project_name == "zoo"
