"""`import groupwise` exposes train / load_config / Run / Trainer; the documented example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "python-api.md"


def test_the_documented_example_runs(tmp_path):
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("3 ") and lines[1] == "torch.Size([4, 4]) torch.Size([4, 4])"
    assert '"reward_mean"' in lines[2]


def test_importing_the_package_stays_light():
    probe = "import sys, groupwise; assert callable(groupwise.train); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_a_run_is_built_parts_a_trainer_and_a_run_around_it(tmp_path):
    """``Run.from_config(cfg)`` is ``build(cfg)`` → ``Trainer(parts)`` → ``Run(trainer)``: the run holds the
    trainer and its held-out evaluation, the trainer holds the parts; a Config given to Trainer names the fix."""
    import pytest

    import groupwise
    from groupwise.build import Parts, build

    cfg = groupwise.load_config("demo", ["eval.size=0", "threads=1", f"out={tmp_path}"])
    run = groupwise.Run.from_config(cfg)
    assert isinstance(run.trainer, groupwise.Trainer) and isinstance(run.trainer.parts, Parts)
    assert run.heldout.trainer is run.trainer and run.parts is run.trainer.parts
    assert run.trainer.policy is run.parts.policy
    assert not hasattr(run.trainer, "model") and not hasattr(run.trainer, "tokenizer")  # policy.module, .tokenizer
    fix = r"Trainer takes the Parts that build\(cfg\) returns \(from groupwise.build import build\), not a Config: "
    with pytest.raises(TypeError, match=fix + r"Trainer\(build\(cfg\)\) for the step alone"):
        groupwise.Trainer(cfg)
    assert groupwise.Trainer(build(cfg)).step == 0
