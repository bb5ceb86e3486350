"""``groupwise warmstart``: rebuild the embedded default model from scratch.

Trains the tokenizer (:func:`groupwise.models.build.train_tokenizer`), builds the ``tiny``
Qwen3, and fine-tunes it with supervised learning on ``prompt + answer + <|endoftext|>`` rows of
the task's train split (loss on the answer and EOS tokens only) — the ``sft`` phase
(:mod:`groupwise.phases.sft`), here on a freshly built model. Every ``--eval-every`` steps it
measures greedy exact-match accuracy on a validation slice carved out of the train split (never
trained on) and stops as soon as that accuracy reaches ``--target-accuracy``: the point is a model
that *almost* knows the task, so that GRPO has room to improve it. It then measures greedy accuracy,
temperature-1 sample accuracy and pass@k on the held-out test split, and saves model, tokenizer,
configs and a ``warmstart.json`` record to ``--out`` (default: the package's ``models/default``).

Run ``groupwise warmstart --help`` (or ``python -m groupwise.models.warmstart --help``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from groupwise.models.build import (
    DEFAULT_VOCAB_SIZE,
    PRESETS,
    build_model,
    count_parameters,
    default_tokenizer_corpus,
    save_pretrained,
    train_tokenizer,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "default"


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def load_rows(task_names: Sequence[str], split: str, n: int, seed: int) -> list[dict]:
    """Rows of ``split`` from each task in ``task_names`` (``n`` per task; ``n <= 0`` means all)."""
    from groupwise.tasks import get_task

    rows: list[dict] = []
    for name in task_names:
        rows.extend(get_task(name).rows(split, n, seed))
    return rows


# --------------------------------------------------------------------------------------------
# Generation and evaluation
# --------------------------------------------------------------------------------------------


def _cache_keyword(model) -> str:
    """The name under which this transformers version's ``forward`` takes the KV cache."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _returned_cache(output):
    """The KV cache of a forward output, whichever name this transformers version uses."""
    cache = output.get("cache")
    return cache if cache is not None else output.get("past_key_values")


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int,
    temperature: float = 0.0,
    num_samples: int = 1,
    generator: torch.Generator | None = None,
    batch_size: int = 1024,
) -> list[list[str]]:
    """Decode ``num_samples`` completions per prompt; ``temperature == 0`` means greedy.

    Prompts are bucketed by token length, so every batch is padding-free and positions need no
    bookkeeping; decoding uses the KV cache. A completion is the text before the first EOS (or all
    ``max_new_tokens`` tokens if none). Returns one list of ``num_samples`` strings per prompt.
    Sampling draws from ``generator``, so a seeded generator makes it reproducible.
    """
    was_training = model.training
    model.eval()
    eos_id = tokenizer.eos_token_id
    cache_key = _cache_keyword(model)
    encoded = [tokenizer.encode(prompt, add_special_tokens=False) for prompt in prompts]
    buckets: dict[int, list[int]] = {}
    for index, ids in enumerate(encoded):
        buckets.setdefault(len(ids), []).append(index)

    completions: list[list[str]] = [[] for _ in prompts]
    for length in sorted(buckets):
        # Each prompt repeated num_samples times, consecutively: row r is prompt r // num_samples.
        rows = [index for index in buckets[length] for _ in range(num_samples)]
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            input_ids = torch.tensor([encoded[index] for index in chunk])  # [N, P]
            output = model(input_ids=input_ids, use_cache=True)
            new_tokens = []
            finished = torch.zeros(len(chunk), dtype=torch.bool)  # [N]
            for _ in range(max_new_tokens):
                logits = output.logits[:, -1].float()  # [N, V]
                if temperature > 0:
                    probs = torch.softmax(logits / temperature, dim=-1)  # [N, V]
                    token = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # [N]
                else:
                    token = logits.argmax(dim=-1)  # [N]
                token = torch.where(finished, torch.full_like(token, eos_id), token)  # [N]
                new_tokens.append(token)
                finished |= token == eos_id
                if bool(finished.all()):
                    break
                output = model(input_ids=token[:, None], use_cache=True, **{cache_key: _returned_cache(output)})
            generated = torch.stack(new_tokens, dim=1).tolist()  # [N, T]
            for index, ids in zip(chunk, generated):
                if eos_id in ids:
                    ids = ids[: ids.index(eos_id)]
                completions[index].append(tokenizer.decode(ids, skip_special_tokens=False))
    model.train(was_training)
    return completions


def max_answer_tokens(tokenizer, rows: Sequence[dict]) -> int:
    """Length in tokens of the longest answer among ``rows``."""
    return max(len(tokenizer.encode(row["answer"], add_special_tokens=False)) for row in rows)


def greedy_accuracy(model, tokenizer, rows: Sequence[dict], max_new_tokens: int | None = None) -> float:
    """Fraction of ``rows`` whose greedy completion, stripped, equals the answer exactly."""
    if max_new_tokens is None:
        max_new_tokens = max_answer_tokens(tokenizer, rows) + 2
    completions = generate(model, tokenizer, [row["prompt"] for row in rows], max_new_tokens)
    correct = [samples[0].strip() == row["answer"] for samples, row in zip(completions, rows)]
    return sum(correct) / len(rows)


def sampled_metrics(
    model, tokenizer, rows: Sequence[dict], k: int = 8, temperature: float = 1.0, seed: int = 0, max_new_tokens: int | None = None
) -> dict[str, float]:
    """Temperature sampling, ``k`` completions per row.

    Returns ``sample_accuracy`` (fraction of all completions that are correct), ``pass_at_k``
    (fraction of rows with at least one correct completion) and ``mixed_groups`` (fraction of rows
    whose ``k`` completions are neither all right nor all wrong: the groups in which GRPO's
    group-normalised advantage is non-zero).
    """
    if max_new_tokens is None:
        max_new_tokens = max_answer_tokens(tokenizer, rows) + 2
    generator = torch.Generator().manual_seed(seed)
    completions = generate(
        model, tokenizer, [row["prompt"] for row in rows], max_new_tokens, temperature, num_samples=k, generator=generator
    )
    correct_counts = [sum(sample.strip() == row["answer"] for sample in samples) for samples, row in zip(completions, rows)]
    return {
        "sample_accuracy": sum(correct_counts) / (k * len(rows)),
        f"pass_at_{k}": sum(count > 0 for count in correct_counts) / len(rows),
        "mixed_groups": sum(0 < count < k for count in correct_counts) / len(rows),
    }


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="groupwise warmstart",
        description="Rebuild the embedded default model: train the tokenizer, build the tiny Qwen3, and "
        "fine-tune it on a task until held-out greedy accuracy reaches a target (partial) accuracy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder to save the model to")
    parser.add_argument("--task", default="arithmetic", help="task to fine-tune on; a comma list mixes tasks, "
                        "and the first one's accuracy decides when to stop")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--target-accuracy", type=float, default=0.30,
                        help="stop as soon as validation greedy accuracy reaches this")
    parser.add_argument("--max-steps", type=int, default=5000, help="give up (and save anyway) after this many steps")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--eval-every", type=int, default=25, help="steps between validation checks")
    parser.add_argument("--fine-eval-every", type=int, default=5,
                        help="steps between validation checks once accuracy passes half the target (accuracy "
                        "climbs steeply there, and coarse checks would overshoot the target)")
    parser.add_argument("--val-size", type=int, default=500,
                        help="train-split rows held out of fine-tuning to decide when to stop")
    parser.add_argument("--train-size", type=int, default=0,
                        help="fine-tuning rows per task (0: the whole train split less the validation slice)")
    parser.add_argument("--test-size", type=int, default=500, help="test-split rows for the final measurements")
    parser.add_argument("--k", type=int, default=8, help="samples per prompt for pass@k at temperature 1")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads; 1 is fastest for this tiny model on a shared CPU, and keeps "
                        "results identical across machines")
    parser.add_argument("--hint-rate", type=float, default=0.0,
                        help="add this share of the fine-tuning rows a second time with the answer written into the prompt (--hint-template)")
    parser.add_argument("--hint-template", default="Reference solution: {answer}\n{prompt}",
                        help="prompt of a hinted row, formatted with the row's columns (the ground_truth view's default)")
    parser.add_argument("--merge-digits", action="store_true",
                        help="a tokenizer without per-digit pre-tokenisation: digit runs merge (models/peer)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``groupwise warmstart``; returns the process exit status (0)."""
    run(argv)
    return 0


def run(argv: list[str] | None = None) -> dict:
    """Run the warm start; returns the record also written to ``OUT/warmstart.json``."""
    from transformers.utils import logging as hf_logging

    args = build_parser().parse_args(argv)
    given = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["groupwise warmstart", shlex.join(given)]).rstrip()
    # Process-wide settings, restored afterwards so that an in-process call leaves no trace.
    threads_before, bars_before = torch.get_num_threads(), hf_logging.is_progress_bar_enabled()
    torch.set_num_threads(args.threads)
    if args.quiet:
        hf_logging.disable_progress_bar()
    try:
        return _warm_start(args, command)
    finally:
        torch.set_num_threads(threads_before)
        if bars_before:
            hf_logging.enable_progress_bar()


def _warm_start(args: argparse.Namespace, command: str) -> dict:
    """The body of :func:`run`, on parsed arguments."""
    started = time.perf_counter()
    log = _Logger(quiet=args.quiet)

    # Data: the stop-deciding validation slice is carved out of the train split and never trained on.
    task_names = [name.strip() for name in args.task.split(",") if name.strip()]
    primary = task_names[0]
    primary_train = load_rows([primary], "train", 0, args.seed)
    random.Random(args.seed).shuffle(primary_train)
    val_rows, sft_rows = primary_train[: args.val_size], primary_train[args.val_size :]
    if args.train_size > 0:
        sft_rows = sft_rows[: args.train_size]
    sft_rows = sft_rows + load_rows(task_names[1:], "train", args.train_size, args.seed)
    if args.hint_rate > 0:  # rows that also show the answer in the context: a model that can read a hint (GEAR's teacher view)
        pick = random.Random(args.seed + 1)
        sft_rows = sft_rows + [dict(row, prompt=args.hint_template.format(**row)) for row in sft_rows if pick.random() < args.hint_rate]
    test_rows = load_rows([primary], "test", args.test_size, args.seed)

    # Tokenizer and model.
    tokenizer = train_tokenizer(
        default_tokenizer_corpus(), vocab_size=args.vocab_size, split_digits=not args.merge_digits
    )
    model = build_model(len(tokenizer), args.preset, eos_token_id=tokenizer.eos_token_id, seed=args.seed)
    n_params = count_parameters(model)
    log(f"tokenizer: {len(tokenizer)} tokens; model: {args.preset}, {n_params:,} parameters; "
        f"{len(sft_rows)} fine-tuning rows, {len(val_rows)} validation rows, {len(test_rows)} test rows")

    # Fine-tuning is the sft phase (groupwise.phases.sft) on a policy around the fresh model.
    import tempfile

    from groupwise.config import ModelCfg, PerfCfg
    from groupwise.phases.sft import SFT
    from groupwise.policy.lm import LMPolicy

    max_new = max_answer_tokens(tokenizer, val_rows + test_rows) + 2
    phase = SFT(steps=args.max_steps, batch_size=args.batch_size, target_accuracy=args.target_accuracy, eval_every=args.eval_every,
                fine_eval_every=args.fine_eval_every, val_size=len(val_rows),
                update={"name": "adamw", "lr": args.lr, "betas": [0.9, 0.98], "weight_decay": args.weight_decay,
                        "warmup_steps": args.warmup_steps, "max_grad_norm": 1.0})
    with tempfile.TemporaryDirectory() as fresh:
        save_pretrained(model, tokenizer, Path(fresh))
        policy = LMPolicy(ModelCfg(path=fresh), PerfCfg())
    with log.progress(args.max_steps) as advance:
        result = phase.fit(policy, sft_rows, val_rows, args.seed, lambda split, rows, i: policy.encode(rows[i]["prompt"]),
                           lambda p, rows, split: greedy_accuracy(p.module, tokenizer, rows, max_new),
                           on_step=lambda step, loss, accuracy: advance(loss, accuracy))
    model, step, val_accuracy, reached, history = policy.module, result["steps"], result["val_accuracy"], result["reached_target"], result["history"]
    for row in history:
        log(f"step {row['step']:5d}  loss {row['loss']:.4f}  validation greedy accuracy {row['val_accuracy']:.1%}")
    train_seconds = time.perf_counter() - started
    if not reached:
        log(f"warning: validation accuracy {val_accuracy:.1%} did not reach {args.target_accuracy:.1%} in {step} steps")

    # Final, held-out measurements.
    model.eval()
    test_greedy = greedy_accuracy(model, tokenizer, test_rows, max_new)
    test_greedy_100 = greedy_accuracy(model, tokenizer, test_rows[:100], max_new)  # what the tests recompute
    sampled = sampled_metrics(model, tokenizer, test_rows, k=args.k, temperature=1.0, seed=args.seed, max_new_tokens=max_new)
    record = {
        "command": command,
        "seed": args.seed,
        "args": {key: _portable(value) for key, value in vars(args).items()},
        "task": args.task,
        "preset": args.preset,
        "parameters": n_params,
        "vocab_size": len(tokenizer),
        "steps": step,
        "examples_seen": step * args.batch_size,
        "reached_target": reached,
        "train_seconds": round(train_seconds, 1),
        "val_greedy_accuracy": val_accuracy,
        "test_greedy_accuracy": test_greedy,
        "test_rows": len(test_rows),
        "test_greedy_accuracy_first_100": test_greedy_100,
        "test_sample_accuracy_t1": sampled["sample_accuracy"],
        f"test_pass_at_{args.k}_t1": sampled[f"pass_at_{args.k}"],
        f"test_mixed_groups_{args.k}_t1": sampled["mixed_groups"],
        "history": history,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "tokenizers": __import__("tokenizers").__version__,
        },
    }
    out = save_pretrained(model, tokenizer, args.out)
    record["wall_seconds"] = round(time.perf_counter() - started, 1)
    (out / "warmstart.json").write_text(json.dumps(record, indent=2) + "\n")
    log(f"test greedy accuracy {test_greedy:.1%}; T=1: sample accuracy {sampled['sample_accuracy']:.1%}, "
        f"pass@{args.k} {sampled[f'pass_at_{args.k}']:.1%}, mixed groups {sampled['mixed_groups']:.1%}; "
        f"{step} steps, {record['wall_seconds']:.0f} s; saved to {out}")
    return record


def _portable(value):
    """An argument value for ``warmstart.json``: paths inside the package relative to it, others as text."""
    if not isinstance(value, Path):
        return value
    package = Path(__file__).resolve().parents[1]
    try:
        return "<groupwise>/" + value.resolve().relative_to(package).as_posix()
    except ValueError:
        return str(value)


class _Logger:
    """A line per message, and a ``rich`` progress bar over fine-tuning steps unless quiet."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self._console = None

    def __call__(self, message: str) -> None:
        if self.quiet:
            return
        if self._console is not None:
            self._console.print(message)
        else:
            print(message, flush=True)

    def progress(self, total: int):
        """Context manager yielding ``advance(loss, val_accuracy)``."""
        logger = self

        class _Context:
            def __enter__(self):
                if logger.quiet:
                    return lambda loss, accuracy: None
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

                self.bar = Progress(
                    TextColumn("warm start"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.description}"),
                )
                self.bar.__enter__()
                logger._console = self.bar.console
                task = self.bar.add_task("", total=total)

                def advance(loss: float, accuracy: float) -> None:
                    self.bar.update(task, advance=1, description=f"loss {loss:.3f}  val acc {accuracy:.1%}")

                return advance

            def __exit__(self, *exc):
                if not logger.quiet:
                    self.bar.__exit__(*exc)
                    logger._console = None
                return False

        return _Context()


if __name__ == "__main__":
    sys.exit(main())
