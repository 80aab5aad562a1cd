"""Hydra's flow syntax for override values: ``{_default:X}``, ``[a,b]``, ``{math:3,_default:1}``.

NeMo Gym users paste overrides such as ``+agent_map={_default:simple_agent}``. Read as YAML, ``{a:b}`` is a
mapping with the single key ``"a:b"`` and a null value, which would silently mean something else. Values
that start with ``{`` or ``[`` are therefore parsed here, with Hydra's rules: a mapping key runs up to the
first ``:``, a plain value runs up to the next ``,``, ``]`` or ``}`` at its nesting level (so
``{sim:val:env}`` is ``{"sim": "val:env"}``), quotes make a string, and a plain value is typed as a YAML
scalar (``3`` is an int, ``true`` a bool, ``null`` None, anything else a string). Interpolations (``${...}``)
stay strings for OmegaConf to resolve.
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["FlowSyntaxError", "parse_flow_value"]

_CLOSERS = {"{": "}", "[": "]"}


class FlowSyntaxError(ValueError):
    """A flow value that does not parse; the message says where."""


def parse_flow_value(text: str) -> Any:
    """The Python value of a Hydra flow value (a ``{...}`` mapping or ``[...]`` list).

    Args:
        text: The override's value text, starting with ``{`` or ``[``.

    Returns:
        Plain dicts, lists and scalars.

    Raises:
        FlowSyntaxError: Unbalanced brackets or quotes, a mapping item without ``:``, or text after the
            closing bracket.
    """
    parser = _Parser(text)
    value = parser.value()
    parser.skip_space()
    if parser.pos != len(text):
        raise FlowSyntaxError(f"unexpected {text[parser.pos :]!r} after the closing bracket")
    return value


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def value(self) -> Any:
        self.skip_space()
        char = self.peek()
        if char == "{":
            return self.mapping()
        if char == "[":
            return self.sequence()
        if char in "'\"":
            return self.quoted()
        return self.plain()

    def expect(self, char: str) -> None:
        self.skip_space()
        if self.peek() != char:
            found = repr(self.peek()) if self.peek() else "the end"
            raise FlowSyntaxError(f"expected {char!r} at column {self.pos + 1}, found {found}")
        self.pos += 1

    def mapping(self) -> dict[str, Any]:
        self.expect("{")
        out: dict[str, Any] = {}
        self.skip_space()
        if self.peek() == "}":
            self.pos += 1
            return out
        while True:
            self.skip_space()
            key = self.quoted() if self.peek() in "'\"" else self.key()
            self.expect(":")
            out[str(key)] = self.value()
            self.skip_space()
            if self.peek() == ",":
                self.pos += 1
                continue
            self.expect("}")
            return out

    def sequence(self) -> list[Any]:
        self.expect("[")
        out: list[Any] = []
        self.skip_space()
        if self.peek() == "]":
            self.pos += 1
            return out
        while True:
            out.append(self.value())
            self.skip_space()
            if self.peek() == ",":
                self.pos += 1
                continue
            self.expect("]")
            return out

    def key(self) -> str:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in ":,{}[]":
            self.pos += 1
        key = self.text[start : self.pos].strip()
        if not key:
            raise FlowSyntaxError(f"a mapping item at column {start + 1} has no key")
        return key

    def quoted(self) -> str:
        quote = self.text[self.pos]
        self.pos += 1
        chars: list[str] = []
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char == "\\" and self.pos + 1 < len(self.text):
                chars.append(self.text[self.pos + 1])
                self.pos += 2
                continue
            if char == quote:
                self.pos += 1
                return "".join(chars)
            chars.append(char)
            self.pos += 1
        raise FlowSyntaxError(f"the quote {quote} opened in the value is never closed")

    def plain(self) -> Any:
        start = self.pos
        depth = 0  # ${...} interpolations may hold commas and braces
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if self.text.startswith("${", self.pos):
                depth += 1
                self.pos += 2
                continue
            if char == "}" and depth:
                depth -= 1
            elif char in ",]}" and not depth:
                break
            self.pos += 1
        raw = self.text[start : self.pos].strip()
        if raw == "":
            return ""
        if "${" in raw:
            return raw
        try:
            return yaml.safe_load(raw)
        except yaml.YAMLError:
            return raw
