"""The package's papermill entry point.

papermill has no entry point group for translators, but it loads every
`papermill.engine` entry point while it is imported, before it reads any
parameter. So the entry point is papermill's own nbclient engine, named
`vramlab` (`--engine vramlab` runs exactly as the default engine), and loading
it imports this module, which registers the Rust translator for the kernel
`vramlab` and for the language `rust`.
"""
from papermill.engines import NBClientEngine
from papermill.translators import papermill_translators

from .translator import RustTranslator

papermill_translators.register("vramlab", RustTranslator)
papermill_translators.register("rust", RustTranslator)

__all__ = ["NBClientEngine"]
