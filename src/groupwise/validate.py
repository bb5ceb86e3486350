"""Checking a value against its declared type, on the ground floor: the config's dataclasses
(``config.py``) and a component's parameters (``registry.build``) are checked by this one function,
and neither module imports the other for it.
"""

from __future__ import annotations

from typing import Any

from groupwise.errors import ConfigError

_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "dict": (dict,), "list": (list,)}
_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "true or false",
    "dict": "a table",
    "list": "an array",
    "None": "none",
}


def check_type(what: str, annotation: Any, value: Any) -> None:
    """Raise a ConfigError naming ``what`` when ``value`` does not fit a simple annotation
    (``int``, ``float``, ``str``, ``bool``, ``dict``, ``list``, their ``X | None`` unions, ``tuple[...]``);
    other annotations are not checked. A number is never a bool and a bool is never a number."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    options = [t.strip() for t in text.split("|")]
    if any(o not in _TYPES and o != "None" and not o.startswith("tuple[") for o in options):
        return
    for option in options:
        if option == "None" and value is None:
            return
        if option.startswith("tuple["):
            if isinstance(value, (list, tuple)):
                return
            continue
        kinds = _TYPES.get(option, ())
        if isinstance(value, bool) and option != "bool":
            continue
        if isinstance(value, kinds):
            return
    wanted = " or ".join(_TYPE_WORDS.get(o, "an array" if o.startswith("tuple[") else o) for o in options)
    raise ConfigError(f"{what} must be {wanted}, got {value!r} ({type(value).__name__})")
