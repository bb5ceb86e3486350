"""GRPO in one file: the groupwise demo (`groupwise train demo`, src/groupwise/recipes/demo.toml) written
out top to bottom with nothing but torch and transformers. Read this page first; the library is
the same loop split into components that compose.

    python examples/grpo_in_one_file.py            # from the repository root, CPU, about two minutes

GRPO: "DeepSeekMath", Shao et al. 2024, https://arxiv.org/abs/2402.03300 (group-relative advantage,
§4.1.2), with PPO's clipped surrogate (Schulman et al. 2017, https://arxiv.org/abs/1707.06347).

The model is the tiny Qwen3 shipped in src/groupwise/models/default (0.83M parameters, 319 tokens, each
digit its own token, warm-started by supervised fine-tuning to 28.8 % greedy accuracy on the held-out
problems). The task is two-number addition: prompt "37+45=", answer "82". One training step:

  1. draw 32 prompts and sample 8 completions of each at temperature 1        sample()
  2. reward 1.0 when the completion, stripped, equals the sum, else 0.0         exact_reward()
  3. advantage = (reward - group mean) / (group std + 1e-4)                     group_advantages()
  4. loss = mean over completions of the token mean of                           grpo_loss()
            -min(ratio * adv, clip(ratio, 1 - 0.2, 1 + 0.2) * adv),  ratio = exp(logp - logp_old)
  5. one AdamW step (lr 2e-4, betas 0.9/0.99, no weight decay), gradient norm clipped to 1

and every --eval-every steps the greedy accuracy on held-out problems. tests/test_one_file.py checks that
the loss and gradient of steps 3-4 on one batch equal the library's (plain path) and runs this file.

Departures from the library's demo run (each to keep this page short):
- Sampling is transformers' model.generate with torch's global RNG. The library has its own KV-cache
  engine that draws row j of prompt k from a seed of (seed, step, k, j): the same --seed gives other
  samples here, so the numbers differ from `groupwise train demo`'s while the algorithm is the same.
- The training forward is one left-padded batch through the model's own forward. The library packs rows
  without padding, computes each group's prompt once and runs its own decoder maths: the same
  log-probs to float rounding (tests/test_plain_path.py).
- Every completion has a reward: no excluded rows (NaN rewards), no ragged groups, no reward errors.
- The group statistics are float32 (the library's are float64): the same values for 0/1 rewards.
- No micro-batching, KL term (the demo has none), non-finite-step skipping, checkpoints, resume or
  metrics files; the held-out accuracy is printed, not written. --max-seconds (training time, evaluation
  not counted) is 120 where the demo's train.max_seconds is 170.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

EMBEDDED_MODEL = Path(__file__).resolve().parent.parent / "src" / "groupwise" / "models" / "default"


# ----------------------------------------------------------------------------------------- the task
def arithmetic_rows(split: str) -> list[dict]:
    """Two-number addition, 0 <= a, b < 100: 10,000 problems in a fixed shuffled order, the first 500
    held out ("test"), the other 9,500 for training ("train"), as in groupwise/tasks/arithmetic.py."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(1234).shuffle(pairs)  # the library's split seed: the same held-out problems
    pairs = pairs[:500] if split == "test" else pairs[500:]
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]


def exact_reward(completion: str, answer: str) -> float:
    """1.0 when the completion, without surrounding whitespace, is the answer (groupwise/rewards/exact.py)."""
    return 1.0 if completion.strip() == answer else 0.0


def prompt_batches(rows: list[dict], size: int, seed: int):
    """Endless batches of ``size`` rows: epochs over a permutation seeded by seed + epoch, so no row
    repeats within an epoch (the library's ``uniform`` sampler: with one seed both draw the same rows)."""
    epoch, order = 0, []
    while True:
        while len(order) < size:  # a batch that crosses an epoch's end continues into the next permutation
            shuffle = torch.Generator().manual_seed(seed + epoch)
            order += torch.randperm(len(rows), generator=shuffle).tolist()
            epoch += 1
        batch, order = order[:size], order[size:]
        yield [rows[i] for i in batch]


# ------------------------------------------------------------------------------------------ sampling
@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], n: int, max_new_tokens: int, temperature=1.0, greedy=False):
    """``n`` completions of each prompt, rows of one prompt adjacent (N = len(prompts) * n rows).

    Returns ``input_ids`` [N,L] (left-padded prompt, then the completion), ``attention_mask`` [N,L]
    (1 on real tokens), ``completion_mask`` [N,L] (True on completion tokens up to and including the
    first EOS: the tokens that get loss) and the N completion texts (EOS and padding removed)."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    enc = tokenizer([p for p in prompts for _ in range(n)], return_tensors="pt", padding=True)  # [N,P] left-padded
    how = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)  # top_k=0: the whole vocabulary
    how = dict(do_sample=False) if greedy else how
    input_ids = model.generate(**enc, **how, max_new_tokens=max_new_tokens, pad_token_id=pad)  # [N,L], L = P + T
    completion = input_ids[:, enc.input_ids.shape[1] :]  # [N,T] a row that ended is padded after its EOS
    is_eos = completion == eos  # [N,T]
    keep = (is_eos.cumsum(-1) - is_eos.long()) == 0  # [N,T] no EOS before it: up to and including the first EOS
    completion_mask = torch.cat([torch.zeros_like(enc.attention_mask, dtype=torch.bool), keep], 1)  # [N,L]
    attention_mask = torch.cat([enc.attention_mask, keep.long()], 1)  # [N,L]
    texts = tokenizer.batch_decode(completion.masked_fill(~keep, pad), skip_special_tokens=True)  # N strings
    return input_ids, attention_mask, completion_mask, texts


@torch.no_grad()
def accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int, batch: int = 500) -> float:
    """Greedy accuracy: the fraction of ``rows`` whose greedy completion earns reward 1."""
    correct = 0.0
    for start in range(0, len(rows), batch):
        part = rows[start : start + batch]
        *_, texts = sample(model, tokenizer, [r["prompt"] for r in part], 1, max_new_tokens, greedy=True)
        correct += sum(exact_reward(t, r["answer"]) for t, r in zip(texts, part))
    return correct / max(1, len(rows))


# ------------------------------------------------------------------------------- advantages and loss
def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """[B,G] rewards (G completions of each of B prompts) -> [B,G] advantages: each reward centred on
    its group's mean and divided by its group's std (Bessel-corrected, as torch.std) + eps. A group
    whose rewards are all equal teaches nothing: its advantages are exactly 0."""
    mean = rewards.mean(dim=1, keepdim=True)  # [B,1]
    std = rewards.std(dim=1, keepdim=True)  # [B,1] 0 for a constant group, where r - mean is exactly 0 too
    return (rewards - mean) / (std + eps)  # [B,G]


def sequence_logprobs(model, input_ids, attention_mask, completion_mask) -> torch.Tensor:
    """[N,L] log-probability of each completion token given everything before it, 0 elsewhere, from
    the tensors ``sample`` returns. Differentiable: this is the training forward."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [N,L] each row's first real token is at 0
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits  # [N,L,V]
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [N,L-1,V] position t predicts token t+1
    logp = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [N,L-1] log p(token t+1 | tokens <= t)
    logp = torch.nn.functional.pad(logp, (1, 0))  # [N,L] aligned with input_ids (token 0 is a prompt token)
    return torch.where(completion_mask, logp, 0.0)  # [N,L] padding and prompt tokens carry no log-prob


def grpo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> torch.Tensor:
    """PPO's clipped surrogate per token, averaged over each completion's tokens, then over completions.

    ``logp``, ``logp_old`` [N,L] (current and sampling-time log-probs), ``adv`` [N] (one per completion),
    ``mask`` [N,L] (the completion tokens)."""
    ratio = torch.exp(torch.where(mask, logp - logp_old, 0.0))  # [N,L] 1 outside the mask: padding cannot overflow
    adv = adv[:, None]  # [N,1] a completion's advantage is every one of its tokens' advantage
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)  # [N,L] no gain past the clip
    per_row = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [N] token mean: each completion weighs the same
    return per_row.mean()  # [] mean over completions


# ------------------------------------------------------------------------------------------ training
def adamw(model, lr: float) -> torch.optim.AdamW:
    """The library's AdamW: betas (0.9, 0.99), eps 1e-8 and no weight decay (torch's default is 0.01)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="GRPO on the embedded model and two-number addition",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=str(EMBEDDED_MODEL), help="a local Hugging Face model folder")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--max-seconds", type=float, default=120.0, help="stop after this much training time (0: no limit)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--epochs", type=int, default=1, help="updates per rollout (the clip only acts from the second)")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--eps-low", type=float, default=0.2)
    p.add_argument("--eps-high", type=float, default=0.2)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--eval-size", type=int, default=500, help="held-out problems for the greedy accuracy")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    # 1: on two busy cores, 2 threads made this run 4x slower (a thread waits for its descheduled peer)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default, one per core)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)  # model.generate draws from torch's global RNG
    hf_logging.disable_progress_bar()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)  # left padding: each prompt ends where its completion starts
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = adamw(model, args.lr)
    train_rows, test_rows = arithmetic_rows("train"), arithmetic_rows("test")[: args.eval_size]
    batches = prompt_batches(train_rows, args.prompts, args.seed)
    B, G = args.prompts, args.group

    before = accuracy(model, tokenizer, test_rows, args.max_new_tokens)
    print(f"held-out greedy accuracy before: {before:.3f} ({len(test_rows)} problems)")
    history, started, trained = [], time.perf_counter(), 0.0
    for step in range(args.steps):
        t0 = time.perf_counter()
        rows = next(batches)  # B dataset rows
        prompts, answers = [r["prompt"] for r in rows], [r["answer"] for r in rows for _ in range(G)]
        input_ids, attention_mask, completion_mask, texts = sample(
            model, tokenizer, prompts, G, args.max_new_tokens, args.temperature
        )  # [N,L] x3, N = B*G
        rewards = torch.tensor([exact_reward(t, a) for t, a in zip(texts, answers)]).view(B, G)  # [B,G]
        adv = group_advantages(rewards).view(-1)  # [N] row b*G + g is completion g of prompt b

        for epoch in range(args.epochs):
            logp = sequence_logprobs(model, input_ids, attention_mask, completion_mask)  # [N,L]
            if epoch == 0:
                logp_old = logp.detach()  # the weights have not moved yet: these are the sampler's log-probs
            # epoch 0 is on-policy: ratio = 1, so the loss is -mean(adv) ~ 0, but its gradient is REINFORCE's,
            # -mean over completions of adv · (token mean of ∇logp)
            loss = grpo_loss(logp, logp_old, adv, completion_mask, args.eps_low, args.eps_high)  # []
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # [] (before the clip)
            optimizer.step()
        trained += time.perf_counter() - t0

        history.append(
            {"step": step, "reward": rewards.mean().item(), "loss": loss.item(), "grad_norm": grad_norm.item()}
        )
        if step % args.log_every == 0 or step == args.steps - 1:
            recent = history[-args.log_every :]  # the sampled reward is noisy: the mean of the last steps
            print(
                f"step {step:4d}  reward {sum(h['reward'] for h in recent) / len(recent):.3f}"
                f"  grad norm {grad_norm.item():.3f}  {trained:6.1f} s"
            )
        if args.eval_every and step > 0 and step % args.eval_every == 0:
            acc = accuracy(model, tokenizer, test_rows, args.max_new_tokens)
            print(f"step {step:4d}  held-out greedy accuracy {acc:.3f}")
        if args.max_seconds and trained > args.max_seconds:
            print(f"stopping after step {step}: {trained:.1f} s of training (--max-seconds {args.max_seconds:g})")
            break

    after = accuracy(model, tokenizer, test_rows, args.max_new_tokens)
    print(
        f"held-out greedy accuracy after {len(history)} steps ({trained:.1f} s of training, "
        f"{time.perf_counter() - started:.1f} s in all): {before:.3f} -> {after:.3f}"
    )
    return {
        "accuracy_before": before,
        "accuracy_after": after,
        "steps": len(history),
        "train_seconds": trained,
        "history": history,
    }


if __name__ == "__main__":
    main()
