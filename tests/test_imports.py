"""Light imports: the CLI pulls in heavy libraries only when a command uses them."""

import importlib.util
import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
import groupwise.cli as cli
after_import = sorted(m for m in {heavy} if m in sys.modules)
{command}
print(json.dumps({{"after_import": after_import, "after_command": sorted(m for m in {heavy} if m in sys.modules)}}))
"""
HEAVY = ["torch", "transformers", "trl", "datasets", "accelerate", "peft", "math_verify", "matplotlib"]


def probe(command: str, tmp_path) -> dict:
    code = PROBE.format(heavy=HEAVY, command=command)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_cli_imports_nothing_heavy(tmp_path):
    seen = probe("", tmp_path)
    assert seen["after_import"] == []


def test_list_needs_torch_only(tmp_path):
    seen = probe(
        "import contextlib, io\nwith contextlib.redirect_stdout(io.StringIO()):\n    cli.main(['list'])", tmp_path
    )
    assert seen["after_command"] == ["torch"]


@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("trl", "datasets")),
    reason="trl and datasets are not installed: nothing to keep out",
)
def test_training_does_not_import_trl_or_datasets(tmp_path):
    command = (
        "import contextlib, io\nwith contextlib.redirect_stdout(io.StringIO()), "
        "contextlib.redirect_stderr(io.StringIO()):\n    cli.main(['train', 'rollout.prompts_per_step=2', "
        "'rollout.group_size=2', 'train.steps=1', 'eval.size=0', 'threads=1', 'out=run'])"
    )
    seen = probe(command, tmp_path)
    assert "transformers" in seen["after_command"]  # it did train
    # accelerate is imported by transformers itself whenever it is installed; groupwise never imports it
    assert not {"trl", "datasets"} & set(seen["after_command"])
