"""papermill's translator for Rust cells, and the same injection for notebooks run without papermill."""
from __future__ import annotations

from collections.abc import Mapping

import nbformat
from papermill.models import Parameter
from papermill.translators import Translator

from .rust import ParameterError, bindings, declarations


class RustTranslator(Translator):
    # papermill inspects the parameters cell before it calls codify, and codify gets
    # only the values: the types that cell declares are kept here in between, so each
    # override is bound with its declared type (evcxr makes `let photos = 240;` an
    # i32, which the cells that use photos as a usize would refuse). codify takes
    # them, so a later notebook without a parameters cell, which papermill does not
    # inspect, never gets another notebook's types.
    declared_types: dict[str, str | None] = {}

    @classmethod
    def inspect(cls, parameters_cell: nbformat.NotebookNode) -> list[Parameter]:
        found = declarations(parameters_cell.source)
        cls.declared_types = {declaration.name: declaration.type for declaration in found}
        # papermill's convention: "None" names an unknown type.
        return [Parameter(d.name, d.type or "None", d.default, d.help) for d in found]

    @classmethod
    def comment(cls, cmt_str: str) -> str:
        return f"// {cmt_str}"

    @classmethod
    def codify(cls, parameters: Mapping[str, object], comment: str = "Parameters") -> str:
        types, cls.declared_types = cls.declared_types, {}
        return bindings(parameters, types, comment) + "\n"


def inject(notebook: nbformat.NotebookNode, parameters: Mapping[str, object]) -> None:
    """Binds `parameters` in a cell tagged `injected-parameters` right after the cell tagged
    `parameters`, replacing an earlier injected cell, as papermill does; unlike papermill,
    refuses a name that the parameters cell does not declare."""
    notebook.cells = [cell for cell in notebook.cells if "injected-parameters" not in tags(cell)]
    index = next((i for i, cell in enumerate(notebook.cells) if cell.cell_type == "code" and "parameters" in tags(cell)), None)
    if index is None:
        raise ParameterError("the notebook has no cell tagged `parameters` to override")
    declared = {declaration.name: declaration.type for declaration in declarations(notebook.cells[index].source)}
    for name in parameters:
        if name not in declared:
            raise ParameterError(f"no parameter `{name}`: the parameters cell declares {', '.join(declared) or 'none'}")
    cell = nbformat.v4.new_code_cell(bindings(parameters, declared, "Injected parameters"))
    cell.metadata["tags"] = ["injected-parameters"]
    notebook.cells.insert(index + 1, cell)


def tags(cell: nbformat.NotebookNode) -> list[str]:
    return cell.metadata.get("tags", [])
