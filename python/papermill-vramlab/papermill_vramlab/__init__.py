"""papermill parameters for the vramlab kernel: each override is bound again with
the type that the notebook's cell tagged `parameters` declares for it."""
# papermill loads this package's engine entry point while papermill itself is
# being imported. Importing papermill before any module here makes that happen
# first, so the engine never finds one of those modules half-imported, whichever
# of them a program imports first.
import papermill  # noqa: F401

from .rust import Declaration, ParameterError, bindings, declarations
from .translator import RustTranslator, inject

__all__ = ["Declaration", "ParameterError", "RustTranslator", "bindings", "declarations", "inject"]
