"""Your own components without forking (``groupwise.plugins``, docs/extending.md).

The examples of ``examples/extending/`` are copied to a folder outside the package and trained from
there with what the ``groupwise`` console script runs (the working directory is NOT on ``sys.path``,
as for the installed command); each run is checked against values worked out by hand from what the
run logged (every row of every step is in ``samples.jsonl``: row ``i`` of a step is group
``i % B``, sample ``i // B``). Then the same plug-ins resume bit for bit after SIGKILLs, run under
torchrun on two ranks, and run as ``groupwise compare`` children. In-process tests check the name
resolution, its errors, and ``groupwise list`` / ``explain``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import groupwise
from groupwise import plugins, registry
from groupwise.errors import ConfigError
from groupwise.registry import build_spec, lookup

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "extending"
SRC = Path(groupwise.__file__).resolve().parents[1]  # the groupwise under test, for the children
MODEL = os.environ.get("GROUPWISE_TEST_MODEL", "default")
LAUNCHER = "import sys\nfrom groupwise.cli import main\nsys.exit(main())\n"  # the console script's body
TERM = 'objective.terms=[{name="my_term:ClippedAdvantagePPO", adv_clip=0.5}]'
B, G = 4, 4
TINY = [
    f"rollout.prompts_per_step={B}",
    f"rollout.group_size={G}",
    "eval.size=0",
    "threads=1",
    "log.samples=16",
    "log.samples_every=1",
    "log.table_every=0",
    f'model.path="{MODEL}"',
]


# ---------------------------------------------------------------------------------------------- helpers
def user_folder(tmp_path: Path) -> tuple[Path, Path]:
    """(the examples copied to a folder of the user's, a `groupwise` launcher in another folder)."""
    folder = tmp_path / "my_project"
    shutil.copytree(EXAMPLES, folder)
    launcher = tmp_path / "bin" / "groupwise_cli.py"
    launcher.parent.mkdir()
    launcher.write_text(LAUNCHER)
    return folder, launcher


def child_env() -> dict:
    """The children import this groupwise (an absolute path: they run in another folder), nothing of the user's."""
    return {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def train(
    folder: Path, launcher: Path, *args: str, python: tuple[str, ...] = (sys.executable,), out: str = "run"
) -> Path:
    """``groupwise train ARGS`` run from ``folder`` (``python``: the interpreter, or torchrun's command)."""
    out = folder / "runs" / out
    result = subprocess.run(
        [*python, str(launcher), "train", *args, f"out={out}"],
        cwd=folder,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def groups(out: Path, step: int) -> list[list[dict]]:
    """The logged rows of ``step`` as [B][G] (``logging.sample_rows``: sample g of every group, then g + 1)."""
    rows = [r for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines()) if r["step"] == step]
    assert len(rows) == B * G, f"step {step}: {len(rows)} logged rows, want every one of {B * G}"
    return [[rows[g * B + b] for g in range(G)] for b in range(B)]


def running_std_advantages(
    rewards_by_step: list[list[list[float]]], beta: float = 0.9, eps: float = 1e-6
) -> list[list[list[float]]]:
    """my_estimator.py's Math in plain Python: centred by the group mean, over an EMA of the batch's population std."""
    ema, out = None, []
    for r in rewards_by_step:
        s = statistics.pstdev([x for group in r for x in group])
        ema = s if ema is None else beta * ema + (1 - beta) * s
        out.append([[(x - sum(group) / len(group)) / (ema + eps) for x in group] for group in r])
    return out


# ---------------------------------------------------------------------------------------------- in process
@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """Run in ``tmp_path``; afterwards the registry, sys.path and sys.modules are as before (no plug-in leaks)."""
    registry.load_all()
    tables = {stage: dict(table) for stage, table in registry._REGISTRY.items()}
    path, dirs = list(sys.path), list(plugins._RECIPE_DIRS)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for stage, table in registry._REGISTRY.items():
        table.clear()
        table.update(tables[stage])
    sys.path[:] = path
    plugins._RECIPE_DIRS[:] = dirs
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


MODULE = '''
from dataclasses import dataclass
from groupwise.registry import register


@dataclass
class Scaled:
    """Minus the log-probs, scaled."""

    coef: float = 1.0
    agg: str | None = None
    scale: float = 2.0

    def __call__(self, mb, out, info):
        return -self.scale * out["logp"]


@register("advantage", "shout")
@dataclass
class Shout:
    """Rewards times ten."""

    def __call__(self, rollout, info):
        return rollout.rewards * 10


class Plain:
    def __call__(self, mb, out, info):
        return out["logp"]


@dataclass
class NoReset:
    def step(self, action):
        return "", 0.0, True
'''


def test_module_class_names_a_component_checked_as_a_builtin(user_dir):
    """``name = "module:Class"`` registers the class in the stage under that name and builds it with
    a built-in's checks (parameters by name, their types); the errors name the spec, the module and the fix."""
    (user_dir / "mine.py").write_text(MODULE)
    term = build_spec("objective", {"name": "mine:Scaled", "scale": 3.0})
    assert (type(term).__name__, term.scale, term.registry_name, term.stage) == (
        "Scaled",
        3.0,
        "mine:Scaled",
        "objective",
    )
    assert lookup("objective", "mine:Scaled") is type(term)  # registered once: the same class every time
    out = {"logp": torch.tensor([[[-0.5, -2.0]]])}  # [1,1,2]
    assert term(None, out, None).tolist() == [[[1.5, 6.0]]]  # -3 * logp
    with pytest.raises(
        ConfigError, match=r"objective 'mine:Scaled' has no parameter 'scal' \(did you mean 'scale'\?\)"
    ):
        build_spec("objective", {"name": "mine:Scaled", "scal": 1.0})
    with pytest.raises(ConfigError, match=r"parameter scale must be a number, got 'x'"):
        build_spec("objective", {"name": "mine:Scaled", "scale": "x"})
    with pytest.raises(ConfigError, match=r"module 'mine' \(.*mine.py\) has no 'Scaeld'; did you mean 'Scaled'\?"):
        build_spec("objective", "mine:Scaeld")
    with pytest.raises(ConfigError, match=r"Plain is not a dataclass; decorate it with @dataclass"):
        build_spec("objective", "mine:Plain")
    with pytest.raises(ConfigError, match=r"NoReset lacks reset, which every env component defines"):
        build_spec("env", "mine:NoReset")
    with pytest.raises(
        ConfigError,
        match=r"objective component 'absent:X': no module 'absent' on the import path; .*working directory.*"
        r"run from the folder holding absent.py, or add its folder to PYTHONPATH",
    ):
        build_spec("objective", "absent:X")
    # a class its module registered is found by the spec too, in its own stage only
    assert lookup("advantage", "mine:Shout") is lookup("advantage", "shout")
    with pytest.raises(
        ConfigError,
        match=r"Shout is registered as advantage component 'shout'; it is no component of stage 'objective'",
    ):
        build_spec("objective", "mine:Shout")


def test_plugins_key_imports_the_modules_and_refuses_a_builtins_name(user_dir):
    """``plugins = [...]`` imports each module before anything is built (its @register names then build
    like built-ins); a module that takes a built-in's name, that fails to import, or is not there is a
    ConfigError naming it."""
    from groupwise.config import Config

    (user_dir / "est.py").write_text(MODULE)
    Config(plugins=["est"])
    rollout = dataclasses.make_dataclass("R", [("rewards", torch.Tensor)])(torch.tensor([[1.0, 0.0]]))
    assert build_spec("advantage", "shout")(rollout, None).tolist() == [[10.0, 0.0]]
    (user_dir / "clash.py").write_text(MODULE.replace('"shout"', '"grpo"').replace("Shout", "MyGRPO"))
    with pytest.raises(
        ConfigError,
        match=r"plugins\[0\]: importing 'clash': clash.MyGRPO takes the name 'grpo' of the built-in advantage "
        r"component \(groupwise.advantages.grpo\); register it under another name",
    ):
        Config(plugins=["clash"])
    (user_dir / "broken.py").write_text("import not_a_module_anywhere\n")
    with pytest.raises(
        ConfigError,
        match=r"plugins\[1\]: importing 'broken' failed: ModuleNotFoundError: .*not_a_module_anywhere.*broken.py:1",
    ):
        Config(plugins=["est", "broken"])
    with pytest.raises(ConfigError, match=r"plugins\[0\]: 'est.py' is a file name; name its module instead: 'est'"):
        Config(plugins=["est.py"])


def test_a_recipe_files_folder_is_searched_for_its_plugins(user_dir):
    """Run from elsewhere, a recipe file's plug-ins are found in the recipe's folder (and not before the
    recipe is loaded: the folder is not on sys.path by itself)."""
    from groupwise.config import load_config

    shutil.copytree(EXAMPLES, user_dir / "project")
    (user_dir / "elsewhere").mkdir()
    os.chdir(user_dir / "elsewhere")
    with pytest.raises(ConfigError, match=r"no module 'my_estimator' on the import path"):
        load_config(None, ['plugins=["my_estimator"]'])
    cfg, _ = load_config(str(user_dir / "project" / "estimator.toml"), [TERM])
    assert sys.modules["my_estimator"].__file__ == str(user_dir / "project" / "my_estimator.py")
    # a module:Class from there too
    assert type(build_spec("objective", cfg.objective.terms[0])).__module__ == "my_term"


def test_every_builtin_meets_what_a_plugin_must():
    """What ``plugins.required`` asks of a plug-in every built-in of the stage has: a plug-in is asked
    for no more than a built-in keeps; a class lacking a member is refused naming it."""
    for stage, name, cls in registry.entries():
        plugins.check_component(stage, cls, f"{stage} {name}")
    assert {stage: plugins.required(stage) for stage in registry.STAGES}["sampling"] == [
        ("bind", "draw", "keep", "state_dict", "load_state_dict")
    ]

    @dataclasses.dataclass
    class NoKeep:
        def bind(self, n_rows, seed): ...
        def draw(self, n, info): ...

    with pytest.raises(ConfigError, match="lacks keep, state_dict, load_state_dict, which every sampling"):
        plugins.check_component("sampling", NoKeep, "here")

    @dataclasses.dataclass
    class NotCallable:  # every class is callable; a term must define __call__ itself
        coef: float = 1.0

    with pytest.raises(ConfigError, match="lacks __call__, which every objective"):
        plugins.check_component("objective", NotCallable, "here")
    assert "objective" not in plugins.stages_fitting(NotCallable)


def test_list_and_explain_show_plugins(user_dir, capsys):
    """``groupwise list --plugins M``, ``explain module:Class`` and ``explain RECIPE.toml`` show the user's own."""
    from groupwise.cli import main

    for name in os.listdir(EXAMPLES):
        shutil.copy(EXAMPLES / name, user_dir / name)
    assert main(["list", "advantage", "--plugins", "my_estimator"]) == 0
    assert re.search(
        r"advantage │ running_std +│ Group-mean baseline divided by a running \(EMA\) std .*"
        r"\(plug-in: my_estimator\)",
        capsys.readouterr().out,
    )
    assert main(["explain", "my_term:ClippedAdvantagePPO"]) == 0
    text = capsys.readouterr().out
    assert "== plug-in · my_term:ClippedAdvantagePPO  (my_term.ClippedAdvantagePPO)" in text
    assert "adv_clip = 1.0" in text and "**Math**" in text
    assert re.search(r"not registered: name it as 'my_term:ClippedAdvantagePPO' .*\(.*objective.*\)", text)
    assert main(["explain", "estimator.toml"]) == 0
    text = capsys.readouterr().out
    assert f"plug-in modules: my_estimator ({user_dir / 'my_estimator.py'})" in text
    assert re.search(r"advantage · running_std  \[advantage.estimator\]  Group-mean .*\(plug-in: my_estimator\)", text)


def test_docs_show_the_example_files_as_they_are():
    """docs/extending.md shows every example file verbatim (a block after ``<!-- file: PATH -->``), each one."""
    doc = (ROOT / "docs" / "extending.md").read_text()
    shown = dict(re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```\n", doc, re.DOTALL))
    assert sorted(shown) == sorted(
        f"examples/extending/{p.name}" for p in EXAMPLES.iterdir() if p.suffix in (".py", ".toml")
    )
    for path, text in shown.items():
        assert text == (ROOT / path).read_text(), f"docs/extending.md shows an old {path}"


# ------------------------------------------------------------------------------------ trained from the user's folder
def test_plugin_estimator_and_term_train_from_a_folder_outside_the_package(tmp_path):
    """The estimator (via ``plugins``) and the term (via ``module:Class``) train from the user's folder
    with the console script (working directory not on sys.path). Every step's advantages are
    my_estimator.py's Math on that step's rewards (the running std carried across steps), and each
    step's loss is the term's on-policy value: ratio = 1, so per token −clip(A, ±0.5), and with the
    sequence-mean-token-mean the loss is −mean over rows of clip(A, ±0.5); its logged statistic is the
    share of rows with |A| > 0.5."""
    folder, launcher = user_folder(tmp_path)
    out = train(folder, launcher, "estimator.toml", TERM, "train.steps=3", *TINY)
    rows = metrics(out)
    steps = [groups(out, k) for k in range(3)]
    want = running_std_advantages([[[r["reward"] for r in group] for group in step] for step in steps])
    clipped = 0
    for k, (step, adv) in enumerate(zip(steps, want)):
        logged = [r["advantage"] for group in step for r in group]
        flat = [a for group in adv for a in group]
        assert logged == pytest.approx(flat, abs=1e-6), f"step {k}"
        loss = -sum(max(-0.5, min(0.5, a)) for a in logged) / len(logged)
        assert rows[k]["loss"] == pytest.approx(loss, abs=1e-6), f"step {k}"
        assert rows[k]["adv_clip/clipped_frac"] == sum(abs(a) > 0.5 for a in logged) / len(logged)
        clipped += rows[k]["adv_clip/clipped_frac"] > 0
    assert clipped, "no step clipped an advantage: the check of the clip means nothing"
    config = (out / "config.toml").read_text()
    assert 'plugins = ["my_estimator"]' in config and 'name = "my_term:ClippedAdvantagePPO"' in config


def test_docs_table_of_required_methods_is_the_codes():
    """docs/extending.md's table of what each stage requires is ``plugins.required``."""
    doc = (ROOT / "docs" / "extending.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| (.*) \|$", doc, re.MULTILINE))
    want = {
        stage: " or ".join(", ".join(f"`{m}`" for m in form) for form in plugins.required(stage)) or "none"
        for stage in registry.STAGES
    }
    assert rows == want


# ---------------------------------------------------------------------------------------------- every example (slow)
def check_weight(out: Path) -> None:
    """position_decay (gamma 0.8) under PPO's clip, on-policy: a row of L tokens adds −A · Σ_{t<L} 0.8^t / L
    to the sequence-mean-token-mean loss; L from the completion's tokens (+ the end of text when it
    stopped before max_new_tokens = 6), which must average to the logged completion_len."""
    from transformers import AutoTokenizer

    import groupwise.models

    tokenizer = AutoTokenizer.from_pretrained(
        Path(groupwise.models.__file__).parent / "default" if MODEL == "default" else MODEL
    )
    for k, row in enumerate(metrics(out)):
        lengths, adv = [], []
        for r in (r for group in groups(out, k) for r in group):
            ids = tokenizer(r["completion"], add_special_tokens=False)["input_ids"]
            lengths.append(len(ids) + (len(ids) < 6))
            adv.append(r["advantage"])
        assert sum(lengths) / len(lengths) == pytest.approx(row["completion_len"], abs=1e-9), f"step {k}: token counts"
        decay = [sum(0.8**t for t in range(n)) for n in lengths]
        assert row["position_decay/mean"] == pytest.approx(sum(decay) / sum(lengths), abs=1e-6)
        assert row["loss"] == pytest.approx(
            sum(-a * d / n for a, d, n in zip(adv, decay, lengths)) / len(adv), abs=1e-6
        ), f"step {k}"
        assert any(abs(a) > 0 for a in adv) or k, "step 0 has no advantage: the loss check means nothing"


def check_strategy(out: Path) -> None:
    """Annealed from 0.001 to 1.0 over 2 steps: at step 0 every group's samples are the same text
    (temperature ~0), at step 1 (temperature 1) some group's differ."""
    assert [r["anneal/temperature"] for r in metrics(out)] == pytest.approx([0.001, 1.0])
    assert all(len({r["completion"] for r in group}) == 1 for group in groups(out, 0))
    assert any(len({r["completion"] for r in group}) > 1 for group in groups(out, 1))


def check_estimator(out: Path) -> None:
    rows = [groups(out, k) for k in range(len(metrics(out)))]
    want = running_std_advantages([[[r["reward"] for r in group] for group in step] for step in rows])
    for k, (step, adv) in enumerate(zip(rows, want)):
        assert [r["advantage"] for group in step for r in group] == pytest.approx(
            [a for group in adv for a in group], abs=1e-6
        ), f"step {k}"


def check_term(out: Path) -> None:
    """term.toml's clip 1.0 on GRPO's advantages, on-policy: loss = −mean over rows of clip(A, ±1)."""
    for k, row in enumerate(metrics(out)):
        adv = [r["advantage"] for group in groups(out, k) for r in group]
        assert row["loss"] == pytest.approx(-sum(max(-1.0, min(1.0, a)) for a in adv) / len(adv), abs=1e-6)
        assert row["adv_clip/clipped_frac"] == sum(abs(a) > 1.0 for a in adv) / len(adv)


def check_guess(out: Path) -> None:
    """Every transcript follows the game: in each group one secret is consistent with every answer of
    every episode (higher: secret > guess, lower: secret < guess, invalid: not a number in 1..16); a won
    episode (reward 1) ends on that secret, a lost one played all 6 turns; env/won is the mean reward."""
    played = 0
    for k, row in enumerate(metrics(out)):
        assert row["env/won"] == pytest.approx(row["reward_mean"])
        for group in groups(out, k):
            secrets = set(range(1, 17))
            for r in group:
                parts = re.split(r" (higher|lower|invalid)=", r["completion"])
                guesses, answers = parts[0::2], parts[1::2]
                for guess, answer in zip(guesses, answers):
                    text = guess.strip()
                    valid = text.isdigit() and 1 <= int(text) <= 16
                    assert valid == (answer != "invalid"), r["completion"]
                    secrets &= {
                        s
                        for s in secrets
                        if answer == "invalid" or (s > int(text) if answer == "higher" else s < int(text))
                    }
                    played += answer != "invalid"
                last = guesses[-1].strip()
                if r["reward"] == 1.0:
                    secrets &= {int(last)}
                else:
                    assert r["reward"] == 0.0 and len(guesses) == 6, r["completion"]
                    secrets -= {int(last)} if last.isdigit() else set()
            assert secrets, f"step {k}: no secret fits the group's transcripts {[r['completion'] for r in group]}"
    assert played, "no valid guess was answered: the game's rules went unchecked"
    # held-out: the 16 secrets played closed-loop (eval.closed_loop = "auto": on for an env strategy). A guess
    # episode returns 1 (won) or 0, so the share won equals the mean return, greedy and sampled alike.
    summary = json.loads((out / "summary.json").read_text())
    for when in ("before", "after"):
        won, sampled = summary[f"accuracy_{when}"], summary[f"accuracy_{when}_sampled"]
        assert won * 16 == round(won * 16) and summary[f"return_{when}"] == won
        assert sampled["mean@2"] * 32 == round(sampled["mean@2"] * 32) and sampled["return@2"] == sampled["mean@2"]


EXAMPLE_RUNS = {  # recipe, overrides, the check of what it logged
    "estimator": ("estimator.toml", ["train.steps=3"], check_estimator),
    "term": ("term.toml", ["train.steps=2"], check_term),
    "weight": ("weight.toml", ["train.steps=2"], check_weight),
    "strategy": ("strategy.toml", ["train.steps=2", "rollout.params={start=0.001, end=1.0}"], check_strategy),
    "environment": ("guess.toml", ["train.steps=2", "eval.size=16", "eval.samples=2"], check_guess),
}


@pytest.mark.slow
@pytest.mark.parametrize("example", sorted(EXAMPLE_RUNS))
def test_every_example_trains_from_a_folder_outside_the_package(tmp_path, example):
    """Each example of docs/extending.md, run as the page says from a copy of its folder, trained its
    component: the values it logged are the ones its Math gives on what the run sampled."""
    recipe, overrides, check = EXAMPLE_RUNS[example]
    folder, launcher = user_folder(tmp_path)
    check(train(folder, launcher, recipe, *TINY, *overrides))


# ------------------------------------------------------------------------------------ resume, ranks, compare (slow)
@pytest.mark.slow
def test_plugin_run_resumes_bit_for_bit_after_sigkills(tmp_path):
    """SIGKILLs at seeded random moments, each time the same command rerun: the final weights (sha256)
    and the summary's held-out accuracies equal the uninterrupted run's (the plug-in estimator's running
    std is checkpointed under its registry name and restored)."""
    from test_resume import kill_at_random_moment

    folder, launcher = user_folder(tmp_path)
    args = [
        "train",
        "estimator.toml",
        TERM,
        "train.steps=16",
        "checkpoint.every=1",
        "eval.size=20",
        "rollout.prompts_per_step=8",
        "rollout.group_size=4",
        "threads=1",
        "log.table_every=0",
        f'model.path="{MODEL}"',
    ]

    def launch(out: Path) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, str(launcher), *args, f"out={out}"],
            cwd=folder,
            env=child_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def result(out: Path) -> tuple:
        summary = json.loads((out / "summary.json").read_text())
        return (
            hashlib.sha256((out / "final" / "model.safetensors").read_bytes()).hexdigest(),
            summary["accuracy_before"],
            summary["accuracy_after"],
        )

    straight, killed = folder / "straight", folder / "killed"
    t0 = time.monotonic()
    proc = launch(straight)
    while proc.poll() is None and not (
        (straight / "metrics.jsonl").exists() and (straight / "metrics.jsonl").read_text()
    ):
        time.sleep(0.02)
    first = time.monotonic() - t0
    assert proc.wait(timeout=600) == 0, proc.stderr.read().decode()[-2000:]
    timing = {"first_step": first, "training": time.monotonic() - t0 - first}
    rng, kills = random.Random(20261234), 0
    while True:
        proc = launch(killed)
        if kills < 6 and kill_at_random_moment(proc, killed, rng, timing):
            kills += 1
            continue
        assert proc.wait(timeout=600) == 0, proc.stderr.read().decode()[-2000:]
        if (killed / "final" / "model.safetensors").exists():
            break
    print(f"{kills} SIGKILLs survived")
    assert kills >= 3, "the kills must land before the run ends"
    from groupwise import checkpoint

    state = checkpoint.load(checkpoint.latest_intact(killed))
    # the plug-in's state went through the checkpoint
    assert isinstance(state["components"]["advantage.running_std"]["ema"], float)
    assert result(killed) == result(straight)


@pytest.mark.dist
@pytest.mark.slow
def test_plugin_run_on_two_ranks_equals_one_process(tmp_path):
    """torchrun --nproc_per_node 2 (gloo, CPU): every rank imports the plug-ins from the working
    directory; two steps of SGD (lr 1) give the loss, gradient norm, the term's statistic, the
    estimator's advantages and the final weights of one process over the same global batch."""
    from safetensors.torch import load_file

    folder, launcher = user_folder(tmp_path)
    args = ["estimator.toml", TERM, "train.steps=2", *TINY, 'update={name="sgd", lr=1.0}']
    one = train(folder, launcher, *args, out="one")
    two = train(
        folder,
        launcher,
        *args,
        out="two",
        python=(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"),
    )
    for a, b in zip(metrics(one), metrics(two), strict=True):
        for key in ("loss", "grad_norm", "adv_clip/clipped_frac", "reward_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
    for k in range(2):
        assert [r["advantage"] for g in groups(two, k) for r in g] == pytest.approx(
            [r["advantage"] for g in groups(one, k) for r in g], abs=1e-6
        )
    single, ranks = load_file(one / "final" / "model.safetensors"), load_file(two / "final" / "model.safetensors")
    for name, weight in single.items():
        torch.testing.assert_close(ranks[name], weight, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_compare_children_train_the_plugins(tmp_path):
    """``groupwise compare`` checks the configs in its own process and trains each in a child: both
    find the plug-ins of the user's folder."""
    folder, launcher = user_folder(tmp_path)
    result = subprocess.run(
        [
            sys.executable,
            str(launcher),
            "compare",
            "mine=estimator.toml",
            "--seeds",
            "1",
            "--out",
            "cmp",
            TERM,
            "train.steps=1",
            *TINY,
        ],
        cwd=folder,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads((folder / "cmp" / "compare.json").read_text())["configs"][0]["runs"]
    assert [r["status"] for r in runs] == ["ok"]
    assert "adv_clip/clipped_frac" in metrics(folder / "cmp" / "mine" / "seed0")[0]
