"""Every registered objective term and updater under FSDP2 (issue 38): two SGD steps (AdamW, GXPO: their
own) over 2 gloo ranks with ``dist.shard="fsdp2"`` equal one unsharded process over the same global batch
(loss and gradient norm per step, every final weight: atol 1e-6, rtol 1e-5), or the build refuses the
combination, naming the component and ``dist.shard``. One configuration also reads the layer-hook
quantities (``hidden(l)``, ``hidden_at(l)``, ``attn_at(l)``) through the policy's forward on the shards,
and the frozen reference's ``hidden(l)`` (GCPO's embedding). The driver is tests/fsdp_all_driver.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import groupwise.models
from groupwise.registry import entries

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # two launches of 33 configurations: about a minute alone

DRIVER = Path(__file__).with_name("fsdp_all_driver.py")
REFUSED = {"update:gxpo"}  # flattens every parameter whole (whole_parameters): a DTensor shard cannot be


def _run(cmd, out):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(DRIVER.parent), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run([*cmd, str(DRIVER), str(out)], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_all")
    _run([sys.executable], out)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"], out)
    return (torch.load(out / "fsdp_all_world1.pt", weights_only=False),) + (
        torch.load(out / "fsdp_all_world2.pt", weights_only=False),
    )


def test_every_objective_and_updater_is_swept(results):
    one, two = results
    assert set(one) == set(two)
    wanted = {
        f"{stage}:{name}"
        for stage, name, cls in entries()
        if stage == "objective"
        and getattr(cls, "modality", "text") == "text"  # a flow policy is refused (model.policy)
        and not getattr(cls, "artifacts", ())  # an offline phase's artifact: phases are refused
    }
    assert wanted <= set(one), sorted(wanted - set(one))
    assert {"update:sgd", "update:adamw", "update:gxpo", "needs:hooks"} <= set(one)


def test_sharded_equals_one_process_or_is_refused(results):
    one, two = results
    refused = {label for label, record in two.items() if "refused" in record}
    assert refused == REFUSED
    for label in refused:
        assert 'dist.shard="fsdp2"' in two[label]["refused"] and "gxpo" in two[label]["refused"]
        assert "refused" not in one[label] and len(one[label]["rows"]) == 2  # one process trains it
    for label in sorted(set(one) - refused):
        for step, (a, b) in enumerate(zip(one[label]["rows"], two[label]["rows"], strict=True)):
            where = f"{label} step {step}"
            assert abs(a["loss"] - b["loss"]) <= 1e-6 + 1e-5 * abs(a["loss"]), (where, a["loss"], b["loss"])
            # the norm of a sum that cancels (GRPO's terms) carries relative rounding: rtol on max(1, norm)
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 + 1e-5 * max(1.0, a["grad_norm"]), (where, a, b)
        wa, wb = one[label]["weights"], two[label]["weights"]
        assert sorted(wa) == sorted(wb), label
        for name, weight in wa.items():
            torch.testing.assert_close(wb[name], weight, atol=1e-6, rtol=1e-5, msg=f"{label} {name}")
    for quantity, value in one["needs:hooks"]["hooked"].items():
        torch.testing.assert_close(two["needs:hooks"]["hooked"][quantity], value, atol=1e-6, rtol=1e-5, msg=quantity)


def test_the_comparison_can_fail(results):
    """Guard: every compared run trained (weights moved from the embedded model's), and different terms
    give different weights, so equal weights are not an artefact of nothing happening."""
    from safetensors.torch import load_file

    one, _ = results
    start = load_file(Path(groupwise.models.__file__).parent / "default" / "model.safetensors")
    for label, record in one.items():
        if label == "needs:hooks":  # lr 0: read at the starting weights on both sides
            assert all(torch.equal(record["weights"][n], w) for n, w in start.items())
            continue
        assert any(not torch.equal(record["weights"][n], w) for n, w in start.items()), label
    differ = [
        n
        for n in start
        if not torch.allclose(one["objective:ppo_clip"]["weights"][n], one["objective:rspo"]["weights"][n])
    ]
    assert differ
    hooked = one["needs:hooks"]["hooked"]
    assert hooked["hidden(2)"].abs().sum() > 0 and hooked["attn_at(1)"].abs().sum() > 0
