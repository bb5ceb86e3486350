"""The paper folders (issue 34, item 1): one folder per implemented paper with its manifest, every
registry entry and source file owned by exactly one manifest, discovery of the folders' tasks,
recipes and claims, the generated docs/variants.md, `groupwise paper NN`, and package data."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from groupwise import cli
from groupwise.errors import ConfigError
from groupwise.papers import PACKAGE, PAPERS, check, find, folders, papers, standard

ROOT = Path(__file__).resolve().parents[1]
# the 45 spec numbers with a row in the Papers table before the move (43 shares 36's folder),
# and 19, 23, 26, 37 (issue 37), 54, 22, 47, 12 and 11 (issue 41), 21, 28, 45 and 52 (issue 42)
IMPLEMENTED = [
    2,
    3,
    4,
    5,
    6,
    7,
    8,
    9,
    10,
    11,
    12,
    13,
    14,
    15,
    16,
    17,
    18,
    19,
    20,
    21,
    22,
    23,
    24,
    25,
    26,
    27,
    28,
    29,
    30,
    31,
    32,
    33,
    34,
    35,
    36,
    37,
    38,
    39,
    40,
    41,
    42,
    44,
    45,
    46,
    47,
    48,
    49,
    50,
    51,
    52,
    53,
    54,
    55,
    56,
    57,
    58,
    59,
    60,
    61,
]


def test_one_folder_per_implemented_paper_named_after_its_spec_file():
    assert len(IMPLEMENTED) == 59
    assert [m.spec for m in papers()] == IMPLEMENTED
    assert find(43).name == find(36).name == "36_fg_expo" and find("07").spec == 7
    for m in papers():
        # folder NN_slug follows specs/NN-slug.md: 20_semantic_reward_grpo <- 20-semantic-reward-grpo.md
        assert m.name == m.spec_file.removesuffix(".md").replace("-", "_"), m.name
        assert (m.path.parent / "README.md").read_text().startswith(f"# {m.spec:02d} · {m.title}\n"), m.name
        assert m.arxiv and m.owned() and m.tests, m.name
    with pytest.raises(ConfigError, match="no paper with spec number '99'; implemented: 02, 03, 04"):
        find("99")
    assert (ROOT / "papers").resolve() == PAPERS  # the repository's link, like recipes/


def test_every_entry_file_recipe_and_claim_belongs_to_exactly_one_manifest():
    assert check.all_problems() == []
    # 185 registry entries and tasks of the package before the move, 4 more from issue 37 (cm_grpo, step_mean,
    # x0_pred, flow2d_bimodal), 4 from issue 40 (agent, answer, textarena, calc), 3 from issue 40's rest (envs trl,
    # gymnasium, verifiers), 3 from issue 37's DIAL (multi_intent, drive_rater, drive2d), 3 from issue 37's GAGPO
    # (advantage gagpo, env and task keydoor), 7 from issue 37's paper 37 (mean_anchor, nr_iterations,
    # nr_converged, learned_reward, nr_reward_model, powerflow2, powerflow2_demos), 3 from issue 41's mdlm
    # (providers strat_logp, elbo; weight dps), 3 from issue 41's paper 22 (reward keep_items,
    # tasks keep_items and keep_items_pairs), 3 from issue 41's 47 (dpa_game, verify_game, verify_game_sft),
    # 5 from issue 41's paper 12 (weights ht_hierarchy, ht_stage, schedule piecewise, reward and task
    # layout_paint), 4 from issue 41's paper 11 (rollout adevis, reward chamfer_view, tasks cloud_views and
    # cloud_views_fit), 4 from issue 41's paper 10 (phase lac_align, rollout lac_binding, reward binding_reward, task
    # flow_binding), 6 from issue 42's paper 21 (advantage and objective kvpo, rollout kv_branches, rewards
    # traj_local and traj_global, task traj2d), 1 from issue 42's M8 (phase average_init), 6 from issue 42's paper 45
    # (objective flow_opd, reward by_task, rollout anchor_distance, tasks flow2d_multi, flow2d_multi_a,
    # flow2d_multi_b), 3 from issue 42's paper 52 (rollout mutual, advantage xgrpo, weight peer_is), 3 from issue 42's
    # paper 28 (phase fkl_warmup, objective opd, advantage opd_token); a test's own, e.g. test_signal_reshaping's env,
    # come from modules outside it and need no manifest
    entries = [entry for entry in check.registered() if entry[2].startswith("groupwise.")]
    owned = [key for m in check.manifests() for key in m.owned()]
    assert len(entries) == len(owned) == len(set(owned)) == 250
    assert {(stage, name) for stage, name, _ in entries} == set(owned)


def test_an_unlisted_component_file_or_double_owner_is_reported(monkeypatch):
    """The checks fail on what they exist for: a component or file no manifest lists, a component
    owned twice, an owned component under `uses`, a listed name nothing registers."""
    entries = check.registered()
    new, plugin = ("objective", "my_new_term", "groupwise.losses.my_new_term"), ("objective", "plug", "my_pkg.losses")
    extra = [*entries, new, plugin]
    problems = check.entry_problems(extra)
    assert problems == [  # the plug-in from outside the package needs no manifest
        "objective 'my_new_term' (groupwise.losses.my_new_term) belongs to no manifest: list it under [components] "
        "of its paper's paper.toml, or of papers/standard.toml if it is a standard algorithm"
    ]
    assert check.file_problems([*check.source_files(), PACKAGE / "losses" / "my_new_term.py"]) == [
        "losses/my_new_term.py belongs to no manifest: move it into its paper's folder, or add it to `files` "
        "of its paper's paper.toml (or to `files` / `core` of papers/standard.toml)"
    ]
    sign, lpo = find(48), find(57)
    twice = dataclasses.replace(
        lpo, components={**lpo.components, "advantage": ["sign"]}, uses={"objective": ["lpo"], "view": ["nope"]}
    )
    monkeypatch.setattr(check, "manifests", lambda: [twice if m is lpo else m for m in (*papers(), standard())])
    problems = check.entry_problems(entries)
    assert f"{lpo.path}: [uses] view 'nope' is not registered" in problems
    assert f"{lpo.path}: objective 'lpo' is both owned and in [uses]; keep it under [components]" in problems
    assert (
        "advantage 'sign' is owned by 48_sign_advantage and 57_lpo: own it once, list it under [uses] elsewhere"
        in problems
    )
    assert sign.name == "48_sign_advantage" and len(problems) == 3
    assert check.file_problems([PACKAGE / "advantages" / "sign.py"]) == []  # files are the manifest's own, untouched


def test_a_recipe_or_claim_file_its_manifest_does_not_list_is_reported(monkeypatch):
    sign = find(48)
    wrong = dataclasses.replace(sign, recipes=[], claims=["48-other", "48-sign"], tests=["tests/test_nope.py"])
    monkeypatch.setattr(check, "papers", lambda: [wrong if m is sign else m for m in papers()])
    folder = PAPERS / "48_sign_advantage"
    assert check.recipe_and_claim_problems() == [
        f"{sign.path}: recipes = [] but {folder}/recipes holds ['sign']",
        f"{sign.path}: claims = ['48-other', '48-sign'] but {folder}/claims holds ['48-sign']",
        f"{sign.path}: test 'tests/test_nope.py' does not exist",
    ]


def test_no_stage_or_core_module_imports_a_paper_folder():
    stage_file, paper_file = PACKAGE / "rollout" / "mine.py", PACKAGE / "papers" / "27_alphagrpo" / "mine.py"
    bad = (
        "import importlib\nfrom groupwise.papers import find\n"
        'TASK = importlib.import_module("groupwise.papers.40_dgpo.fobar")\n'
    )
    assert check.import_problems([(stage_file, bad)]) == [
        "rollout/mine.py imports groupwise.papers.40_dgpo.fobar: a stage or core module never imports a paper folder; "
        "move the shared part out of the paper folder"
    ]
    assert check.import_problems([(paper_file, bad)]) == [
        "papers/27_alphagrpo/mine.py imports groupwise.papers.40_dgpo.fobar: a paper folder imports no other paper's; "
        "move the shared part into its stage folder"
    ]
    # its own folder, relatively or by name, and the papers package itself are fine
    own = (
        "import importlib\nfrom . import yes_no\nfrom .yes_no import rows\n"
        'importlib.import_module("groupwise.papers.27_alphagrpo.yes_no")\n'
    )
    assert check.import_problems([(paper_file, own)]) == []


def test_a_paper_folders_task_recipe_and_claim_are_found_by_their_old_names(monkeypatch):
    from groupwise.claims.claimfile import find_claims, load_claim
    from groupwise.config import load_config, resolve_recipe
    from groupwise.tasks import get_task

    assert get_task("number_attrs").rows.__module__ == "groupwise.papers.27_alphagrpo.number_attrs"
    assert resolve_recipe("alphagrpo_flow") == PAPERS / "27_alphagrpo" / "recipes" / "alphagrpo_flow.toml"
    assert resolve_recipe("demo") == PACKAGE / "recipes" / "demo.toml"
    assert load_config("alphagrpo_flow")[0].data.task == "flow_attrs"
    monkeypatch.chdir(ROOT)  # `groupwise claims` reads the repository's claims/ from where it runs
    assert find_claims(["27-alphagrpo-flow", "17-bf16-demo"]) == [
        PAPERS / "27_alphagrpo" / "claims" / "27-alphagrpo-flow.toml",
        Path("claims/17-bf16-demo.toml"),
    ]
    assert find_claims(["48"]) == [PAPERS / "48_sign_advantage" / "claims" / "48-sign.toml"]
    assert load_claim(find_claims(["48-sign"])[0], check_configs=False).slug == "48-sign"
    with pytest.raises(ConfigError, match="several claim files named '17'"):  # 17-bf16-demo (issue 17) and 17-vspo
        find_claims(["17"])


def test_a_name_defined_twice_is_an_error_naming_both_files(tmp_path, monkeypatch):
    import groupwise.papers as papers_module
    from groupwise.config import resolve_recipe, shipped_recipes

    for folder in ("01_a", "02_b"):
        (tmp_path / folder / "recipes").mkdir(parents=True)
        (tmp_path / folder / "recipes" / "same.toml").write_text('name = "same"\n')
    monkeypatch.setattr(papers_module, "folders", lambda: [tmp_path / "01_a", tmp_path / "02_b"])
    twice = rf"recipe 'same' is defined twice: {tmp_path}/01_a/recipes/same.toml and {tmp_path}/02_b/recipes/same.toml"
    with pytest.raises(ConfigError, match=twice):
        shipped_recipes()
    recipes_b = tmp_path / "02_b" / "recipes"
    (recipes_b / "same.toml").rename(recipes_b / "demo.toml")  # a paper may not shadow recipes/ either
    with pytest.raises(ConfigError, match=r"recipe 'demo' is defined twice: .*/recipes/demo.toml and .*02_b/recipes/"):
        resolve_recipe("same")


def test_old_recipe_and_claim_names_work_on_the_command_line(tmp_path, capsys, monkeypatch):
    assert cli.main(["cp", "alphagrpo_flow", str(tmp_path)]) == 0
    shipped = PAPERS / "27_alphagrpo" / "recipes" / "alphagrpo_flow.toml"
    assert (tmp_path / "alphagrpo_flow.toml").read_text() == shipped.read_text()
    assert cli.main(["explain", "alphagrpo_flow"]) == 0
    assert capsys.readouterr().out.count("== recipe · alphagrpo_flow") == 1
    assert cli.main(["train", "--help"]) == 0 and "alphagrpo_flow" in capsys.readouterr().out
    monkeypatch.chdir(ROOT)
    docs = tmp_path / "claims.md"
    assert cli.main(["claims", "--docs-only", "--docs", str(docs)]) == 0
    text = docs.read_text()
    assert "File `papers/27_alphagrpo/claims/27-alphagrpo-flow.toml`" in text
    assert "File `claims/17-bf16-demo.toml`" in text


def test_paper_command_lists_every_file_component_recipe_claim_and_test(capsys):
    for m in papers():
        assert cli.main(["paper", str(m.spec)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"{'/'.join(f'{n:02d}' for n in m.numbers)} · {m.title}\n"), m.name
        lines = [line.strip() for line in out.splitlines()]
        for stage, name in m.owned():
            assert any(line.startswith(f"{stage} · {name} — ") for line in lines), (m.name, stage, name)
        folder_files = [p for p in m.path.parent.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        for path in folder_files:
            assert f"groupwise/papers/{m.name}/{path.relative_to(m.path.parent)}" in lines, (m.name, path)
        for entry in [*(f"groupwise/{f}" for f in m.files), *m.tests, *(f"groupwise/{d}" for d in m.data)]:
            assert entry in lines, (m.name, entry)
        for name in m.recipes:
            assert f"{name}  [groupwise/papers/{m.name}/recipes/{name}.toml]" in lines
        for name in m.claims:
            assert f"{name}  [groupwise/papers/{m.name}/claims/{name}.toml]" in lines
    assert cli.main(["paper", "27"]) == 0
    out = capsys.readouterr().out
    assert "arXiv      2605.12495 (https://arxiv.org/abs/2605.12495)" in out
    assert "spec       specs/27-alphagrpo.md" in out
    assert "  task · yes_no — yes/no questions about a number" in out
    assert "[groupwise/papers/27_alphagrpo/yes_no.py]" in out
    assert "  reward · dv_reward — " in out and "[groupwise/rewards/dvreward.py]" in out
    assert cli.main(["explain", "27"]) == 0 and capsys.readouterr().out == out  # a bare number is the paper
    assert cli.main(["paper", "43"]) == 0 and capsys.readouterr().out.startswith("36/43 · FG-ExPO / EXPO")
    # ConSPO owns the per-prompt mean aggregation; LPO uses it
    assert cli.main(["paper", "57"]) == 0 and "  aggregation · group_mean — " in capsys.readouterr().out
    assert cli.main(["paper", "99"]) == 2 and "no paper with spec number '99'" in capsys.readouterr().err


def test_variants_page_is_generated_and_current():
    """docs/variants.md is `python -m groupwise.papers.index > docs/variants.md`: one row per paper."""
    from groupwise.papers.index import index_markdown

    text = index_markdown()
    regenerate = "regenerate: python -m groupwise.papers.index > docs/variants.md"
    assert (ROOT / "docs" / "variants.md").read_text() == text, regenerate
    rows = [line for line in text.splitlines() if line.startswith("| ") and "](../src/groupwise/papers/" in line]
    # 45 before issue 37, + 19, 26, 23, 37, + 54, 22, 47, 12, 11, 10 (issue 41), + 21, 28, 45, 52 (issue 42)
    assert len(rows) == 59
    assert (
        "| 48 | [Sign advantage — A = 2r − 1 against gradient starvation in binary-reward GRPO]"
        "(../src/groupwise/papers/48_sign_advantage/README.md) | advantage | advantage `sign` | "
        "`advantages/sign.py` | `sign` | `48-sign` |"
    ) in rows
    assert rows[[r.startswith("| 36/43 ") for r in rows].index(True)].endswith("| `fg_expo` | `36-fg-expo` |")


def test_package_data_ships_every_paper_file():
    """A non-editable install finds the manifests, pages, recipes and claims: every non-Python file
    under papers/ matches a package-data glob of pyproject.toml."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["groupwise"]
    shipped = {p for pattern in globs for p in PACKAGE.glob(pattern)}
    data = [p for p in PAPERS.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert len(data) > 150 and [p for p in data if p not in shipped] == []
    assert all((f / "paper.toml") in shipped for f in folders())
