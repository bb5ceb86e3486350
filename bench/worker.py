"""Measurements in a fresh process: one framework, a list of cells run one after another (or one
time-to-accuracy run).

    python bench/worker.py measure --framework {groupwise,trl} --cells JSON_LIST --models-dir DIR --threads T --out FILE
    python bench/worker.py gen --framework {groupwise,hf} --model DIR --threads T \
        [--batches 8,64,512 --length 64] --out FILE
    python bench/worker.py tta --framework {groupwise,trl} --model DIR --threads T --seconds S \
        --eval-every S [--target ACC] [--steps N --eval-every-steps K --seed S] --out FILE

Only the framework measured is imported, so the process's memory is that framework's: interpreter +
torch + the framework + model + optimiser state + activations. Each cell's peak RSS is Linux's
high-water mark reset at the cell's start (after the previous cell's objects are collected and freed
heap memory is handed back to the OS: ``common.reset_peak_rss``); ``rss_at_start_mb`` records what was
resident then. Running several cells per process saves ~10 s of imports and set-up per cell.

Step time is wall time of one *rollout step*: generate ``prompts x G`` completions, score them, and
run the ``mu`` optimiser steps that use them. groupwise: ``Trainer.run_step()`` called in a tight
loop. TRL: the time between consecutive ``on_step_end`` callbacks (so it includes TRL's data
loading, generation, scoring, loss, backward, clipping, optimiser and scheduler steps, and its
per-step bookkeeping), summed over the ``mu`` optimiser steps of each rollout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from common import (
    OFFLINE_ENV,
    REWARD_FN,
    Cell,
    Measurement,
    greedy_accuracy,
    heldout_rows,
    parameter_counts,
    peak_rss_mb,
    reset_peak_rss,
    rss_mb,
    train_rows,
)

for _key, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_key, _value)

# ------------------------------------------------------------------------------------------------
# The configuration mapping (documented in bench/README.md)
# ------------------------------------------------------------------------------------------------
LOSS_TO_AGG = {"dapo": "token_mean", "grpo": "seq_mean_token_mean"}
ADAM_BETAS = (0.9, 0.99)  # groupwise adamw's default; TRL's adam_beta2 default is 0.999, so we set it
MAX_GRAD_NORM = 1.0


def groupwise_overrides(
    *,
    model: str,
    threads: int,
    out: str,
    prompts: int,
    group: int,
    length: int,
    loss: str,
    beta: float,
    mu: int,
    lr: float,
    epsilon: float,
    micro_groups: int,
    steps: int,
    seed: int = 0,
    matmul: str = "float32",
    task: str = "arithmetic",
) -> list[str]:
    """groupwise ``key=value`` overrides for one configuration (used with no recipe or on top of one)."""
    terms: list[Any] = [{"name": "ppo_clip", "eps_low": epsilon, "eps_high": epsilon}]
    if beta > 0:
        terms.append({"name": "kl", "coef": beta, "estimator": "k3"})
    values = {
        "name": "bench",
        "seed": seed,
        "out": out,
        "threads": threads,
        "model.path": model,
        "model.dtype": "float32",
        "model.matmul": matmul,  # bfloat16: the bf16 rows (products in bf16 over float32 master weights)
        "data.task": task,
        "rollout.group_size": group,
        "rollout.prompts_per_step": prompts,
        "rollout.max_new_tokens": length,
        "rollout.temperature": 1.0,
        "rollout.top_p": 1.0,
        "rollout.top_k": 0,
        "sampling": "uniform",
        "rewards": [{"name": "python", "fn": REWARD_FN}],
        "advantage.estimator": {"name": "grpo", "scale": "group"},
        "objective.agg": LOSS_TO_AGG[loss],
        "objective.terms": terms,
        "update": {
            "name": "adamw",
            "lr": lr,
            "betas": list(ADAM_BETAS),
            "weight_decay": 0.0,
            "max_grad_norm": MAX_GRAD_NORM,
            "warmup_steps": 0,
            "schedule": "constant",
        },
        "train.steps": steps,
        "train.epochs": mu,
        "train.minibatches": 1,
        "train.micro_batch_groups": micro_groups,
        "eval.size": 0,
        "checkpoint.every": 0,
    }
    from groupwise.config import toml_value  # here, not at import: the TRL worker must not load groupwise

    return [f"{key}={toml_value(value)}" for key, value in values.items()]


def trl_config(
    *,
    out: str,
    prompts: int,
    group: int,
    length: int,
    loss: str,
    beta: float,
    mu: int,
    lr: float,
    epsilon: float,
    micro_groups: int,
    max_steps: int,
    seed: int = 0,
    bf16: bool = False,
):
    """The ``GRPOConfig`` equivalent to :func:`groupwise_overrides` (see bench/README.md for each line)."""
    import dataclasses

    from trl import GRPOConfig

    accumulation = prompts // micro_groups
    kwargs: dict[str, Any] = dict(
        output_dir=out,
        seed=seed,
        # TRL defaults that are wrong for this comparison on a CPU, set explicitly:
        use_cpu=True,
        bf16=bf16,  # TRL default: True (bf16 autocast); both frameworks run fp32 here except in the bf16 rows
        fp16=False,
        gradient_checkpointing=False,  # TRL default: True (recomputes activations: slower)
        learning_rate=lr,  # TRL default: 1e-6
        # batch geometry: one generation round of prompts*G completions feeds exactly one optimiser step (mu = 1)
        num_generations=group,
        per_device_train_batch_size=micro_groups * group,  # completions per micro-batch
        gradient_accumulation_steps=accumulation,  # micro-batches per optimiser step
        steps_per_generation=accumulation,  # => generation_batch_size = prompts*G
        max_completion_length=length,
        num_iterations=mu,
        # objective
        loss_type=loss,
        beta=beta,
        # TRL 1.16 default True multiplies the KL by the ratio; groupwise's k3 term does not
        use_bias_correction_kl=False,
        epsilon=epsilon,
        epsilon_high=epsilon,
        scale_rewards="group",
        mask_truncated_completions=False,
        importance_sampling_level="token",
        # sampling: plain temperature-1 sampling over the whole vocabulary
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        # optimiser = groupwise adamw: AdamW(betas 0.9/0.99, eps 1e-8, no decay), clip 1.0, constant lr, no warm-up
        adam_beta1=ADAM_BETAS[0],
        adam_beta2=ADAM_BETAS[1],
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=MAX_GRAD_NORM,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=max_steps,
        # no logging, saving or evaluation overheads
        report_to=[],
        logging_strategy="no",
        logging_steps=10**9,
        save_strategy="no",
        eval_strategy="no",
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        shuffle_dataset=True,
    )
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    if "activation_checkpointing" in names:  # transformers >= 5.x: the new name of gradient_checkpointing
        kwargs["activation_checkpointing"] = False
    return GRPOConfig(**kwargs)


# ------------------------------------------------------------------------------------------------
# groupwise
# ------------------------------------------------------------------------------------------------
def _groupwise_ablation() -> list[str]:
    """Extra groupwise overrides for an ablation run: ``GW_BENCH_OVERRIDES="perf.functional=false;..."``."""
    return [o.strip() for o in os.environ.get("GW_BENCH_OVERRIDES", "").split(";") if o.strip()]


def groupwise_trainer(overrides: list[str], recipe: str | None = None):
    from groupwise.build import build
    from groupwise.config import load_config
    from groupwise.trainer import Trainer

    cfg, _ = load_config(recipe, overrides)
    return Trainer(build(cfg))


def measure_groupwise(cell: Cell, model: str, threads: int, workdir: str) -> Measurement:
    import torch

    t0 = time.perf_counter()
    ablation = _groupwise_ablation()
    overrides = groupwise_overrides(
        model=model,
        threads=threads,
        out=workdir,
        prompts=cell.prompts,
        group=cell.group,
        length=cell.length,
        loss=cell.loss,
        beta=cell.beta,
        mu=cell.mu,
        lr=cell.lr,
        epsilon=cell.epsilon,
        micro_groups=cell.micro,
        steps=cell.warmup + cell.steps,
        matmul=cell.matmul,
    )
    trainer = groupwise_trainer(overrides + ablation)
    m = Measurement("groupwise", cell.name, threads=torch.get_num_threads(), **parameter_counts(trainer.policy.module))
    m.setup_seconds = time.perf_counter() - t0
    lengths = []
    for i in range(cell.warmup + cell.steps):
        start = time.perf_counter()
        row = trainer.run_step()
        seconds = time.perf_counter() - start
        trainer.step += 1
        if i < cell.warmup:
            m.warmup_seconds.append(seconds)
        else:
            generated = row["tokens_per_s"] * row["step_seconds"]  # completion tokens of this rollout
            m.step_seconds.append(seconds)
            m.generation_seconds.append(row["generation_seconds"])
            m.generated_tokens.append(round(generated))
            m.trained_tokens.append(round(generated) * cell.mu)
            lengths.append(row["completion_len"])
    m.peak_rss_mb = peak_rss_mb()
    m.notes = {
        "ablation": ablation,
        "mean_completion_len": sum(lengths) / len(lengths),
        "torch_threads_after": torch.get_num_threads(),
        "micro_batch_groups": cell.micro,
        "perf": dict(vars(trainer.cfg.perf)),
        "functional_engine": trainer.policy.engine.functional,
        "matmul": trainer.policy.matmul.dtype,
    }
    return m


# ------------------------------------------------------------------------------------------------
# TRL
# ------------------------------------------------------------------------------------------------
def _trl_trainer(args, model_dir: str, callbacks: list, task: str = "arithmetic"):
    import torch
    from datasets import Dataset
    from rewards import exact_answer
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tokenizer.padding_side = "left"
    if getattr(tokenizer, "chat_template", None):
        raise SystemExit(f"{model_dir}: the tokenizer has a chat template; the comparison assumes raw-text prompts")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    )
    # columns: prompt (plain text: no chat template), answer (+ the task's own)
    dataset = Dataset.from_list(train_rows(task))
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[exact_answer],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    flag = (
        "is_activation_checkpointing"
        if hasattr(type(trainer.model), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    if getattr(trainer.model, flag, False):
        raise SystemExit("TRL enabled gradient checkpointing despite gradient_checkpointing=False")
    return trainer


def _step_timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall time between consecutive optimiser-step ends, and inside each step (begin -> end)."""

        def __init__(self) -> None:
            self.intervals: list[float] = []
            self.inside: list[float] = []
            self.lengths: list[float] = []
            self.trainer = None
            self._last = self._begin = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self._last = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            self._begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.intervals.append(now - self._last)
            self.inside.append(now - self._begin)
            lengths = self.trainer._metrics["train"].get("completions/mean_length", []) if self.trainer else []
            self.lengths.append(lengths[-1] if lengths else float("nan"))
            self._last = time.perf_counter()

    return StepTimer()


def measure_trl(cell: Cell, model: str, threads: int, workdir: str) -> Measurement:
    import torch

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    args = trl_config(
        out=workdir,
        prompts=cell.prompts,
        group=cell.group,
        length=cell.length,
        loss=cell.loss,
        beta=cell.beta,
        mu=cell.mu,
        lr=cell.lr,
        epsilon=cell.epsilon,
        micro_groups=cell.micro,
        max_steps=(cell.warmup + cell.steps) * cell.mu,
        bf16=cell.matmul == "bfloat16",
    )
    timer = _step_timer()
    trainer = _trl_trainer(args, model, [timer])
    timer.trainer = trainer
    m = Measurement("trl", cell.name, threads=torch.get_num_threads(), **parameter_counts(trainer.model))
    m.setup_seconds = time.perf_counter() - t0
    trainer.train()
    mu = cell.mu
    rollouts = len(timer.intervals) // mu
    m.warmup_seconds = [sum(timer.intervals[r * mu : (r + 1) * mu]) for r in range(min(cell.warmup, rollouts))]
    for r in range(cell.warmup, rollouts):
        chunk = slice(r * mu, (r + 1) * mu)
        m.step_seconds.append(sum(timer.intervals[chunk]))
        length = timer.lengths[r * mu]  # generation happens on the first optimiser step of each rollout
        generated = length * cell.prompts * cell.group
        m.generated_tokens.append(round(generated))
        m.trained_tokens.append(round(generated) * mu)
    inside = [sum(timer.inside[r * mu : (r + 1) * mu]) for r in range(cell.warmup, rollouts)]
    m.peak_rss_mb = peak_rss_mb()
    a = trainer.args
    m.notes = {
        "step_seconds_inside_callbacks": inside,
        "torch_threads_after": torch.get_num_threads(),
        "mean_completion_len": sum(timer.lengths[cell.warmup * mu :: mu])
        / max(1, len(timer.lengths[cell.warmup * mu :: mu])),
        "resolved": {
            k: str(getattr(a, k))
            for k in (
                "per_device_train_batch_size",
                "gradient_accumulation_steps",
                "steps_per_generation",
                "generation_batch_size",
                "num_generations",
                "num_iterations",
                "max_completion_length",
                "loss_type",
                "beta",
                "bf16",
                "fp16",
                "gradient_checkpointing",
                "learning_rate",
                "lr_scheduler_type",
                "optim",
                "adam_beta2",
                "use_cpu",
            )
        },
        "device": str(trainer.model.device),
        "model_dtype": str(trainer.model.dtype),
    }
    return m


# ------------------------------------------------------------------------------------------------
# Time to accuracy
# ------------------------------------------------------------------------------------------------
def _demo_algorithm(recipe: str) -> dict[str, Any]:
    """The algorithm settings of a groupwise recipe, in the bench's terms (so TRL can be configured alike)."""
    from groupwise.config import load_config

    cfg, _ = load_config(recipe, [])
    terms = [t if isinstance(t, dict) else {"name": t} for t in cfg.objective.terms]
    clip = next(t for t in terms if t["name"] == "ppo_clip")
    if clip.get("eps_low", 0.2) != clip.get("eps_high", 0.2):
        raise SystemExit("time-to-accuracy: asymmetric clipping is not mapped")
    kl = next((t for t in terms if t["name"] == "kl"), None)
    loss = {v: k for k, v in LOSS_TO_AGG.items()}[cfg.objective.agg]
    update = cfg.update if isinstance(cfg.update, dict) else {"name": cfg.update}
    return {
        "prompts": cfg.rollout.prompts_per_step,
        "group": cfg.rollout.group_size,
        "length": cfg.rollout.max_new_tokens,
        "loss": loss,
        "beta": float(kl.get("coef", 0.04)) if kl else 0.0,
        "mu": cfg.train.epochs,
        "lr": float(update.get("lr", 1e-6)),
        "epsilon": float(clip.get("eps_low", 0.2)),
        "micro_groups": cfg.rollout.prompts_per_step,  # the recipe trains the whole batch at once
        "recipe": recipe,
    }


class Budget:
    """When a time-to-accuracy run evaluates and when it stops: every ``every`` units of progress up to
    ``limit``, where progress is training seconds, or optimiser steps when ``by_steps`` (learning per
    step, independent of the machine's speed)."""

    def __init__(self, limit: float, every: float, by_steps: bool) -> None:
        self.limit, self.every, self.by_steps = limit, every, by_steps
        self.next = every

    def progress(self, clock: float, steps: int) -> float:
        return float(steps) if self.by_steps else clock

    def due(self, clock: float, steps: int) -> bool:
        """Evaluate now? (advances the next evaluation point past the current progress)"""
        x = self.progress(clock, steps)
        if x < self.next and x < self.limit:
            return False
        self.next += self.every * (1 + int((x - self.next) // self.every))
        return True

    def done(self, clock: float, steps: int) -> bool:
        return self.progress(clock, steps) >= self.limit


def tta(
    framework: str,
    model: str,
    threads: int,
    seconds: float,
    eval_every: float,
    target: float | None,
    eval_size: int,
    recipe: str,
    workdir: str,
    steps: int = 0,
    eval_every_steps: int = 0,
    seed: int = 0,
    task: str = "arithmetic",
) -> dict[str, Any]:
    """Train for ``seconds`` of training time (evaluation excluded), evaluating held-out greedy accuracy
    every ``eval_every`` training seconds; stop early once accuracy >= ``target`` (if given). With
    ``steps`` > 0 the budget is that many optimiser steps, evaluated every ``eval_every_steps``. ``task``
    replaces the recipe's task (a built-in task whose rows carry an ``answer`` for the exact-match reward)."""
    import torch

    torch.set_num_threads(threads)
    algo = _demo_algorithm(recipe)
    rows = heldout_rows(eval_size, task)
    curve: list[tuple[float, int, float]] = []  # (training seconds, optimiser steps, accuracy)
    budget = Budget(steps, eval_every_steps, True) if steps > 0 else Budget(seconds, eval_every, False)
    t_setup = time.perf_counter()

    if framework == "groupwise":
        overrides = groupwise_overrides(
            model=model,
            threads=threads,
            out=workdir,
            prompts=algo["prompts"],
            group=algo["group"],
            length=algo["length"],
            loss=algo["loss"],
            beta=algo["beta"],
            mu=algo["mu"],
            lr=algo["lr"],
            epsilon=algo["epsilon"],
            micro_groups=0,
            steps=10**6,
            seed=seed,
            task=task,
        )
        trainer = groupwise_trainer(overrides)
        setup = time.perf_counter() - t_setup
        clock, done_steps = 0.0, 0
        curve.append((0.0, 0, greedy_accuracy(trainer.policy.module, trainer.policy.tokenizer, rows, algo["length"])))
        while not budget.done(clock, done_steps):
            start = time.perf_counter()
            trainer.run_step()
            clock += time.perf_counter() - start
            trainer.step += 1
            done_steps += algo["mu"]
            if budget.due(clock, done_steps):
                curve.append(
                    (
                        clock,
                        done_steps,
                        greedy_accuracy(trainer.policy.module, trainer.policy.tokenizer, rows, algo["length"]),
                    )
                )
                if target is not None and curve[-1][2] >= target:
                    break
    else:
        from transformers import TrainerCallback

        class Clock(TrainerCallback):
            def __init__(self) -> None:
                self.clock, self.trainer = 0.0, None
                self._last = 0.0

            def on_train_begin(self, args, state, control, **kwargs):
                curve.append(
                    (0.0, 0, greedy_accuracy(kwargs["model"], self.trainer.processing_class, rows, algo["length"]))
                )
                self._last = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                self.clock += time.perf_counter() - self._last
                if budget.due(self.clock, state.global_step):
                    accuracy = greedy_accuracy(kwargs["model"], self.trainer.processing_class, rows, algo["length"])
                    curve.append((self.clock, state.global_step, accuracy))
                    if budget.done(self.clock, state.global_step) or (target is not None and accuracy >= target):
                        control.should_training_stop = True
                self._last = time.perf_counter()  # evaluation time is not training time
                return control

        args = trl_config(
            out=workdir,
            prompts=algo["prompts"],
            group=algo["group"],
            length=algo["length"],
            loss=algo["loss"],
            beta=algo["beta"],
            mu=algo["mu"],
            lr=algo["lr"],
            epsilon=algo["epsilon"],
            micro_groups=algo["prompts"],
            max_steps=steps if steps > 0 else 10**6,
            seed=seed,
        )
        clock_cb = Clock()
        trainer = _trl_trainer(args, model, [clock_cb], task)
        clock_cb.trainer = trainer
        setup = time.perf_counter() - t_setup
        trainer.train()
    return {
        "framework": framework,
        "curve": curve,
        "setup_seconds": setup,
        "algorithm": algo,
        "threads": threads,
        "eval_size": len(rows),
        "target": target,
        "budget_seconds": seconds,
        "eval_every": eval_every,
        "budget_steps": steps,
        "eval_every_steps": eval_every_steps,
        "seed": seed,
        "task": task,
        "peak_rss_mb": peak_rss_mb(),
    }


# ------------------------------------------------------------------------------------------------
def generation(
    framework: str, model: str, threads: int, batches: list[int], length: int, group: int, reps: int, workdir: str
) -> list[dict[str, Any]]:
    """Generation alone: completion tokens per second of sampling ``batch`` rows (``batch / group``
    prompts x ``group``) of exactly ``length`` tokens (the bench models cannot emit EOS), temperature 1,
    full vocabulary; groupwise's engine (``policy.generate``) or Hugging Face ``generate`` on the same
    prompts. One untimed call per batch size first, then ``reps`` timed calls (their median is reported)."""
    import statistics

    import torch

    torch.set_num_threads(threads)
    rows = train_rows()
    out = []
    if framework == "groupwise":
        from groupwise.types import Request, StepInfo

        trainer = groupwise_trainer(
            groupwise_overrides(
                model=model,
                threads=threads,
                out=workdir,
                prompts=max(batches) // group,
                group=group,
                length=length,
                loss="grpo",
                beta=0.0,
                mu=1,
                lr=1e-5,
                epsilon=0.2,
                micro_groups=0,
                steps=1,
            )
            + _groupwise_ablation()
        )
        policy = trainer.policy

        def sample(batch: int, call: int) -> int:
            info = StepInfo(call, 0, length)
            requests = [Request(key=i, n=group, prompt=policy.encode(rows[i]["prompt"])) for i in range(batch // group)]
            gen = policy.generate(requests, trainer.sampling_params, info)
            return int(gen.mask.sum())
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
        tokenizer.padding_side = "left"
        hf = AutoModelForCausalLM.from_pretrained(
            model, dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
        ).eval()

        def sample(batch: int, call: int) -> int:
            torch.manual_seed(call)
            prompts = [rows[i]["prompt"] for i in range(batch // group) for _ in range(group)]
            ids = tokenizer(prompts, return_tensors="pt", padding=True)
            with torch.no_grad():
                seqs = hf.generate(
                    **ids,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=length,
                    min_new_tokens=length,
                    pad_token_id=tokenizer.pad_token_id,
                )
            return int(seqs.shape[0] * (seqs.shape[1] - ids["input_ids"].shape[1]))

    for batch in batches:
        if batch % group:
            raise SystemExit(f"batch {batch} is not a multiple of the group size {group}")
        sample(batch, 0)  # warm-up: allocator, caches, first-call dispatch
        seconds, tokens = [], []
        for call in range(1, reps + 1):
            start = time.perf_counter()
            tokens.append(sample(batch, call))
            seconds.append(time.perf_counter() - start)
        out.append(
            {
                "framework": framework,
                "batch": batch,
                "length": length,
                "seconds": seconds,
                "tokens": tokens,
                "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, seconds)),
            }
        )
    return out


def measure_cells(cells: list[Cell], framework: str, models_dir: str, threads: int) -> list[dict[str, Any]]:
    """Each cell in turn, in this process: its measurement, or ``{"cell", "error"}`` if it failed (the
    cells after it still run)."""
    import traceback

    fn = measure_groupwise if framework == "groupwise" else measure_trl
    results: list[dict[str, Any]] = []
    for index, cell in enumerate(cells):
        exact_peak = reset_peak_rss()
        before = rss_mb()
        try:
            with tempfile.TemporaryDirectory(prefix=f"bench-{framework}-") as workdir:
                m = fn(cell, str(Path(models_dir) / cell.preset), threads, workdir)
        except Exception as exc:  # one failed cell must not cost the others
            traceback.print_exc()
            results.append({"cell": cell.name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        m.rss_at_start_mb, m.cell_index = before, index
        m.notes["peak_rss_window"] = "cell" if exact_peak else "process"
        results.append(asdict(m))
        print(
            f"{cell.name}: steps {[round(s, 4) for s in m.step_seconds]} s, peak RSS {m.peak_rss_mb:.0f} MB "
            f"({before:.0f} MB at start)",
            flush=True,
        )
    return results


# ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--framework", choices=("groupwise", "trl"), required=True)
    m.add_argument("--cells", required=True, help="JSON list of cells, run in this order")
    m.add_argument("--models-dir", required=True, help="folder holding one model folder per preset")
    t = sub.add_parser("tta")
    t.add_argument("--framework", choices=("groupwise", "trl"), required=True)
    t.add_argument("--seconds", type=float, default=300.0)
    t.add_argument("--eval-every", type=float, default=15.0)
    t.add_argument("--eval-size", type=int, default=0)
    t.add_argument("--target", type=float, default=None)
    t.add_argument("--recipe", default="demo")
    t.add_argument(
        "--steps", type=int, default=0, help="budget in optimiser steps instead of --seconds (learning per step)"
    )
    t.add_argument("--eval-every-steps", type=int, default=50)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--task", default="arithmetic", help="built-in task replacing the recipe's (rows with an 'answer' column)"
    )
    t.add_argument("--model", required=True)
    g = sub.add_parser("gen")
    g.add_argument("--framework", choices=("groupwise", "hf"), required=True)
    g.add_argument("--model", required=True)
    g.add_argument("--batches", default="8,64,512")
    g.add_argument("--length", type=int, default=64)
    g.add_argument("--group", type=int, default=8)
    g.add_argument("--reps", type=int, default=3)
    for p in (m, t, g):
        p.add_argument("--threads", type=int, required=True)
        p.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.mode == "gen":
        with tempfile.TemporaryDirectory(prefix=f"bench-gen-{args.framework}-") as workdir:
            result: Any = generation(
                args.framework,
                args.model,
                args.threads,
                [int(b) for b in args.batches.split(",")],
                args.length,
                args.group,
                args.reps,
                workdir,
            )
    elif args.mode == "measure":
        result = measure_cells(
            [Cell(**c) for c in json.loads(args.cells)], args.framework, args.models_dir, args.threads
        )
    else:
        with tempfile.TemporaryDirectory(prefix=f"bench-{args.framework}-") as workdir:
            result = tta(
                args.framework,
                args.model,
                args.threads,
                args.seconds,
                args.eval_every,
                args.target,
                args.eval_size,
                args.recipe,
                workdir,
                steps=args.steps,
                eval_every_steps=args.eval_every_steps,
                seed=args.seed,
                task=args.task,
            )
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
