"""The run around the step: ``Run(trainer)`` holds the trainer and its held-out evaluation and owns
the run folder held locked, resume from the newest intact checkpoint (refused under another
configuration), SIGTERM / Ctrl-C, time limits and checkpoints decided by every rank together, the
phases before the RL steps, the final evaluation and the outputs. The step itself — collect,
prepare, update, observe — is ``trainer.py``; the guarantees are ``docs/reliability.md``.

``Run.from_config(cfg)`` builds the three (``build.py``); ``run.train()`` runs it to the end.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import time
import tomllib
from typing import Any

import numpy as np
import torch

from groupwise import checkpoint, dist, runfolder, schedules, tracking
from groupwise.build import build
from groupwise.config import Config, to_dict, to_toml, with_defaults
from groupwise.errors import ConfigError
from groupwise.heldout import HeldOut
from groupwise.logging import MetricsLog, append_jsonl, cut_back, logged_rows, plot_rewards, progress_bar, sample_rows
from groupwise.phases import PhaseContext, inject, run_phases
from groupwise.pinning import loaded_models
from groupwise.trainer import Trainer
from groupwise.updates._base import all_finite


class Run:
    """A whole run of ``trainer`` (module docstring); ``heldout`` evaluates it (default: ``HeldOut(trainer)``),
    ``console`` (a rich Console) shows its progress on rank 0 (default: lines to stderr, no bar)."""

    def __init__(self, trainer: Trainer, heldout: HeldOut | None = None, console: Any = None):
        self.trainer, self.heldout, self.console = trainer, heldout or HeldOut(trainer), console
        self.parts, self.cfg, self.rank = trainer.parts, trainer.cfg, trainer.rank
        self.out = self.cfg.out_dir
        rows_skipped = self.parts.rows_skipped
        self.summary: dict[str, Any] = {"rows_skipped": rows_skipped} if rows_skipped else {}
        self._stop_requested: str | None = None  # the signal's name once SIGTERM / SIGINT arrived
        self._skipped_in_row = 0  # optimiser steps in a row with a non-finite loss, gradient or result
        self._empty_in_row = 0  # steps in a row in which no sample had a finite reward

    @classmethod
    def from_config(cls, cfg: Config, console: Any = None) -> Run:
        """The run of ``cfg``: everything built and checked (``build(cfg)``), the trainer, its held-out evaluation."""
        return cls(Trainer(build(cfg)), console=console)

    def _say(self, message: str) -> None:
        if self.rank == 0:
            if self.console is not None:
                self.console.print(message, soft_wrap=True, markup=False, highlight=False)  # one line: greppable
            else:
                print(message, file=sys.stderr)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The whole run's state: the trainer's (step, policy, components, schedules, prompt table,
        roles), the random generators, the summary so far and the health counters."""
        return {
            **self.trainer.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
            "summary": self.summary,
            "in_row": {"skipped": self._skipped_in_row, "empty": self._empty_in_row},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        self.summary = state["summary"]
        self._skipped_in_row, self._empty_in_row = state["in_row"]["skipped"], state["in_row"]["empty"]

    def save_checkpoint(self) -> None:
        trainer = self.trainer
        # the updater rolls such steps back; never write one
        trained = (trainer.main, *trainer.roles, *(actor.role for actor in trainer.actors.values()))
        if not all_finite([p for t in trained for p in t.params]):
            raise RuntimeError(f"refusing to checkpoint step {trainer.step}: the model has non-finite weights")
        # every rank: under dist.shard="fsdp2" each writes its own shards of the weights and optimiser states
        checkpoint.save(self.out, trainer.step, self.state_dict(), self.cfg.checkpoint.keep_last)
        dist.barrier()

    # ------------------------------------------------------------------ the run
    def train(self, resume_allow: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
        """The whole run in its folder, which it holds locked: resume (or start), train until done,
        stopped (SIGTERM / Ctrl-C: checkpoint, then return) or out of time, evaluate, write outputs."""
        self.out.mkdir(parents=True, exist_ok=True)
        lock = runfolder.RunLock(self.out).acquire() if self.rank == 0 else None
        if lock is not None:  # held: no live process writes here, so any temporary file is a killed run's
            removed = runfolder.clean_temporary(self.out)
            if removed:
                names = ", ".join(p.name for p in removed[:4]) + (" ..." if len(removed) > 4 else "")
                self._say(f"removed {len(removed)} temporary file(s) a killed run left in {self.out}: {names}")
        try:
            return self._train(list(resume_allow))
        finally:
            if lock is not None:
                lock.release()

    def _resume(self, allow: list[str]) -> None:
        """Load the newest intact checkpoint if there is one, after checking the configuration is the
        one the run started with (else refused, naming each changed key); then record the config."""
        current = tomllib.loads(to_toml(to_dict(self.cfg)))  # as stored: compared like for like
        resume = checkpoint.latest_intact(self.out)
        stored = self.out / "config.toml"
        if resume is not None and stored.exists():
            runfolder.check_resume(
                {**with_defaults(tomllib.loads(stored.read_text())), "out": None}, {**current, "out": None}, allow
            )
        if resume is not None:
            self.load_state_dict(checkpoint.load(resume))
            self._say(f"resuming {self.out} from step {self.trainer.step} (checkpoint {resume.relative_to(self.out)})")
        if self.rank == 0:
            runfolder.write_atomic(stored, to_toml(to_dict(self.cfg)))

    def _finished(self) -> bool:
        """The checkpoint is the run's final one: trained to the end (or out of time) and evaluated.
        Its outputs may still be missing: :meth:`_finish_outputs` decides from ``FINISHED``."""
        out_of_time = (
            bool(self.cfg.train.max_seconds) and self.summary.get("wall_seconds", 0.0) > self.cfg.train.max_seconds
        )
        return bool(self.summary.get("finished")) and (self.trainer.step >= self.cfg.train.steps or out_of_time)

    def _finish_outputs(self) -> dict[str, Any]:
        """A rerun of a run whose final checkpoint exists: nothing to do when ``FINISHED`` vouches for
        this step's outputs; otherwise (killed after that checkpoint, before its last write) the
        outputs are written now from it: the same weights and summary, so the same bytes."""
        if self.rank != 0:
            return self.summary
        step, why = runfolder.finished_step(self.out)
        if step == self.trainer.step:
            self._say(
                f"{self.out} finished at step {self.trainer.step} already (summary.json); nothing to do. To "
                f"train further, raise train.steps and add --resume-allow train.steps; for a new run, pick "
                f"another out="
            )
            return self.summary
        why = why if step is None else f"{runfolder.FINISHED} is for step {step}"
        self._say(
            f"{self.out} finished training at step {self.trainer.step}, but its outputs were not all written "
            f"({why}); writing final/ and summary.json from its final checkpoint"
        )
        self._write_outputs(logged_rows(self.out / "metrics.jsonl", self.trainer.step - 1))
        return self.summary

    def _run_phases(self) -> None:
        """The phases before the RL steps (``groupwise.phases``), done or loaded; their artifacts injected."""
        if not self.parts.phases:
            return
        trainer = self.trainer
        ctx = PhaseContext(
            trainer.policy,
            trainer.train_rows,
            self.parts.eval_rows,
            self.cfg.seed,
            trainer.prompts,
            lambda policy, rows, split: self.heldout.evaluate(policy, rows, split),
            self._say,
            score=trainer.score,
            advantage=lambda rollout, info: trainer.estimator(rollout, info),
            models=dict(self.parts.frozen),
            max_new_tokens=self.cfg.rollout.max_new_tokens,
        )
        artifacts = run_phases(self.parts.phases, ctx, self.out / "phases", rl_started=trainer.step > 0, rank=self.rank)
        inject(artifacts, [*trainer.components(), *schedules.all_schedules(trainer.components())])
        self.summary.setdefault("phases", {}).update(ctx.summary)

    def _train(self, allow: list[str]) -> dict[str, Any]:
        self._resume(allow)
        if self._finished():  # before anything of a start (phases, run_info): the summary stays the checkpoint's
            return self._finish_outputs()
        policy, step = self.trainer.policy, self.trainer.step
        self.summary.update(getattr(policy, "run_info", {}))  # what the policy decided at start (model.matmul)
        self.summary["models"] = loaded_models(to_dict(self.cfg), [])  # every loaded model's sha256 (pinning.py)
        for note in getattr(policy, "run_notes", []):
            self._say(note)
        self._run_phases()
        log = MetricsLog(self.out / "metrics.jsonl", step - 1 if step else None) if self.rank == 0 else None
        if self.rank == 0:
            cut_back(self.out / "samples.jsonl", step - 1 if step else None)
        # TensorBoard / wandb / trackio (rank 0):
        # the resumed steps replace what a killed run logged after its checkpoint
        trackers = (
            tracking.open_trackers(self.cfg.log.backends, self.out, step, to_dict(self.cfg))
            if self.rank == 0
            else tracking.Trackers()
        )
        previous = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:  # the handlers stay until the outputs are written: a signal during the final evaluation waits for it
            return self._steps(log, trackers)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            trackers.close()
            if hasattr(self.trainer.generation, "close"):  # generation servers the run started (policy/served.py)
                self.trainer.generation.close()

    def _steps(self, log: MetricsLog | None, trackers: tracking.Trackers) -> dict[str, Any]:
        """Evaluate (once), train until done / stopped / out of time with the checkpoints due, then
        the final evaluation and outputs (not after a stop: the rerun continues)."""
        cfg, trainer = self.cfg, self.trainer
        start = time.perf_counter() - self.summary.get("wall_seconds", 0.0)
        if "accuracy_before" not in self.summary:
            self.summary["evals"] = []
            self._record_eval("accuracy_before", 0)
        last_save = time.perf_counter()
        stop, out_of_time = dist.agree([self._stop_requested is not None, False])
        with progress_bar(self.console) if self.rank == 0 else _Quiet() as bar:
            task = bar.add_task(cfg.name, total=cfg.train.steps, completed=trainer.step, reward=0.0, speed=0.0, kl="")
            while trainer.step < cfg.train.steps and not (stop or out_of_time):
                row = trainer.run_step()
                self._check_health(row)
                eval_due = cfg.eval.every and (trainer.step + 1) % cfg.eval.every == 0
                if eval_due and cfg.eval.size and self.parts.eval_rows:
                    # eval_accuracy, eval_reward_mean, eval_metric/<name> (an env run's: eval_return)
                    detail = self.heldout.evaluate_detail()
                    row.update({f"eval_{k}": v for k, v in detail.items()})
                    row.update({f"eval/{k}": v for k, v in self.heldout.evaluate_strategy().items()})
                    row.update(self._view_accuracies(row["eval_accuracy"]))
                    row.update(self._column_accuracies("eval_accuracy"))
                    self.summary["evals"].append((trainer.step + 1, row["eval_accuracy"]))
                if log:
                    log.write(row)
                    trackers.log(row, trainer.step)
                    self._log_samples(bar.console)
                bar.update(
                    task,
                    advance=1,
                    reward=row.get("reward_mean", 0.0),
                    speed=row.get("tokens_per_s", 0.0),
                    kl=f"kl {row['kl']:.4f}" if row.get("kl") is not None else "",
                )  # the KL to the reference, when one is measured
                trainer.step += 1
                self.summary["wall_seconds"] = time.perf_counter() - start
                # decided together: every rank stops, and checkpoints, at the same step
                ck = cfg.checkpoint
                due = (ck.every and trainer.step % ck.every == 0) or (
                    ck.minutes and time.perf_counter() - last_save > 60 * ck.minutes
                )
                stop, out_of_time, due = dist.agree(
                    [
                        self._stop_requested is not None,
                        bool(cfg.train.max_seconds) and self.summary["wall_seconds"] > cfg.train.max_seconds,
                        bool(due),
                    ]
                )
                if due or stop or out_of_time:
                    self.save_checkpoint()
                    last_save = time.perf_counter()
        if stop:
            self._say(
                f"stopped by {self._stop_requested or 'another rank'} at step "
                f"{trainer.step} (checkpointed). Rerun the same command to resume."
            )
            return self.summary
        if out_of_time and trainer.step < cfg.train.steps:  # a time limit cut the run short of its steps: say so
            self.summary["stopped_early"] = (
                f"train.max_seconds={cfg.train.max_seconds:g} reached after step {trainer.step} of {cfg.train.steps}"
            )
            self._say(f"{self.summary['stopped_early']}; raise train.max_seconds (0 = no limit) to train longer")
        self._record_eval("accuracy_after", trainer.step)
        # the final checkpoint holds the final weights and summary ("finished": trained and evaluated);
        # the outputs follow it, FINISHED last: a kill in between is completed by the rerun from this checkpoint
        self.summary.update(
            steps=trainer.step,
            wall_seconds=time.perf_counter() - start,
            skipped_updates=getattr(trainer.updater, "skipped", 0),
            finished=True,
        )
        self.save_checkpoint()
        for model in (
            trainer.policy,
            *(role.policy for role in trainer.roles),
            *(a.policy for a in trainer.actors.values()),
        ):
            if hasattr(model, "whole"):  # sharded weights gathered whole on every rank, for final/ (rank 0)
                model.whole()
        if self.rank == 0:
            self._write_outputs(log.rows if log is not None else [])
        return self.summary

    def _log_samples(self, console: Any) -> None:
        """The step's sampled completions: to ``samples.jsonl`` every ``log.samples_every`` steps, as a
        table above the progress bar every ``log.table_every`` steps."""
        n, step = self.cfg.log.samples, self.trainer.step
        to_file = n and step % self.cfg.log.samples_every == 0
        to_console = n and self.cfg.log.table_every and step % self.cfg.log.table_every == 0
        if to_file or to_console:
            rows = sample_rows(self.trainer.last_batch, step, n)
            if to_file:
                append_jsonl(self.out / "samples.jsonl", rows)
            if to_console and rows:
                console.print(tracking.sample_table(rows))

    def _record_eval(self, key: str, step: int) -> None:
        """A held-out accuracy (and, with ``eval.samples``, the sampled metrics as ``<key>_sampled``)
        into the summary; without held-out rows, ``None`` and a note saying why."""
        if self.cfg.eval.samples:
            self.summary[f"{key}_sampled"] = self.heldout.evaluate_sampled()
        for role in self.trainer.roles:  # each further trained model on the same held-out prompts
            value = self.heldout.evaluate(role.policy)
            self.summary[f"{role.name}/{key}"] = None if value != value else value
        for name, actor in self.trainer.actors.items():  # each actor with its own prompt encoding and tokens
            value = self.heldout.evaluate_actor(actor)
            self.summary[f"{name}/{key}"] = None if value != value else value
        detail = self.heldout.evaluate_detail()
        accuracy = detail["accuracy"]
        if accuracy != accuracy:  # NaN: nothing to evaluate on
            self.summary[key] = None
            self.summary["eval_note"] = (
                f"no held-out evaluation: eval.size={self.cfg.eval.size} and {len(self.parts.eval_rows)} held-out rows"
            )
            return
        self.summary[key] = accuracy
        when = key.split("_", 1)[1]  # before / after
        if "return" in detail:  # held-out episodes (eval.closed_loop): accuracy_after -> return_after
            self.summary[f"return_{when}"] = detail["return"]
        if "reward_mean" in detail:  # the mean eval reward and its metrics (a continuous reward's); NaN -> null
            self.summary[f"reward_mean_{when}"] = (
                detail["reward_mean"] if detail["reward_mean"] == detail["reward_mean"] else None
            )
            self.summary.update(
                {f"metric_{when}/{k.split('/', 1)[1]}": (v if v == v else None) for k, v in detail.items() if "/" in k}
            )
        # the rollout strategy's own held-out measures, when it defines them
        self.summary.update(
            {f"{k}_{when}": (v if v == v else None) for k, v in self.heldout.evaluate_strategy().items()}
        )
        self.summary["evals"].append((step, accuracy))
        self.summary.update(self._column_accuracies(key))
        for name, value in self._view_accuracies(accuracy).items():
            if name.startswith("eval_accuracy@"):
                self.summary[f"{key}@{name.split('@', 1)[1]}"] = value
            elif name.startswith("eval_nll@"):  # accuracy_after -> nll_after@task:NAME
                self.summary[f"nll_{key.split('_', 1)[1]}@{name.split('@', 1)[1]}"] = (
                    value if value == value else None
                )  # NaN: no text policy

    def _column_accuracies(self, key: str) -> dict[str, float]:
        """Held-out accuracy on the rows of each value of column ``eval.by`` (``KEY/VALUE``), over the
        same first ``eval.size`` held-out rows as the plain accuracy; {} without ``eval.by``."""
        by, rows = self.cfg.eval.by, self.parts.eval_rows[: self.cfg.eval.size]
        if not by or not rows:
            return {}
        if any(by not in r for r in rows):
            raise ConfigError(f"eval.by={by!r}: not every held-out row has that column (columns: {sorted(rows[0])})")
        values = list(dict.fromkeys(str(r[by]) for r in rows))
        return {
            f"{key}/{v}": self.heldout.evaluate(rows=[r for r in rows if str(r[by]) == v], split=f"eval.by={v}")
            for v in values
        }

    def _view_accuracies(self, accuracy: float) -> dict[str, float]:
        """Held-out accuracy under each of ``eval.views`` (``eval_accuracy@VIEW``) and its gap to the
        plain ``accuracy`` (``eval_gap@VIEW`` = accuracy − eval_accuracy@VIEW), and on each of
        ``eval.tasks`` (``eval_accuracy@task:NAME``, and ``eval_nll@task:NAME``: the mean token NLL of its
        answers, ``HeldOut.answer_nll``)."""
        out = {}
        for name in self.cfg.eval.views:
            value = self.heldout.evaluate(view=name)
            out[f"eval_accuracy@{name}"] = value
            out[f"eval_gap@{name}"] = accuracy - value
        for name, (rows, stage) in self.parts.eval_tasks.items():  # eval.tasks: another task's held-out accuracy
            out[f"eval_accuracy@task:{name}"] = self.heldout.evaluate(rows=rows, split=f"task:{name}", stage=stage)
            out[f"eval_nll@task:{name}"] = self.heldout.answer_nll(rows, f"task:{name}")
        return out

    def _check_health(self, row: dict[str, Any]) -> None:
        """Abort (before anything is saved) a run that cannot learn: optimiser steps that keep going
        non-finite, or steps in which no sample has a finite reward."""
        cfg = self.cfg
        self._skipped_in_row = self._skipped_in_row + 1 if row.get("nonfinite") else 0
        if self._skipped_in_row >= cfg.train.max_skipped_in_row:
            raise RuntimeError(
                f"{self._skipped_in_row} optimiser steps in a row had a non-finite loss, gradient or result "
                "and were skipped or rolled back "
                f"(train.max_skipped_in_row={cfg.train.max_skipped_in_row}); check update.lr and the rewards"
            )
        self._empty_in_row = self._empty_in_row + 1 if row.get("reward_finite_frac", 1.0) == 0 else 0
        if self._empty_in_row >= cfg.reward.max_empty_steps:
            raise RuntimeError(
                f"{self._empty_in_row} steps in a row had no sample with a finite reward (every "
                f"reward None, NaN or inf; reward.max_empty_steps={cfg.reward.max_empty_steps}): "
                "nothing can be learned; check the reward functions"
            )

    def _request_stop(self, signum: int, frame: Any) -> None:
        if self._stop_requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: leave now, without waiting for the step's checkpoint
        self._stop_requested = signal.Signals(signum).name

    def _write_outputs(self, rows: list[dict[str, Any]]) -> None:
        """The outputs, each whole or not at all, in this order: ``final/`` (written aside, then
        swapped in), ``reward.png``, ``summary.json`` (atomic), and last ``FINISHED`` (the step and
        every output's size and sha256): a kill before it leaves the run to be completed by a rerun."""
        staging = self.out / f".final.tmp{os.getpid()}"
        if staging.exists():
            shutil.rmtree(staging)
        self.trainer.policy.save(staging)
        for role in self.trainer.roles:
            role.policy.save(staging / role.name)
        for name, actor in self.trainer.actors.items():
            actor.policy.save(staging / name)
        runfolder.publish_dir(staging, self.out / "final")
        plot_rewards(rows, self.summary["evals"], self.out / "reward.png")
        runfolder.write_atomic(self.out / "summary.json", json.dumps(self.summary, indent=2, allow_nan=False) + "\n")
        outputs = sorted(p for p in (self.out / "final").rglob("*") if p.is_file())
        outputs += [p for p in (self.out / "reward.png", self.out / "summary.json") if p.exists()]
        runfolder.mark_finished(self.out, self.trainer.step, outputs)


class _Quiet:
    """Stand-in for the progress bar on ranks other than 0."""

    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def add_task(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def update(self, *args: Any, **kwargs: Any) -> None:
        return None
