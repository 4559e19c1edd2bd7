"""StableLM 2 (model_type `stablelm`) for Zoo: a plugin package that brings its own layer kind.

`plugin` holds the hooks (imported by Zoo through the `zoo.plugins` entry point), `config` the
config adapter and the new layer spec, `layers` the torch module, imported only when a model is
built.
"""

__version__ = "0.1.0"
