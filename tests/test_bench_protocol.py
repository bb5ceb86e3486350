"""The benchmark's process plan and per-cell memory window (bench/run.py, bench/common.py).

These run no framework: they check which cells share a worker process, in which order, and that a
cell's peak RSS is measured from its own start, not from the process's.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import common  # noqa: E402
import run  # noqa: E402


def test_worker_groups_one_process_per_round_every_pair_once_small_models_first():
    cells = common.matrix()
    pairs_of = {c.name: (min(2, c.max_pairs) if c.max_pairs else 2) for c in cells}
    groups = run.worker_groups(cells, pairs_of)
    assert [pair for pair, _ in groups] == [0, 1]
    seen = Counter(c.name for _, group in groups for c in group)
    assert seen == Counter(pairs_of)  # every cell measured exactly as many times as it has pairs
    assert [c.name for c in groups[1][1]] == ["tiny-1x8-L16", "tiny-4x8-L16", "small-1x8-L16"]
    first_round = groups[0][1]
    presets = [c.preset for c in first_round]
    assert presets == sorted(presets, key=["tiny", "small", "medium"].index)  # model by model, smaller first
    for preset in ("tiny", "small"):
        sizes = [run.footprint(c) for c in first_round if c.preset == preset]
        assert sizes == sorted(sizes)  # smallest memory first within a model
    assert first_round[0].name == "tiny-1x8-L16" and first_round[-1].name == "medium-4x8-L128"


def test_footprint_orders_by_tokens_in_flight_then_extra_passes():
    base = common.Cell("tiny", 4, 8, 16)
    assert run.footprint(base) < run.footprint(common.Cell("tiny", 4, 8, 16, beta=0.04))
    assert run.footprint(common.Cell("tiny", 4, 8, 16, beta=0.04, mu=2)) < run.footprint(common.Cell("tiny", 1, 8, 128))
    assert run.footprint(common.Cell("tiny", 64, 8, 16)) == (64 * 8 * 16, 1, 8)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_peak_rss_window_restarts_at_each_cell():
    if not common.reset_peak_rss():
        pytest.skip("this kernel does not let the process reset its high-water mark")
    block = bytearray(200 * 1024 * 1024)  # 200 MB, touched: resident
    block[::4096] = b"x" * len(block[::4096])
    peak_with_block = common.peak_rss_mb()
    del block
    assert common.reset_peak_rss()
    after = common.peak_rss_mb()
    assert peak_with_block - after > 150  # the freed block no longer counts
    assert abs(after - common.rss_mb()) < 20  # the new window starts at what is resident now


TOY = {
    "hidden_size": 4,
    "head_dim": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 6,
    "num_hidden_layers": 1,
    "vocab_size": 10,
}


def test_gemm_floor_counts_the_products_one_step_needs_worked_by_hand():
    import floor

    # 1 prompt of 5 tokens, G=2, 3 tokens each, one micro-batch: prefill 5 tokens, 2 decode steps of 2
    # rows, training on 5 + 2*3 = 11 tokens with the head on the 6 completion tokens
    products = floor.step_products(common.Cell("tiny", 1, 2, 3), TOY, prompt_tokens=5)
    assert products[(5, 4, 8)] == 1  # prefill q|k|v: (2 + 2*1) heads * 2 = 8 outputs
    assert products[(1, 4, 10)] == 1  # the head on the prompt's last position
    assert products[(2, 4, 12)] == 2  # decode gate|up, once per decode step
    assert products[(2, 4, 10)] == 2  # decode head
    assert products[(11, 4, 12)] == 1  # training forward gate|up
    assert products[(11, 12, 4)] == 1 and products[(12, 11, 4)] == 1  # its input and weight gradients
    assert products[(11, 4, 4)] == 2  # o's forward [11,4]x[4,4] and its input gradient have the same shape
    assert products[(6, 4, 10)] == 1 and products[(6, 10, 4)] == 1 and products[(10, 6, 4)] == 1  # head fwd + 2 grads
    assert sum(products.values()) == 5 + 2 * 5 + 3 * 5  # prefill, decode, training forward + two grads each

    both = floor.step_products(common.Cell("tiny", 1, 2, 3, beta=0.04, mu=2), TOY, prompt_tokens=5)
    assert both[(11, 4, 12)] == 2 * 1 + 1  # two epochs of training + the reference model's forward
    assert sum(both.values()) == 5 + 2 * 5 + 2 * 3 * 5 + 5


def test_gemm_floor_sums_timed_products(monkeypatch):
    import floor

    # a machine at 1 GMAC/s
    monkeypatch.setattr(floor, "time_product", lambda m, k, n, dtype="float32": m * k * n * 1e-9)
    cell = common.Cell("tiny", 1, 2, 3)
    seconds = floor.gemm_floors([cell], {"tiny": TOY}, prompt_tokens=5, threads=1)[cell.name]
    macs = sum(m * k * n * count for (m, k, n), count in floor.step_products(cell, TOY, 5).items())
    assert seconds == pytest.approx(macs * 1e-9)
    assert macs == 5 * (8 + 4 + 12 + 6) * 4 + 4 * 10 + 2 * (2 * (8 + 4 + 12 + 6) * 4 + 2 * 4 * 10) + 3 * (
        11 * (8 + 4 + 12 + 6) * 4 + 6 * 4 * 10
    )


def test_bf16_rows_are_twins_timed_in_bf16_and_absent_with_the_reason(monkeypatch):
    import bf16
    import floor

    cells = [common.Cell("tiny", 4, 8, 16), common.Cell("tiny", 64, 8, 16), common.Cell("small", 1, 8, 16)]
    twins = bf16.bf16_cells(cells, "tiny-4x8-L16,small-1x8")
    assert [c.name for c in twins] == ["tiny-4x8-L16-bf16", "small-1x8-L16-bf16"] and {c.matmul for c in twins} == {
        "bfloat16"
    }
    assert bf16.bf16_cells(cells, "none") == [] and bf16.bf16_cells(twins, "tiny") == []  # a bf16 cell has no twin
    speed = {"float32": 1e-9, "bfloat16": 0.25e-9}  # a machine whose bf16 GEMM is 4x faster
    monkeypatch.setattr(floor, "time_product", lambda m, k, n, dtype="float32": m * k * n * speed[dtype])
    fp32, low = (
        floor.gemm_floors([c], {"tiny": TOY}, prompt_tokens=5, threads=1)[c.name] for c in (cells[0], twins[0])
    )
    assert low == pytest.approx(fp32 / 4)
    slower = {
        "on": False,
        "reason": "GEMM probe: float32 180.0 GFLOP/s, bfloat16 1.3 GFLOP/s",
        "fp32_gflops": 180.0,
        "bf16_gflops": 1.3,
    }
    assert bf16.absent_note(slower).startswith(
        "_bf16 rows absent: this CPU's bf16 GEMM is slower than fp32 (GEMM probe"
    )
    assert (
        "less than 1.3× faster" in bf16.absent_note({**slower, "bf16_gflops": 200.0})
        and bf16.absent_note({**slower, "on": True}) == ""
    )


def test_budget_evaluates_every_k_units_and_at_the_limit():
    import worker

    by_steps = worker.Budget(limit=5, every=2, by_steps=True)
    due = [n for n in range(1, 6) if by_steps.due(clock=99.0, steps=n)]  # the clock is ignored by steps
    assert due == [2, 4, 5] and by_steps.done(0.0, 5) and not by_steps.done(0.0, 4)
    by_time = worker.Budget(limit=10.0, every=3.0, by_steps=False)
    # a late step (7.5 s, past 6) moves the next point past it (to 9), not to 6
    assert [t for t in (1.0, 3.2, 7.5, 8.0, 9.1, 10.0) if by_time.due(clock=t, steps=0)] == [3.2, 7.5, 9.1, 10.0]


def test_per_step_section_pairs_seeds_and_reports_the_difference():
    from dataclasses import asdict

    from groupwise.claims.intervals import mean_interval, paired_effect

    gw, trl = {0: 0.5, 1: 0.7}, {0: 0.4, 1: 0.4}
    row = {
        "step": 50,
        "groupwise": asdict(mean_interval(list(gw.values()))),
        "trl": asdict(mean_interval(list(trl.values()))),
        "difference": asdict(paired_effect(gw, trl)),
    }
    result = {
        "algorithm": {"recipe": "demo", "prompts": 32, "group": 8, "length": 6, "lr": 2e-4, "loss": "grpo", "mu": 1},
        "seeds": 2,
        "eval_size": 0,
        "every": 50,
        "rows": [row],
    }
    text = run.per_step_section(result)
    # differences 0.1 and 0.3: mean +0.2, sd 0.1414, t(1) = 12.706 -> half-width 12.706 * 0.1414 / sqrt 2 = 1.271
    assert "| 50 | 0.400 ± 0.000 | 0.600 ± 1.271 | +0.200 ± 1.271 |" in text


def test_generation_section_reports_the_ratio_per_model_and_batch():
    result = {
        "length": 64,
        "reps": 3,
        "threads": 2,
        "rows": [{"preset": "tiny", "batch": 8, "groupwise_tok_s": 3000.0, "hf_tok_s": 1200.0, "ratio": 2.5}],
    }
    text = run.generation_section(result)
    assert "| tiny | 8 | 3,000 | 1,200 | **2.50×** |" in text and "exactly 64 completion tokens" in text
    assert run.generation_section({"error": "boom", "log": "x.log"}).startswith("_Generation throughput failed: boom")


def test_seeded_time_to_accuracy_takes_the_geometric_mean_and_counts_a_miss_at_the_budget(monkeypatch, tmp_path):
    reach = {
        ("arithmetic", 0): 75.0,
        ("arithmetic", 1): 150.0,
        ("mixed", 0): None,
        ("mixed", 1): 100.0,
    }  # None: groupwise never got there

    def fake(model, seconds, eval_every, eval_size, threads, rundir, task, seed, gw_eval_every):
        got = reach[(task, seed)]
        return {
            "task": task,
            "seed": seed,
            "algorithm": {"prompts": 32, "group": 8, "length": 6, "lr": 2e-4, "loss": "grpo", "beta": 0.0, "mu": 1},
            "eval_size": 500,
            "target_accuracy": 0.9,
            "trl_curve": [[0.0, 0, 0.3], [300.0, 1200, 0.9]],
            "trl_seconds": 300.0,
            "trl_first_reach_seconds": 300.0,
            "groupwise_reach_seconds": got,
            "groupwise_final_accuracy": 0.9 if got else 0.8,
            "time_ratio": 300.0 / got if got else None,
            "time_ratio_first_reach": 300.0 / got if got else None,
            "trl_steps_per_s": 4.0,
            "groupwise_steps_per_s": 12.0,
            "trl_rss_mb": 500.0,
            "groupwise_rss_mb": 400.0,
        }

    monkeypatch.setattr(run, "time_to_accuracy", fake)
    result = run.seeded_time_to_accuracy(Path("m"), ["arithmetic", "mixed"], 2, 300.0, 15.0, 5.0, 0, 2, tmp_path)
    assert "error" not in result
    monkeypatch.setattr(run, "time_to_accuracy", lambda *a, **k: fake(*a, **k) if k["seed"] == 0 else {"error": "boom"})
    assert (
        run.seeded_time_to_accuracy(Path("m"), ["mixed"], 2, 300.0, 15.0, 5.0, 0, 2, tmp_path)["error"]
        == "mixed seed 1: boom"
    )

    arithmetic = result["summary"]["arithmetic"]
    # ratios 300/75 = 4 and 300/150 = 2: geometric mean sqrt(8) = 2.828; log ratios ln 4, ln 2 have mean 1.0397 and
    # sd 0.4901, t(1) = 12.706 -> half-width 12.706 * 0.4901 / sqrt 2 = 4.404 ->
    # [exp(-3.364), exp(5.443)] = [0.0346, 231.2]
    assert arithmetic["ratios"] == [4.0, 2.0] and arithmetic["ratio_geomean"] == pytest.approx(8**0.5)
    assert arithmetic["ratio_interval"] == pytest.approx([0.0346, 231.2], rel=1e-3)
    assert arithmetic["groupwise_reach_seconds"]["mean"] == pytest.approx(112.5) and arithmetic["not_reached"] == []
    mixed = result["summary"]["mixed"]
    assert mixed["ratios"][0] == 1.0 and mixed["not_reached"] == [0]  # the miss counts at the budget: ratio 1, flagged
    text = run.tta_seeded_section(result)
    assert (
        "| arithmetic | 500 | 0.300 | 0.900 ± 0.000 | 112 ± 476 | **2.83×** "
        "[0.03, 231.22] | 4.00, 2.00 | 12.00 / 4.00 | not resolved |" in text
    )
    assert (
        "| mixed | 0 | 0.900 | 300 | – | – | – | 0.800 |" in text
        and "| mixed | 1 | 0.900 | 300 | 100 | 3.00× | 3.00× | 0.900 |" in text
    )
    assert "| 1.00*, 3.00 |" in text
