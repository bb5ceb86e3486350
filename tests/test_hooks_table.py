"""The hook table (``components.HOOKS``) is the whole surface the library reads of a component.

Checked here: every registered component provides its stage's protocol and defines no public member
that is neither that protocol nor a hook declared for its stage (``check_component``); every
``hasattr(x, "name")`` / ``getattr(x, "name", ...)`` of the library names a declared hook, a protocol
member, a policy's optional member or an entry of ``NOT_COMPONENT`` below (reads of torch modules,
configs and Python objects); every declared hook is defined or read somewhere; the three policies
provide ``Policy``; ``docs/components.md`` is the page the table generates. Each checker is also shown
to report a violation (a throwaway component, a snippet of source). Generation hooks are another
thing: ``tests/test_hooks.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

import groupwise
from groupwise import components, registry
from groupwise.components import (
    HOOKS,
    HOOKS_BY_NAME,
    POLICY_OPTIONAL,
    PROTOCOLS,
    check_component,
    hooks_markdown,
    own_members,
    protocol_members,
    provides,
)
from groupwise.registry import STAGES, entries, register

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(groupwise.__file__).resolve().parent

# Names the library reads with hasattr / getattr of objects that are not components. A read of a
# component's member must be declared in components.HOOKS (or a protocol) instead.
_MODULE = "a torch / PEFT module (policy/, hooks.py, probing phases)"
_HF_CONFIG = "a Hugging Face model config or tokenizer"
NOT_COMPONENT = {
    **dict.fromkeys(
        (
            "get_base_model",
            "get_decoder",
            "model",
            "layers",
            "h",
            "lm_head",
            "rotary_emb",
            "q_norm",
            "bias",
            "config",
            "peft_config",
            "disable_adapter",
            "merge_and_unload",
            "generation_config",
        ),
        _MODULE,
    ),
    **dict.fromkeys(
        (
            "hidden_size",
            "intermediate_size",
            "logit_scale",
            "logits_scaling",
            "final_logit_softcapping",
            "model_type",
            "attention_dropout",
            "hidden_act",
            "sliding_window",
            "use_sliding_window",
            "layer_types",
            "rope_parameters",
            "rope_scaling",
            "pretraining_tp",
            "max_position_embeddings",
            "eos_token_id",
            "chat_template",
        ),
        _HF_CONFIG,
    ),
    "device": "config.ModelConfig (a role's model)",
    "matmul": "config.ModelConfig",
    "offset": "types.Request",
    "tolist": "a tensor or array a reward function returned",
    "item": "a number-like value a reward function returned",
    "keys": "a tokenizer's BatchEncoding",
    "ndim": "a logged value (tracking.py)",
    "errno": "an OSError",
    "sysconf": "the os module",
    "sched_getaffinity": "the os module",
    "renameat2": "libc (runfolder.py)",
    "attr": "an ast node (papers/check.py reads the package's imports)",
    "id": "an ast node (papers/check.py)",
    "func": "a task's rows function, maybe a functools.partial (papers/)",
}


# ---------------------------------------------------------------------------------------------- the defining side
def registry_problems() -> list[str]:
    return [problem for stage, _, cls in entries() for problem in check_component(stage, cls)]


def test_every_registered_component_keeps_its_stage_contract():
    """Protocol members present, every public member declared for the stage, hooks of the right kind."""
    assert registry_problems() == []


def test_the_checker_reports_undeclared_members_missing_protocol_members_and_wrong_kinds():
    @dataclasses.dataclass
    class Probe:
        """A throwaway advantage estimator."""

        scale: float = 1.0  # a field: a hyper-parameter, never a hook
        group_relative = True  # a declared hook of the advantage stage

        def __call__(self, rollout, info):
            return rollout.rewards

        def shiny_new_hook(self):  # public, declared nowhere: reported
            return 1

        def _helper(self):  # private: not reported
            return 2

        def stats(self, mb, out):  # a hook of the objective stage only: reported
            return {}

        def rollout_extras(self):  # an attribute hook defined as a method: reported
            return ()

    @dataclasses.dataclass
    class HalfSampler:
        def bind(self, n_rows, seed):
            pass

        def draw(self, n, info):
            return []

    register("advantage", "hooks_table_probe")(Probe)
    register("sampling", "hooks_table_probe")(HalfSampler)
    try:
        problems = [p for p in registry_problems() if "hooks_table_probe" in p]
    finally:
        del registry._REGISTRY["advantage"]["hooks_table_probe"], registry._REGISTRY["sampling"]["hooks_table_probe"]
    probe, half = (f"'hooks_table_probe' ({cls.__module__}.{cls.__qualname__})" for cls in (Probe, HalfSampler))
    fix = "prefix a helper with '_', or declare the hook in components.HOOKS"
    assert problems == [
        f"sampling {half} lacks keep, state_dict, load_state_dict of the Sampler protocol (components.py)",
        f"advantage {probe} defines 'shiny_new_hook', not a declared hook: {fix}",
        f"advantage {probe} defines 'stats', a hook of stages objective only: {fix}",
        f"advantage {probe} defines 'rollout_extras' as a method; the hook is an attribute "
        f"(a field, class attribute or property)",
    ]
    assert "hooks_table_probe" not in registry.names("advantage")
    assert not any("hooks_table_probe" in p for p in registry_problems())  # unregistered again


def test_a_reward_provides_one_of_its_two_forms():
    """A reward is a text scorer (``__call__``) or a rollout scorer (``score_rollout``); it needs one.
    Every class is callable: ``__call__`` counts only when a class below ``object`` defines it."""

    @dataclasses.dataclass
    class Scorer:
        def score_rollout(self, rollout, info):
            return rollout.rewards

    @dataclasses.dataclass
    class Neither:
        weight: float = 1.0

    assert check_component("reward", Scorer) == []
    assert check_component("reward", Neither) == [
        f"reward 'Neither' ({Neither.__module__}.{Neither.__qualname__}) lacks __call__ "
        f"of the Reward or RolloutScorer protocol (components.py)"
    ]


def test_the_table_is_well_formed():
    assert len(HOOKS_BY_NAME) == len(HOOKS), "a hook is declared twice"
    assert set(PROTOCOLS) == set(STAGES)
    for hook in HOOKS:
        assert hook.kind in ("method", "attribute") and hook.group in components.GROUPS, hook
        assert hook.when and hook.returns and hook.stages and set(hook.stages) <= set(STAGES), hook
        for stage in hook.stages:  # declared once: a protocol member is no hook too (state: required of two stages)
            required = {m for p in PROTOCOLS[stage] for m in protocol_members(p)}
            assert hook.name not in required or hook.name in ("state_dict", "load_state_dict"), (hook.name, stage)


# ---------------------------------------------------------------------------------------------- the reading side
def library_files() -> list[Path]:
    """The package's sources, and those of registered components kept elsewhere in the repository (papers/)."""
    files = set(PACKAGE.rglob("*.py"))
    for _, _, cls in entries():
        source = Path(inspect.getsourcefile(cls) or "").resolve()
        if ROOT in source.parents:
            files.add(source)
    return sorted(files)


def attribute_reads(source: str) -> list[tuple[int, str, str]]:
    """(line, receiver, name) of every ``hasattr(x, "name")`` and ``getattr(x, "name"[, default])``."""
    reads = []
    for node in ast.walk(ast.parse(source)):
        call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        if not call or node.func.id not in ("hasattr", "getattr"):
            continue
        if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            reads.append((node.lineno, ast.unparse(node.args[0]), node.args[1].value))
    return reads


def known_names() -> set[str]:
    protocols = {m for group in PROTOCOLS.values() for p in group for m in protocol_members(p)}
    policy = set(protocol_members(components.Policy)) | set(POLICY_OPTIONAL)
    return set(HOOKS_BY_NAME) | protocols | policy | set(NOT_COMPONENT)


def undeclared_reads(files: list[Path], known: set[str]) -> list[str]:
    out = []
    for path in files:
        where = path.relative_to(ROOT) if ROOT in path.parents else path
        for line, receiver, name in attribute_reads(path.read_text()):
            if not name.startswith("_") and name not in known:  # _name: private, or Python's own
                out.append(f"{where}:{line}: reads {name!r} of {receiver}")
    return out


def test_every_attribute_the_library_looks_up_is_declared():
    """A new ``hasattr(component, "x")`` fails here until ``x`` is declared in ``components.HOOKS``
    (or, when the object is not a component, listed in ``NOT_COMPONENT`` with what it is)."""
    files = library_files()
    assert len(files) > 150 and PACKAGE / "trainer.py" in files
    assert undeclared_reads(files, known_names()) == [], "declare them in components.HOOKS (NOT_COMPONENT: not one)"


def test_the_reading_check_reports_a_new_undeclared_read(tmp_path):
    source = tmp_path / "module.py"
    source.write_text(
        "def f(component, c, name):\n"
        "    if hasattr(component, 'brand_new_hook'):\n"  # reported
        "        return getattr(c, 'needs', ()), getattr(c, '_own', None), getattr(c, name)\n"
    )
    assert undeclared_reads([source], known_names()) == [f"{source}:2: reads 'brand_new_hook' of component"]


def test_the_allowlist_and_the_table_hold_nothing_stale():
    """Every NOT_COMPONENT and POLICY_OPTIONAL name is still read, and no NOT_COMPONENT name is declared
    elsewhere; every hook is defined by a registered component or read by the library."""
    read = {name for path in library_files() for _, _, name in attribute_reads(path.read_text())}
    assert sorted(set(NOT_COMPONENT) - read) == [] and sorted(set(POLICY_OPTIONAL) - read) == []
    declared = set(HOOKS_BY_NAME) | {m for group in PROTOCOLS.values() for p in group for m in protocol_members(p)}
    declared |= set(protocol_members(components.Policy)) | set(POLICY_OPTIONAL)
    assert sorted(set(NOT_COMPONENT) & declared) == []
    defined = {name for _, _, cls in entries() for name in own_members(cls)}
    assert sorted(h.name for h in HOOKS if h.name not in defined and h.name not in read) == []


# ---------------------------------------------------------------------------------------------- protocols and the page
def test_the_policies_provide_the_policy_protocol():
    from groupwise.modalities.flow import FlowPolicy
    from groupwise.modalities.unified import UnifiedPolicy
    from groupwise.policy.kinds import build_policy

    cfg = groupwise.load_config()
    for policy in (build_policy(cfg.model, cfg.perf), FlowPolicy(), UnifiedPolicy()):
        assert [m for m in protocol_members(components.Policy) if not hasattr(policy, m)] == [], type(policy).__name__


def test_the_protocols_name_what_the_stages_require():
    assert protocol_members(components.Sampler) == ("bind", "draw", "keep", "state_dict", "load_state_dict")
    assert protocol_members(components.Term) == ("coef", "__call__")
    assert protocol_members(components.Provider) == ("grad_ok", "check", "plan", "finish")
    assert [p.__name__ for p in PROTOCOLS["reward"]] == ["Reward", "RolloutScorer"]


@pytest.mark.parametrize("stage", [s for s in STAGES if PROTOCOLS[s]])
def test_every_stage_has_components_and_each_keeps_its_protocol(stage):
    classes = [cls for s, _, cls in entries() if s == stage]
    assert classes, f"stage {stage} has no component"
    for cls in classes:
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        assert any(all(provides(cls, m, fields) for m in protocol_members(p)) for p in PROTOCOLS[stage]), cls


def test_the_components_page_is_current():
    text = hooks_markdown()
    page = (ROOT / "docs" / "components.md").read_text()
    assert page == text, "regenerate: python -m groupwise.components > docs/components.md"
    assert all(f"| `{hook.name}` | {hook.kind} |" in text for hook in HOOKS)
    assert (
        "| `sampling` | `Sampler` | `bind(n_rows, seed)`, `draw(n, info)`, `keep(rollout)`, `state_dict()`, "
        "`load_state_dict(state)` |"
    ) in text
