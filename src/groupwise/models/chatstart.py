"""``python -m groupwise.models.chatstart``: build the shipped chat model ``models/chat`` from ``models/default``.

The embedded model (a tiny Qwen3, ``models/README.md``) with a chat template and a tool-call format,
warm-started by supervised fine-tuning on a generated tool-use corpus:

1. **Tokenizer**: the default tokenizer plus ``<|im_start|>`` and ``<|im_end|>`` (special; ``<|im_end|>``
   ends a turn and is the EOS) and ``<tool_call>`` / ``</tool_call>`` (plain added tokens, kept by
   decoding so the parser sees them); the chat template ``TEMPLATE`` (ChatML turns, the tool list in a
   one-line system message, Hermes tool calls, ``{% generation %}`` markers on assistant turns).
2. **Model**: the default model's weights, the embedding grown by the four new rows (transformers'
   mean resizing), context 256 positions (RoPE: no new parameters).
3. **SFT** on conversations of the ``calc`` task's train split (``tasks/calc.py``)::

       user "482*739="  ->  assistant <tool_call>{"name":"calculator","arguments":{"expression":"482*739"}}</tool_call>
       tool "356198"    ->  assistant "356198"

   loss on the assistant tokens only (``rollout/chat.py``'s ``assistant_mask``: the template's markers),
   AdamW, batches of ``--batch`` conversations. Every ``--eval-every`` steps the greedy tool-use success
   (the final answer is right) on a validation slice of the train split is measured; training stops at
   the first check reaching ``--target`` (a model that *partly* uses the tool, so RL has room), or at
   ``--steps``. The record (arguments, checks, test-split success, wall time) is ``chatstart.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).resolve().parent / "chat"
BASE = Path(__file__).resolve().parent / "default"
SPECIAL = ["<|im_start|>", "<|im_end|>"]
CALL_TOKENS = ["<tool_call>", "</tool_call>"]
CONTEXT = 256

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools:{% for t in tools %}"
    "{% set f = t.get('function', t) %} {{ f.name }}({{ f.parameters.properties | list | join(',') }})"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ m.content or '' }}"
    "{%- for tc in (m.tool_calls or []) %}{% set f = tc.get('function', tc) %}"
    '<tool_call>{"name":{{ f.name | tojson }},"arguments":{{ f.arguments | tojson }}}</tool_call>'
    "{%- endfor %}<|im_end|>{% endgeneration %}{{ '\\n' }}"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer_and_model(base: Path = BASE):
    """The default model with the chat tokens, template and a 256-position context (not fine-tuned)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.add_tokens(CALL_TOKENS)
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.chat_template = TEMPLATE
    tokenizer.model_max_length = CONTEXT
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # mean resizing draws the new rows
        model.resize_token_embeddings(len(tokenizer))
    model.config.max_position_embeddings = CONTEXT
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return tokenizer, model


def conversation(row: dict) -> list[dict]:
    """The demonstration of one ``calc`` row: call the calculator, then copy its result."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": row["expression"]}}, separators=(",", ":"))
    return [
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "tool", "name": "calculator", "content": row["answer"]},
        {"role": "assistant", "content": row["answer"]},
    ]


def batch_tensors(tokenizer, rows: list[dict], schemas: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [N,L], attention [N,L], labels [N,L]): right-padded conversations, labels -100 off the assistant."""
    from groupwise.rollout.chat import assistant_mask

    pairs = [assistant_mask(tokenizer, conversation(r), schemas) for r in rows]
    L = max(len(ids) for ids, _ in pairs)
    ids = torch.full((len(rows), L), tokenizer.pad_token_id, dtype=torch.long)  # [N,L]
    attn = torch.zeros(len(rows), L, dtype=torch.long)  # [N,L]
    labels = torch.full((len(rows), L), -100, dtype=torch.long)  # [N,L]
    for i, (x, m) in enumerate(pairs):
        ids[i, : len(x)], attn[i, : len(x)] = torch.tensor(x), 1
        labels[i, : len(x)] = torch.where(torch.tensor(m), torch.tensor(x), torch.tensor(-100))
    return ids, attn, labels


@torch.no_grad()
def tool_success(model, tokenizer, rows: list[dict], schemas: list, max_new_tokens: int = 64) -> dict:
    """Greedy episodes (up to two assistant turns): the share whose final answer is right, and the share
    whose first turn is a well-formed calculator call."""
    from groupwise.models.warmstart import generate
    from groupwise.rollout.chat import render
    from groupwise.rollout.tools import calculator, parse_hermes

    messages = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    texts = [render(tokenizer, m, schemas, generation_prompt=True) for m in messages]
    first = [c[0] for c in generate(model, tokenizer, texts, max_new_tokens)]
    called, finals, again = 0, [None] * len(rows), []
    for i, text in enumerate(first):
        calls = parse_hermes(text)
        if not calls:
            finals[i] = text
            continue
        ok = len(calls) == 1 and not calls[0].error and calls[0].name == "calculator"
        called += ok
        try:
            result = calculator(**calls[0].arguments) if ok else '{"error": "bad call"}'
        except Exception as err:
            result = json.dumps({"error": str(err)})
        messages[i] += [
            {"role": "assistant", "content": text},
            {"role": "tool", "name": "calculator", "content": result},
        ]
        again.append(i)
    second = generate(model, tokenizer, [render(tokenizer, messages[i], schemas, True) for i in again], max_new_tokens)
    for i, c in zip(again, second):
        finals[i] = c[0]
    right = sum(str(f).strip() == r["answer"] for f, r in zip(finals, rows))
    return {"success": right / len(rows), "called": called / len(rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--target", type=float, default=0.4, help="stop at this validation tool-use success")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--val", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from groupwise.models.build import save_pretrained
    from groupwise.rollout.tools import calculator, schema
    from groupwise.tasks.calc import rows as calc_rows

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    tokenizer, model = chat_tokenizer_and_model()
    schemas = [schema(calculator)]
    train = calc_rows("train", 0, args.seed)
    val, train = train[: args.val], train[args.val :]
    rng = random.Random(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    checks, start, step = [], time.time(), 0
    model.train()
    for step in range(1, args.steps + 1):
        ids, attn, labels = batch_tensors(tokenizer, rng.sample(train, args.batch), schemas)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.eval_every == 0:
            measured = tool_success(model, tokenizer, val, schemas)
            check = {"step": step, "loss": round(float(loss.detach()), 4), **measured}
            checks.append(check)
            print(json.dumps(check), flush=True)
            save_pretrained(model, tokenizer, args.out)  # the latest check's weights, should the fit be stopped
            if check["success"] >= args.target:
                break
    model.eval()
    test = tool_success(model, tokenizer, calc_rows("test", 0, 0), schemas)
    save_pretrained(model, tokenizer, args.out)
    record = {
        "command": "python -m groupwise.models.chatstart " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "args": vars(args),
        "steps": step,
        "checks": checks,
        "test": test,
        "wall_s": round(time.time() - start, 1),
        "torch": torch.__version__,
    }
    (Path(args.out) / "chatstart.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["test"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
