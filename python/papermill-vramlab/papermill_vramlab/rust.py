"""The Rust side of parameters: the `let` declarations of a parameters cell, and
Python values written as Rust expressions of a declared or an inferred type."""
from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from papermill.exceptions import PapermillException


class ParameterError(PapermillException):
    """A parameter that cannot be bound; the message names it, its type and the value."""


class Mismatch(Exception):
    """Why a value has no Rust form of a type; `binding` adds the parameter's name."""


@dataclass(frozen=True)
class Declaration:
    name: str
    type: str | None  # None for a `let` without a type annotation
    default: str
    help: str


IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
LET = re.compile(rf"\s*let\s+(?:mut\s+)?(?P<name>{IDENTIFIER.pattern})\s*(?P<rest>[:=].*)", re.DOTALL)
TOKEN = re.compile(
    r"""
      (?P<line_comment>//[^\n]*)
    | (?P<block_comment>/\*)
    | (?P<raw_string>r(?P<hashes>\#*)".*?"(?P=hashes))
    | (?P<string>"(?:\\.|[^"\\])*")
    | (?P<char>'(?:\\(?:'|[^']+)|[^\\'])')
    | (?P<open>[(\[{])
    | (?P<close>[)\]}])
    | (?P<semicolon>;)
    """,
    re.VERBOSE | re.DOTALL,
)
TRAILING_COMMENT = re.compile(r"[ \t]*//+[ \t]?([^\n]*)")
BLOCK_COMMENT_PART = re.compile(r"/\*|\*/")

FLOATS = {"f32", "f64"}
STRS = {"&str", "&'staticstr"}
F32_MAX = 3.4028234663852886e38


def declarations(source: str) -> list[Declaration]:
    """Each `let NAME[: TYPE] = EXPR;` of a cell, with the `//` comment that ends its line."""
    found = []
    for code, comment in statements(source):
        let = LET.fullmatch(code)
        if not let:
            continue
        rest = let["rest"]
        if rest.startswith("="):
            declared, default = None, rest[1:]
        else:
            equals = top_level_equals(rest)
            if equals is None:
                continue
            declared, default = one_line(rest[1:equals]), rest[equals + 1 :]
        found.append(Declaration(let["name"], declared, one_line(default), comment))
    return found


def statements(source: str) -> Iterator[tuple[str, str]]:
    """Each `;`-ended statement outside brackets, comments blanked out, and its line's trailing comment."""
    code: list[str] = []
    depth = 0
    pos = 0
    while token := TOKEN.search(source, pos):
        code.append(source[pos : token.start()])
        pos = token.end()
        kind = token.lastgroup
        if kind == "line_comment":
            code.append(" ")
        elif kind == "block_comment":
            pos = block_comment_end(source, pos)
            code.append(" ")
        elif kind == "semicolon" and depth == 0:
            trailing = TRAILING_COMMENT.match(source, pos)
            yield "".join(code), trailing[1].strip() if trailing else ""
            code = []
        else:
            depth += {"open": 1, "close": -1}.get(kind, 0)
            code.append(token.group())


def block_comment_end(source: str, pos: int) -> int:
    """Where the block comment opened just before `pos` ends (Rust's block comments nest)."""
    depth = 1
    while depth and (part := BLOCK_COMMENT_PART.search(source, pos)):
        depth += 1 if part.group() == "/*" else -1
        pos = part.end()
    return pos if not depth else len(source)


def top_level_equals(text: str) -> int | None:
    """The `=` that ends the type in `: TYPE = EXPR`, skipping any inside `<...>` (`Item = u8`)."""
    angle = 0
    for index, char in enumerate(text):
        if char == "<":
            angle += 1
        elif char == ">" and text[index - 1] != "-":
            angle -= 1
        elif char == "=" and angle == 0:
            return index
    return None


def one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", text.strip())


def bindings(parameters: Mapping[str, object], types: Mapping[str, str | None], comment: str) -> str:
    """A cell binding each parameter with its type in `types`, or one inferred from its value."""
    return "\n".join([f"// {comment}", *(binding(name, value, types.get(name)) for name, value in parameters.items())])


def binding(name: str, value: object, declared: str | None) -> str:
    if not IDENTIFIER.fullmatch(name):
        raise ParameterError(f"cannot set `{name}`: a parameter's name must be a Rust identifier")
    try:
        ty = declared or inferred_type(value)
        return f"let {name}: {ty} = {literal(value, ty)};"
    except Mismatch as mismatch:
        what = f"`{name}: {declared}`" if declared else f"`{name}` (the parameters cell does not declare its type)"
        raise ParameterError(f"cannot set {what} to {value!r}: {mismatch}") from None


def inferred_type(value: object) -> str:
    """The Rust type for a value whose parameter has no declared type."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "i64"
    if isinstance(value, float):
        return "f64"
    if isinstance(value, str):
        return "String"
    if isinstance(value, list):
        if not value:
            raise Mismatch("an empty list does not say its Vec's element type; declare the parameter's type")
        types = {inferred_type(element) for element in value}
        if types == {"i64", "f64"}:
            types = {"f64"}
        if len(types) > 1:
            raise Mismatch(f"a Vec's elements share one type, and these would be {', '.join(sorted(types))}")
        return f"Vec<{types.pop()}>"
    if value is None:
        raise Mismatch("None does not say which Option it is; declare the parameter's type")
    raise Mismatch(f"a {type(value).__name__} has no Rust form here (numbers, bools, strings and lists do)")


def literal(value: object, ty: str) -> str:
    """`value` as a Rust expression of type `ty`."""
    compact = re.sub(r"\s+", "", ty)
    if option := generic("Option", compact):
        return "None" if value is None else f"Some({literal(value, option)})"
    if value is None:
        raise Mismatch("only an Option can be None")
    if element := generic("Vec", compact):
        if not isinstance(value, list):
            raise Mismatch(f"a {compact} takes a list (papermill: -y 'NAME: [1, 2]')")
        return "vec![" + ", ".join(vec_element(index, item, element) for index, item in enumerate(value)) + "]"
    if compact == "bool":
        if not isinstance(value, bool):
            raise Mismatch("a bool takes True or False")
        return "true" if value else "false"
    if bounds := integer_bounds(compact):
        low, high = bounds
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise Mismatch(f"{compact} holds whole numbers from {low} to {high}")
        return str(value)
    if compact in FLOATS:
        return float_literal(value, compact)
    if compact in STRS or compact == "String":
        if not isinstance(value, str):
            raise Mismatch(f"a {compact} takes a string (papermill's -r passes a value as a string)")
        text = string_literal(value)
        return f"{text}.to_string()" if compact == "String" else text
    raise Mismatch(f"{compact} cannot be set from outside (numbers, bool, &str, String, and Vec or Option of them can)")


def generic(name: str, compact: str) -> str | None:
    """`T` of `name<T>`."""
    match = re.fullmatch(rf"{name}<(.+)>", compact)
    return match[1] if match else None


def vec_element(index: int, value: object, ty: str) -> str:
    try:
        return literal(value, ty)
    except Mismatch as mismatch:
        raise Mismatch(f"element {index} ({value!r}): {mismatch}") from None


def integer_bounds(compact: str) -> tuple[int, int] | None:
    match = re.fullmatch(r"([iu])(8|16|32|64|128|size)", compact)
    if not match:
        return None
    # The kernel builds only for 64-bit targets, where usize and isize are 64 bits.
    bits = 64 if match[2] == "size" else int(match[2])
    return (0, 2**bits - 1) if match[1] == "u" else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)


def float_literal(value: object, ty: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Mismatch(f"an {ty} takes a number")
    try:
        number = float(value)
    except OverflowError:
        raise Mismatch(f"it is beyond {ty}'s range") from None
    if math.isnan(number):
        return f"{ty}::NAN"
    if math.isinf(number):
        return f"{ty}::INFINITY" if number > 0 else f"{ty}::NEG_INFINITY"
    if ty == "f32" and abs(number) > F32_MAX:
        raise Mismatch("it is beyond f32's range")
    # repr always keeps a `.` or an exponent (`1.0`, `1e-05`): the literal stays a float.
    return repr(number)


ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\0": "\\0"}


def string_literal(text: str) -> str:
    """A Rust string literal: printable characters as they are, the others escaped."""
    out = []
    for char in text:
        if char in ESCAPES:
            out.append(ESCAPES[char])
        elif char.isprintable():
            out.append(char)
        elif 0xD800 <= ord(char) <= 0xDFFF:
            raise Mismatch(f"it holds a lone surrogate ({ord(char):#x}), which no Rust string can")
        else:
            out.append(f"\\u{{{ord(char):x}}}")
    return '"' + "".join(out) + '"'
