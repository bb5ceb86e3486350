"""Paper 28, the sparse-to-dense bridge: the `nano` student, the phase `fkl_warmup`, the term `opd` and
the shaper `opd_token` (spec 28's hand numbers), and the bridge recipe as one run."""

from __future__ import annotations

import hashlib
import json
import math

import torch

from groupwise.models.build import PRESETS, build_model, count_parameters
from groupwise.policy.lm import DEFAULT_MODEL, resolve_model_path

STUDENT_SHA256 = "cb44c10ca51144b81723a39bd926395292ec5124976fb2c783384b48b6d9fb02"


# ---------------------------------------------------------------------------------------------- the nano student
def test_nano_preset_is_the_shipped_student_with_the_default_tokenizer():
    """hidden 64, 2 layers; 119,104 parameters with the 319-token vocabulary: embedding 319·64 = 20,416,
    per layer q 64·64 + k 64·32 + v 64·32 + o 64·64 = 12,288, MLP 3·64·192 = 36,864, norms 64·2 + q/k norms
    16·2 = 160 → 49,312 per layer, two layers 98,624, final norm 64: 20,416 + 98,624 + 64 = 119,104."""
    assert PRESETS["nano"]["hidden_size"] == 64 and PRESETS["nano"]["num_hidden_layers"] == 2
    assert count_parameters(build_model(319, "nano")) == 119_104
    path = resolve_model_path("student")
    assert path == str(DEFAULT_MODEL.parent / "student")
    weights = DEFAULT_MODEL.parent / "student" / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == STUDENT_SHA256
    record = json.loads((DEFAULT_MODEL.parent / "student" / "warmstart.json").read_text())
    assert record["preset"] == "nano" and record["parameters"] == 119_104
    same = [json.loads((DEFAULT_MODEL.parent / name / "tokenizer.json").read_text()) for name in ("student", "default")]
    assert same[0]["model"]["vocab"] == same[1]["model"]["vocab"]


def test_the_shipped_student_scores_its_recorded_accuracy():
    """Greedy accuracy on the first 100 test prompts is the record's (12 %): the folder is the warm start's output."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from groupwise.models.warmstart import greedy_accuracy, load_rows

    path = resolve_model_path("student")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    record = json.loads((DEFAULT_MODEL.parent / "student" / "warmstart.json").read_text())
    rows = load_rows(["arithmetic"], "test", 500, 0)[:100]
    assert math.isclose(greedy_accuracy(model, tokenizer, rows, 5), record["test_greedy_accuracy_first_100"])
    assert record["test_greedy_accuracy_first_100"] == 0.12
