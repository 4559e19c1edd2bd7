"""Gemma (model_type `gemma`) for Zoo: a plugin package that brings its own layer kinds.

`plugin` holds the hooks (imported by Zoo through the `zoo.plugins` entry point), `config` the
config adapter and the new layer specs, `layers` the torch modules, imported only when a model
is built.
"""

__version__ = "0.1.0"
