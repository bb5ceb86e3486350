"""``model.device`` on any machine: what is accepted, what is refused and how (issue 18). The
CUDA behaviour itself is tests/test_gpu.py (``make test-gpu``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_trainer import make_trainer

from groupwise.errors import ConfigError
from groupwise.policy.lm import resolve_device
from groupwise.roles import _on_policy_device


def test_cpu_and_auto_resolve_without_a_gpu():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu_is_an_error_naming_the_key(name):
    with pytest.raises(ConfigError, match=r"model\.device.*no CUDA device.*\"cpu\""):
        resolve_device(name)


def test_an_unknown_device_lists_the_allowed_ones():
    with pytest.raises(ConfigError, match="model.device: 'tpu'; allowed: cpu, cuda, cuda:N, auto"):
        resolve_device("tpu")


def test_the_policy_lives_on_its_device_and_returns_host_tensors(tmp_path):
    trainer = make_trainer(tmp_path, 'model.device="auto"', "train.steps=1", "eval.size=0")
    assert trainer.policy.device == next(trainer.policy.module.parameters()).device
    batch = trainer.collect()
    assert trainer.policy.forward(batch, ["logp"])["logp"].device.type == "cpu"  # the loss maths runs on the host


def test_the_flow_toy_refuses_a_gpu(tmp_path):
    from groupwise.build import build
    from groupwise.config import load_config
    from groupwise.trainer import Trainer

    cfg, _ = load_config("flash_grpo", [f'out="{tmp_path}"', 'model.device="cuda"'])
    with pytest.raises(ConfigError, match="flow toy runs on the CPU"):
        Trainer(build(cfg))


def test_a_role_follows_the_policys_device_unless_it_names_a_gpu():
    main = SimpleNamespace(device="cuda:0")
    from groupwise.config import ModelCfg

    assert _on_policy_device(ModelCfg(), main).device == "cuda:0"
    assert _on_policy_device(ModelCfg(device="cuda:1"), main).device == "cuda:1"
