"""YAML that gives a key twice is refused: PyYAML (and so jsonargparse) would keep the last value
without a word, so a recipe edited in two places trains with whichever came second.

``check_no_duplicate_keys`` finds the first key a mapping gives twice, with both lines;
``use_strict_yaml`` makes jsonargparse's YAML loader (config files, and YAML values given on the
command line) run that check first.
"""

from __future__ import annotations

from typing import Optional

import yaml


class DuplicateKeyError(yaml.YAMLError, ValueError):
    """A mapping gives the same key twice."""


def _first_duplicate(node: yaml.Node) -> Optional[tuple[str, int, int]]:
    """(key, its first line, the line that repeats it), 1-based, of the first repeated key under ``node``."""
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key, value in current.value:
                if isinstance(key, yaml.ScalarNode) and key.value != "<<":
                    line = key.start_mark.line + 1
                    if key.value in seen:
                        return key.value, seen[key.value], line
                    seen[key.value] = line
                stack.append(value)
        elif isinstance(current, yaml.SequenceNode):
            stack.extend(current.value)
    return None


def check_no_duplicate_keys(text: str, where: str, loader: type = yaml.SafeLoader) -> None:
    """Raise ``DuplicateKeyError`` naming ``where`` (a file, or what the text is), the key and both lines
    when a mapping in the YAML ``text`` gives a key twice. Text that is not valid YAML is left to the
    loader, which reports it."""
    try:
        node = yaml.compose(text, Loader=loader)
    except yaml.YAMLError:
        return
    found = _first_duplicate(node) if node is not None else None
    if found is not None:
        key, first, second = found
        raise DuplicateKeyError(f"{where} gives the key {key!r} twice, at line {first} and at line {second}; keep one")


def use_strict_yaml() -> None:
    """Make jsonargparse's YAML loader refuse repeated keys (naming the config file when it has one)."""
    from jsonargparse import set_loader
    from jsonargparse._loaders_dumpers import get_yaml_default_loader, yaml_load

    def strict_yaml_load(stream: str, path: str = "") -> object:
        check_no_duplicate_keys(stream, f"config file {str(path)!r}" if path else "the YAML value", get_yaml_default_loader())
        return yaml_load(stream)

    set_loader("yaml", strict_yaml_load, exceptions=(yaml.YAMLError,))
