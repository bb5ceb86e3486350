"""Components from the user's own modules, without forking the package (``docs/extending.md``).

Two ways in, both going through the one registry (``registry.py``), so a plug-in is built, checked,
listed, explained, checkpointed and resumed exactly as a built-in:

- ``plugins = ["my_components"]`` (config, top level): each module is imported before anything is
  built, and the ``@register(stage, name)`` calls in it add its components under their short names.
- ``name = "my_components:MyTerm"`` in any component entry (``objective.terms``, ``advantage.estimator``,
  ``rollout.name``, ``rollout.params.env``, ...): the module is imported and the class taken from it;
  a class no ``@register`` named is registered in that stage under the spec itself, so checkpoint
  keys, ``config.toml`` and the resume check all see one stable name.

**Import path.** A plug-in module is imported by its module name (``import_module``), with two
folders appended to ``sys.path`` first: the working directory of the run, and the folder of the
recipe file (``config.load_config`` records it). Appended, not prepended: an installed package of
the same name wins, so a file in your folder never shadows a library. Every torchrun rank and every
``groupwise compare`` / ``claims`` child runs the same command from the same working directory (a
child gets the recipe's absolute path), so each resolves the same modules. Anything else: set
``PYTHONPATH``.

**Checks.** A plug-in class must be a dataclass (its fields are the parameters: unknown keys and
wrong types are refused as for a built-in) and keep its stage's contract (the ``Protocol`` of
``components.PROTOCOLS``, :func:`required`), as every built-in does; the trainer's own build-time checks
(needs, modality, sampling options, extras) then apply to it unchanged. A plug-in may not take a
built-in's name (``registry.register`` refuses it).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import sys
import traceback
from collections.abc import Iterable
from types import ModuleType
from typing import Any

from groupwise.errors import ConfigError
from groupwise.registry import STAGES, entries, load_all, register


def required(stage: str) -> list[tuple[str, ...]]:
    """The members a ``stage`` component must have, one tuple per form of its contract (a reward is a
    text scorer or a rollout scorer): the ``Protocol`` members of ``components.PROTOCOLS``, the same
    contract every built-in keeps (``tests/test_hooks_table.py``). Optional hooks are not listed."""
    from groupwise.components import PROTOCOLS, protocol_members

    if stage not in PROTOCOLS:
        raise ConfigError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")
    return [protocol_members(protocol) for protocol in PROTOCOLS[stage]]


_RECIPE_DIRS: list[str] = []  # folders of the recipe files loaded in this process (config.load_config)


def add_recipe_dir(folder: Any) -> None:
    """Look for plug-in modules in ``folder`` too (the folder of a recipe file being loaded)."""
    path = os.path.abspath(str(folder))
    if path not in _RECIPE_DIRS:
        _RECIPE_DIRS.append(path)


def search_dirs() -> list[str]:
    """The folders appended to ``sys.path`` for plug-ins: the working directory, then the recipes' folders."""
    return list(dict.fromkeys([os.getcwd(), *_RECIPE_DIRS]))


def import_module(module: str, where: str) -> ModuleType:
    """Import the user module ``module`` (for ``where``, named in errors) after appending ``search_dirs()``."""
    if isinstance(module, str) and module.endswith(".py"):
        raise ConfigError(
            f"{where}: {module!r} is a file name; name its module instead: {module[:-3].replace('/', '.')!r} "
            f"(found in the working directory or the recipe file's folder)"
        )
    if not isinstance(module, str) or not module or not all(part.isidentifier() for part in module.split(".")):
        raise ConfigError(
            f"{where}: {module!r} is not a module name (dotted identifiers, e.g. 'my_components' or "
            f"'my_pkg.losses'; a file my_components.py in the working directory is module 'my_components')"
        )
    folders = search_dirs()
    known = {os.path.abspath(p or os.curdir) for p in sys.path}
    sys.path.extend(f for f in folders if f not in known)
    importlib.invalidate_caches()  # a module written since the last import is found
    before = {(stage, name) for stage, name, _ in entries()}
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is None or not (module == err.name or module.startswith(err.name + ".")):  # its own import failed
            raise ConfigError(f"{where}: importing {module!r} failed: {_origin(err)}") from err
        raise ConfigError(
            f"{where}: no module {module!r} on the import path; after the installed packages groupwise looks in "
            f"the working directory and the recipe file's folder ({', '.join(folders)}): run from the folder "
            f"holding {module.replace('.', '/')}.py, or add its folder to PYTHONPATH"
        ) from None
    except ConfigError as err:  # a @register in it refused (a clash with a built-in)
        raise ConfigError(f"{where}: importing {module!r}: {err}") from None
    except Exception as err:
        raise ConfigError(f"{where}: importing {module!r} failed: {_origin(err)}") from err
    for stage, name, cls in entries():  # what its @register calls added meets its stage's contract
        if (stage, name) not in before:
            check_component(stage, cls, f"{where}: {stage} component {name!r} of {module!r}")
    return imported


def _origin(err: BaseException) -> str:
    """``Type: message (file:line)``: the error and the innermost line that raised it."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    if isinstance(err, SyntaxError) and err.filename:
        where = f" ({err.filename}:{err.lineno})"
    return f"{type(err).__name__}: {err}{where}"


def import_plugins(modules: Iterable[Any], where: str = "plugins") -> None:
    """Import each module of a config's ``plugins`` list (the built-ins first, so a clash is caught)."""
    load_all()
    for i, module in enumerate(modules):
        import_module(module, f"{where}[{i}]")


def split_spec(spec: str) -> tuple[str, str]:
    """``"pkg.mod:Attr"`` -> ``("pkg.mod", "Attr")``."""
    module, _, attr = spec.rpartition(":")
    if not module or not attr.isidentifier():
        raise ConfigError(f"component {spec!r}: a plug-in is named 'module:Class', e.g. 'my_components:MyTerm'")
    return module, attr


def load_class(spec: str, where: str) -> type:
    """The class ``spec`` = ``"module:Class"`` names (imported; not registered)."""
    module_name, attr = split_spec(spec)
    module = import_module(module_name, where)
    if not hasattr(module, attr):
        public = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, public, n=3)
        hint = (
            f"; did you mean {', '.join(repr(c) for c in close)}?"
            if close
            else f"; it defines {', '.join(public) or 'nothing public'}"
        )
        raise ConfigError(f"{where}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no {attr!r}{hint}")
    cls = getattr(module, attr)
    if not isinstance(cls, type):
        raise ConfigError(
            f"{where}: {spec!r} is a {type(cls).__name__}, not a class; a component is a dataclass whose fields "
            f"are its parameters"
        )
    return cls


def resolve(stage: str, table: dict[str, type], spec: str) -> type:
    """The class of ``stage`` that ``spec`` (``"module:Class"``) names, registered under ``spec`` if no
    ``@register`` named it (``registry.lookup`` calls this for a name with ``:`` it does not know)."""
    where = f"{stage} component {spec!r}"
    cls = load_class(spec, where)
    own = cls.__dict__.get("registry_name")  # set by @register on this class (a subclass inherits its base's)
    if own is not None and table.get(own) is cls:
        return cls  # its module registered it in this stage: the short name and the spec name the same class
    if own is not None:
        raise ConfigError(
            f"{where}: {cls.__qualname__} is registered as {cls.__dict__.get('stage')} component {own!r}; "
            f"it is no component of stage {stage!r}"
        )
    check_component(stage, cls, where)
    return register(stage, spec)(cls)


def _lacks(stage: str, cls: type) -> list[str] | None:
    """The members of ``stage``'s contract ``cls`` lacks (of its closest form); None when it keeps one form."""
    from groupwise.components import provides

    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    forms = required(stage)
    if not forms:
        return None
    lacks = [[m for m in members if not provides(cls, m, fields)] for members in forms]
    return None if not all(lacks) else min(lacks, key=len)


def check_component(stage: str, cls: type, where: str) -> None:
    """Refuse a class that cannot be a ``stage`` component: not a dataclass, or a member of the stage's
    contract missing (as for a built-in: ``components.PROTOCOLS``)."""
    if not dataclasses.is_dataclass(cls):
        raise ConfigError(
            f"{where}: {cls.__qualname__} is not a dataclass; decorate it with @dataclass (its fields are the "
            f"component's parameters)"
        )
    missing = _lacks(stage, cls)
    if missing:
        raise ConfigError(
            f"{where}: {cls.__qualname__} lacks {', '.join(missing)}, which every {stage} component defines "
            f"(the contract in groupwise/components.py; docs/components.md)"
        )


def stages_fitting(cls: type) -> list[str]:
    """The stages whose contract ``cls`` keeps (where ``module:Class`` could name it)."""
    return [stage for stage in STAGES if required(stage) and _lacks(stage, cls) is None]


def is_plugin(cls: type) -> bool:
    """Whether ``cls`` comes from outside the groupwise package."""
    return not (cls.__module__ == "groupwise" or cls.__module__.startswith("groupwise."))
