"""The errors a user can cause: each a `ZooError` whose message names the culprit and the fix."""


class ZooError(Exception):
    """Base of every error a user, a file or a plugin can cause."""


class ConfigError(ZooError):
    """A config.json (or GGUF metadata) that is malformed, incomplete or contradictory."""


class CheckpointError(ZooError):
    """Weights that are missing, corrupt, of the wrong shape, or in a refused format."""


class PluginError(ZooError):
    """A plugin that fails to load, or two plugins claiming the same name."""


class RequestError(ZooError):
    """A call with bad arguments: prompt too long, bad sampling values, batch too large."""


class HubError(ZooError):
    """A model that cannot be found, downloaded, or read from the local hub cache."""


class DistributedError(ZooError):
    """A tensor-parallel rank that died or stopped answering, seen by the others."""


class ChatTemplateError(RequestError):
    """A conversation the model's chat template refuses or fails on; `index` is the message at
    fault where it can be told (None otherwise)."""

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index
