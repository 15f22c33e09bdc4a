"""Config YAML read as bounded data, keeping the text of every plain scalar.

YAML 1.1 reads plain ``off`` as False, ``0755`` as 493 and ``12:30`` as 750; a config's string
fields (paths, choices such as ``fp4.compile: off``) must keep what was written, so plain scalars
come back as `Plain(text, value)` and `config._coerce` picks the text or the value by the field's
type. Aliases share one node, so a 300-byte file can stand for billions of values ("billion
laughs"), and nesting drives pyyaml's recursive composer: both are bounded here (`YAMLLimitError`,
a `yaml.YAMLError`, so the CLI reports it as one YAML error line).
"""
from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any

import yaml

MAX_DEPTH = 32  # a config nests section.field[list]: 3 levels; 32 leaves room for any real file
MAX_VALUES = 10_000  # scalars and collections after alias expansion (a config holds a few hundred)
MAX_BYTES = 1 << 20  # size of a config file
MAX_SHOWN = 200  # characters of a value quoted in an error message

_STR_TAG, _MERGE_TAG = "tag:yaml.org,2002:str", "tag:yaml.org,2002:merge"


class YAMLLimitError(yaml.YAMLError):
    """A YAML document beyond the bounds a config can need (depth, alias expansion, size)."""


@dataclass(frozen=True)
class Plain:
    """An unquoted YAML scalar that YAML 1.1 reads as something other than a string: its text as
    written and that value (bool, int, float, None, date)."""
    text: str
    value: Any


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader whose (recursive) composer refuses documents nested deeper than MAX_DEPTH."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YAMLLimitError(f"nested more than {MAX_DEPTH} levels deep (at line {mark.line + 1}); a "
                                     f"config is a mapping of sections of fields")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def parse_yaml(text: str) -> Any:
    """The document in `text` as dicts, lists, strs and `Plain` scalars (None for an empty one)."""
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        return None if node is None else _Walk(loader).value(node, 0)
    finally:
        loader.dispose()


class _Walk:
    """Node graph -> values, counting every value an alias repeats (the expanded size)."""

    def __init__(self, loader):
        self.loader, self.count = loader, 0

    def value(self, node, depth: int) -> Any:
        self.count += 1
        if self.count > MAX_VALUES:
            raise YAMLLimitError(f"expands to more than {MAX_VALUES} values (aliases repeat what their anchor "
                                 f"holds); write the values out instead of nesting aliases")
        if depth > MAX_DEPTH:
            raise YAMLLimitError(f"nested more than {MAX_DEPTH} levels deep (an alias refers to itself?)")
        if isinstance(node, yaml.ScalarNode):
            value = self.loader.construct_object(node)
            return Plain(node.value, value) if node.style is None and node.tag != _STR_TAG else value
        if isinstance(node, yaml.SequenceNode):
            return [self.value(child, depth + 1) for child in node.value]
        out = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode):
                raise YAMLLimitError(f"the mapping key at line {line} is a collection; config keys are field names")
            if key_node.tag == _MERGE_TAG:  # pyyaml's merge flattening copies what it merges: unbounded
                raise YAMLLimitError(f"merge keys (`<<`, line {line}) are not supported in a config; write the "
                                     f"fields out")
            out[key_node.value] = self.value(value_node, depth + 1)
        return out


def plain_value(obj: Any) -> Any:
    """`obj` with every `Plain` replaced by its YAML 1.1 value (what yaml.safe_load would give)."""
    if isinstance(obj, Plain):
        return obj.value
    if isinstance(obj, list):
        return [plain_value(v) for v in obj]
    if isinstance(obj, dict):
        return {k: plain_value(v) for k, v in obj.items()}
    return obj


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = MAX_SHOWN
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = 6
_REPR.maxlevel = 2


def show(value: Any) -> str:
    """A bounded repr for error messages (a value may be huge); a `Plain` shows its text."""
    if isinstance(value, Plain):
        value = value.text
    elif isinstance(value, (list, dict)):  # the values as YAML gives them, not Plain(...) wrappers
        value = plain_value(value)
    return _REPR.repr(value)
