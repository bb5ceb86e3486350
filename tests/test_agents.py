"""Agents on chat models (issue 40): chat transcripts (assistant masks two ways), tool calls (schemas,
Hermes parsing, execution, errors as tool messages), the ``agent`` rollout strategy on a scripted chat
policy (rows, holes, segments, rewards, cuts, samples.jsonl) and through the trainer on the shipped
chat model."""

from __future__ import annotations

import json
import time

import pytest
import torch

from groupwise.config import RewardCfg
from groupwise.errors import ConfigError
from groupwise.models.chatstart import conversation
from groupwise.registry import build
from groupwise.rewards.stage import RewardStage
from groupwise.rollout.chat import assistant_mask, render
from groupwise.rollout.context import RolloutContext
from groupwise.rollout.tools import Call, Toolbox, calculator, parse_hermes, schema
from groupwise.types import Rollout, StepInfo


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from groupwise.models.chatstart import DEFAULT_OUT

    return AutoTokenizer.from_pretrained(DEFAULT_OUT)  # the shipped chat model's tokenizer and template


CALL = '<tool_call>{"name":"calculator","arguments":{"expression":"12*34"}}</tool_call>'


def sleepy(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: how long to sleep.
    """
    time.sleep(seconds)
    return "slept"


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: ignored.
    """
    raise RuntimeError("boom")


# ---------------------------------------------------------------------------------------------- transcripts
def test_assistant_mask_markers_and_prefix_diff_agree(tok):
    row = {"prompt": "12*34=", "expression": "12*34", "answer": "408"}
    messages = conversation(row)
    tools = [schema(calculator)]
    ids, marked = assistant_mask(tok, messages, tools, "markers")
    ids2, diffed = assistant_mask(tok, messages, tools, "diff")
    assert ids == ids2 and marked == diffed
    own = tok.decode([t for t, m in zip(ids, marked) if m])
    # exactly the two assistant turns, each with its end-of-turn token, nothing the template wrote around them
    assert own == CALL + "<|im_end|>" + "408<|im_end|>"
    assert tok.decode(ids) == render(tok, messages, tools)


def test_diff_fallback_on_a_template_without_markers(tok):
    plain = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    saved = tok.chat_template
    try:
        tok.chat_template = plain
        ids, mask = assistant_mask(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "7"}])
        with pytest.raises(ConfigError, match="generation"):
            assistant_mask(tok, [{"role": "user", "content": "hi"}], method="markers")
    finally:
        tok.chat_template = saved
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "7<|im_end|>"  # the trailing newline is the template's


# ---------------------------------------------------------------------------------------------- tools
def test_schema_is_transformers_own_and_a_trl_tools_list_works_unchanged():
    s = schema(calculator)
    assert s["type"] == "function" and s["function"]["name"] == "calculator"
    assert s["function"]["parameters"]["properties"] == {
        "expression": {"type": "string", "description": 'The expression, e.g. "482*739".'}
    }
    box = Toolbox([calculator, "groupwise.rollout.tools:calculator"][:1])  # a TRL tools= list: the functions
    assert box.schemas == [s]

    def undocumented(x):
        return x

    with pytest.raises(ConfigError, match="type hints"):
        Toolbox([undocumented])
    with pytest.raises(ConfigError, match="two tools are named 'calculator'"):
        Toolbox([calculator, "groupwise.rollout.tools:calculator"])


def test_a_function_in_a_python_config_is_stored_as_its_import_spelling():
    from groupwise.config import toml_value

    assert toml_value([calculator]) == '["groupwise.rollout.tools:calculator"]'  # what a recipe would name
    with pytest.raises(ConfigError, match="top level of an importable module"):
        toml_value(lambda x: x)


def test_hermes_parsing_of_good_and_malformed_calls():
    assert parse_hermes("no call here") == []
    assert parse_hermes(CALL) == [Call("calculator", {"expression": "12*34"})]
    two = parse_hermes(CALL + ' <tool_call>{"name": "x", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert two[1] == Call("x", {"a": 1})  # arguments written as a JSON string are read too
    bad = parse_hermes("<tool_call>{name: calculator}</tool_call>")
    assert len(bad) == 1 and "not valid JSON" in bad[0].error
    assert "opened but not closed" in parse_hermes('<tool_call>{"name":"calcu')[0].error
    assert (
        "arguments must be a JSON object"
        in parse_hermes('<tool_call>{"name":"a","arguments":[1]}</tool_call>')[0].error
    )


def test_execution_results_errors_timeouts_and_counts():
    box = Toolbox([calculator, sleepy, broken], timeout=0.2)
    assert box.run(Call("calculator", {"expression": "12*34"})) == {
        "role": "tool",
        "name": "calculator",
        "content": "408",
    }
    errors = [
        box.run(Call("calculator", {"expression": "2**99"})),  # not allowed (no powers)
        box.run(Call("calculator", {"expr": "1"})),  # a wrong argument name
        box.run(Call("sleepy", {"seconds": 2.0})),  # the timeout
        box.run(Call("broken", {"x": 1})),
        box.run(Call("nope", {})),
        box.run(Call(error="the tool call is not valid JSON")),
    ]
    assert all("error" in json.loads(m["content"]) for m in errors)
    assert "within 0.2 s" in errors[2]["content"] and "boom" in errors[3]["content"]
    assert box.run(Call("sleepy", {"seconds": 0.0}))["content"] == "slept"  # a fresh worker after the timeout
    stats = box.stats()
    # calculator: 3 calls, 2 errors; sleepy: 2 calls, 1 error; broken: 1 of 1; 'nope' counts as a call of no tool
    assert stats["tools/calculator/calls"] == 3 and stats["tools/calculator/error_rate"] == pytest.approx(2 / 3)
    assert stats["tools/sleepy/calls"] == 2 and stats["tools/sleepy/error_rate"] == 0.5
    assert stats["tools/broken/error_rate"] == 1.0 and stats["tools/malformed"] == 1.0 and stats["tools/unknown"] == 1
    assert box.stats()["tools/calculator/calls"] == 0  # counts are per step


# ---------------------------------------------------------------------------------------------- the agent strategy
class ScriptedChat:
    """A chat policy whose episode e, turn t samples ``script[e][t]`` (its tokens, then <|im_end|>)."""

    modality, request_options = "text", frozenset({"greedy"})

    def __init__(self, tokenizer, script, max_turns=8, context=256, stop=None):
        self.tokenizer, self.script, self.max_turns, self.context = tokenizer, script, max_turns, context
        self.stop = tokenizer.eos_token_id if stop is None else stop  # the stop token every action ends with
        self.eos = sorted({tokenizer.eos_token_id, tokenizer.pad_token_id})  # as the policy: either stops

    def encode(self, text):
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def check_fits(self, ids, max_new_tokens, where):
        if len(ids) + max_new_tokens > self.context:
            raise ConfigError(f"{where}: too long")

    def decode(self, rollout):
        B, G, _ = rollout.shape
        return [
            [
                self.tokenizer.decode(rollout.actions[b, g][rollout.mask[b, g]].tolist(), skip_special_tokens=True)
                for g in range(G)
            ]
            for b in range(B)
        ]

    def generate(self, requests, sampling, info):
        ids = [
            self.encode(self.script[r.offset // self.max_turns][r.offset % self.max_turns]) + [self.stop]
            for r in requests
        ]
        T = max(len(x) for x in ids)
        actions = torch.zeros(len(requests), 1, T, dtype=torch.long)  # [R,1,T]
        for i, x in enumerate(ids):
            actions[i, 0, : len(x)] = torch.tensor(x)
        lengths = torch.tensor([[len(x)] for x in ids])  # [R,1]
        return Rollout(
            prompt_ids=[r.prompt for r in requests],
            actions=actions,
            mask=torch.arange(T) < lengths[..., None],
            group_valid=torch.ones(len(requests), 1, dtype=torch.bool),
            truncated=torch.zeros(len(requests), 1, dtype=torch.bool),
            prompt_index=torch.tensor([r.key for r in requests]),
            logp_sampler=torch.full((len(requests), 1, T), -0.5),
        )


class AllRows:
    max_rounds = 1

    def draw(self, n, info):
        return list(range(n))

    def keep(self, batch):
        return torch.ones(batch.shape[0], dtype=torch.bool)


def chat_ctx(tok, rows, script, group_size, max_new_tokens=40, context=256, stop=None):
    policy = ScriptedChat(tok, script, context=context, stop=stop)
    stage = RewardStage(["env_return"], RewardCfg(), policy.decode, 1)
    return RolloutContext(
        policy,
        AllRows(),
        stage,
        lambda r: None,
        lambda i: rows[i]["prompt"],
        lambda i: rows[i],
        lambda round_=0: StepInfo(step=0, seed=0, max_new_tokens=max_new_tokens),
        {"max_new_tokens": max_new_tokens},
        len(rows),
        group_size,
    )


ROW = {"prompt": "12*34=", "expression": "12*34", "answer": "408", "env": "answer"}


def test_agent_rows_are_sampled_tokens_with_rendered_holes(tok):
    # episode 0: a calculator call, then the right answer; episode 1: a malformed call, then a wrong answer
    script = [[CALL, "408"], ["<tool_call>{oops}</tool_call>", "400"]]
    strategy = build("rollout", "agent", tools=["groupwise.rollout.tools:calculator"])
    batch = strategy(chat_ctx(tok, [ROW], script, 2))
    assert batch.rewards.tolist() == [[1.0, 0.0]]
    tools = [schema(calculator)]
    enc = lambda s: list(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    first = [{"role": "user", "content": "12*34="}]
    assert batch.prompt_ids == [enc(render(tok, first, tools, generation_prompt=True))]
    im_end = tok.eos_token_id
    hole = enc("\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n")  # what the template writes after a_0
    want = enc(CALL) + [im_end] + hole + enc("408") + [im_end]
    n = len(want)
    assert batch.actions[0, 0, :n].tolist() == want and int(batch.mask[0, 0].sum()) == n
    own = [True] * (len(enc(CALL)) + 1) + [False] * len(hole) + [True] * (len(enc("408")) + 1)
    assert batch.loss_mask[0, 0, :n].tolist() == own
    seg = [0] * (len(enc(CALL)) + 1) + [-1] * len(hole) + [1] * (len(enc("408")) + 1)
    assert batch.segment_id[0, 0, :n].tolist() == seg
    # the whole row is the template's rendering of the final transcript (prefix-preserving template)
    log = batch.info[0][0]["log"]
    assert log["transcript"] == first + [
        {"role": "assistant", "content": CALL},
        {"role": "tool", "name": "calculator", "content": "408"},
        {"role": "assistant", "content": "408"},
    ]
    assert tok.decode(batch.prompt_ids[0] + want) + "\n" == render(tok, log["transcript"], tools)  # + the final newline
    assert [t["action"] for t in log["turns"]] == [enc(CALL) + [im_end], enc("408") + [im_end]]
    bad = batch.info[0][1]["log"]["transcript"][2]
    assert bad["role"] == "tool" and "not valid JSON" in json.loads(bad["content"])["error"]
    stats = strategy.step_stats()
    assert stats["agent/turns"] == 4 and stats["agent/tool_calls"] == 2 and stats["agent/success"] == 0.5
    assert stats["tools/calculator/calls"] == 1 and stats["tools/calculator/error_rate"] == 0.0
    assert stats["tools/malformed"] == 1 and stats["env/right"] == 0.5


def test_a_turn_stopped_by_another_eos_gets_the_templates_end_in_its_hole(tok):
    # the action stops on <|endoftext|> (id 0, an EOS of the model) where the template writes <|im_end|>
    pad = tok.pad_token_id
    batch = build("rollout", "agent", tools=[calculator])(chat_ctx(tok, [ROW], [[CALL, "408"]], 1, stop=pad))
    enc = lambda s: list(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    hole = enc("<|im_end|>\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n")
    want = enc(CALL) + [pad] + hole + enc("408") + [pad]
    assert batch.actions[0, 0, : len(want)].tolist() == want and batch.rewards.tolist() == [[1.0]]


def test_a_special_token_sampled_mid_turn_stays_in_the_message(tok):
    # the model may sample <|im_start|> inside a turn: the message keeps it, so the rendering stays a prefix
    script = [["<tool_call>{oops<|im_start|>}</tool_call>", "408"]]
    batch = build("rollout", "agent", tools=[calculator])(chat_ctx(tok, [ROW], script, 1))
    transcript = batch.info[0][0]["log"]["transcript"]
    assert transcript[1]["content"] == "<tool_call>{oops<|im_start|>}</tool_call>"
    assert "not valid JSON" in transcript[2]["content"] and batch.rewards.tolist() == [[1.0]]


def test_agent_cuts_at_max_turns_and_at_the_context(tok):
    script = [[CALL] * 3]
    batch = build("rollout", "agent", tools=[calculator], max_turns=3)(chat_ctx(tok, [ROW], script, 1))
    assert batch.info[0][0]["cut"] == "max_turns" and batch.rewards.tolist() == [[0.0]]
    assert int(batch.segment_id[0, 0].max()) == 2  # three assistant turns
    # the first context c_0 plus max_new_tokens 40 fits c_0 + 50; the second, c_0 + the call (≥ 40 tokens) + its
    # rendered tool reply, plus 40 does not: one turn, then the context cut
    first = len(render(tok, [{"role": "user", "content": "12*34="}], [schema(calculator)], generation_prompt=True))
    c0 = len(tok(render(tok, [{"role": "user", "content": "12*34="}], [schema(calculator)], True))["input_ids"])
    assert first > c0 > 0
    batch = build("rollout", "agent", tools=[calculator], max_context=c0 + 50)(chat_ctx(tok, [ROW], script, 1))
    assert batch.info[0][0]["cut"] == "context" and int(batch.segment_id[0, 0].max()) == 0
    assert bool(batch.truncated[0, 0])


def test_agent_needs_a_chat_template_and_env_return():
    from transformers import AutoTokenizer

    from groupwise.models.chatstart import BASE

    plain = AutoTokenizer.from_pretrained(BASE)
    with pytest.raises(ConfigError, match="no chat template"):
        build("rollout", "agent")(chat_ctx(plain, [ROW], [["1"]], 1))
    with pytest.raises(ConfigError, match="not a function|no function"):
        build("rollout", "agent", tools=["groupwise.rollout.tools:nothing"])


# ---------------------------------------------------------------------------------------------- through the trainer
AGENT = [
    "agent",
    "train.steps=2",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "threads=1",
    "log.samples=4",
    "log.table_every=0",
]


def test_two_agent_steps_on_the_shipped_chat_model(tmp_path):
    from groupwise.build import build as build_parts
    from groupwise.config import load_config
    from groupwise.run import Run
    from groupwise.trainer import Trainer

    cfg, _ = load_config(AGENT[0], [*AGENT[1:], f'out="{tmp_path}"'])
    trainer = Trainer(build_parts(cfg))
    seen, prepare = [], trainer.prepare
    trainer.prepare = lambda batch: seen.append(prepare(batch)) or seen[-1]
    Run(trainer).train()
    tok = trainer.policy.tokenizer
    calls = 0
    for batch in seen:
        for b in range(batch.shape[0]):
            for e in range(batch.shape[1]):
                info = batch.info[b][e]
                # the reward is the episode's return: 1 exactly when the last reply is the row's product
                transcript = info["log"]["transcript"]
                last = transcript[-1]
                right = last["role"] == "assistant" and last["content"].strip() == batch.meta[b]["answer"]
                assert batch.rewards[b, e].item() == float(right and info["cut"] == "")
                # the row is the rendered transcript after the prompt (each turn ends at its EOS)
                own = batch.loss_mask[b, e][batch.mask[b, e]]
                ids = batch.actions[b, e][batch.mask[b, e]].tolist()
                sampled = [t for t, o in zip(ids, own.tolist()) if o]
                assert sampled == [t for turn in info["log"]["turns"] for t in turn["action"]]
                calls += sum(m["role"] == "tool" for m in transcript)
                assert tok.decode(batch.prompt_ids[b]).startswith("<|im_start|>system\ntools: calculator(expression)")
    assert calls > 0, "the shipped chat model calls its tool"
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert rows and all("transcript" in r and "turns" in r for r in rows)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # every tool message answers one call: a calculator call, a call of no tool, or a malformed one
    counted = sum(m["tools/calculator/calls"] + m["tools/unknown"] + m["tools/malformed"] for m in metrics)
    assert counted == calls == sum(m["agent/tool_calls"] for m in metrics)
    assert all(0.0 <= m["agent/success"] <= 1.0 for m in metrics)


@pytest.mark.slow
def test_a_tool_using_run_resumes_bit_for_bit_after_sigkills(tmp_path):
    """SIGKILLs at seeded random moments, the same command rerun each time: the final weights (sha256)
    and every logged step's tool counts and success equal the uninterrupted run's."""
    import hashlib
    import os
    import random
    import subprocess
    import sys

    from test_resume import kill_at_random_moment

    args = [
        "train",
        "agent",
        "train.steps=8",
        "checkpoint.every=1",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "threads=1",
        "log.table_every=0",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

    def launch(out):
        return subprocess.Popen(
            [sys.executable, "-m", "groupwise", *args, f"out={out}"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def result(out):
        keys = ("step", "agent/success", "agent/tool_calls", "tools/calculator/calls", "tools/malformed", "loss")
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return (
            hashlib.sha256((out / "final" / "model.safetensors").read_bytes()).hexdigest(),
            [{k: m.get(k) for k in keys} for m in metrics],
        )

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    t0 = time.monotonic()
    proc = launch(straight)
    while proc.poll() is None and not (
        (straight / "metrics.jsonl").exists() and (straight / "metrics.jsonl").read_text()
    ):
        time.sleep(0.02)
    first = time.monotonic() - t0
    assert proc.wait(timeout=900) == 0, proc.stderr.read().decode()[-2000:]
    timing = {"first_step": first, "training": time.monotonic() - t0 - first}
    rng, kills = random.Random(20261240), 0
    while True:
        proc = launch(killed)
        if kills < 5 and kill_at_random_moment(proc, killed, rng, timing):
            kills += 1
            continue
        assert proc.wait(timeout=900) == 0, proc.stderr.read().decode()[-2000:]
        if (killed / "final" / "model.safetensors").exists():
            break
    assert kills >= 3, "the kills must land before the run ends"
    want = result(straight)
    assert sum(m["tools/calculator/calls"] for m in want[1]) > 0, "a tool-using run"
    assert result(killed) == want


# ------------------------------------------------------------------------------------------ adapters (optional extras)
def test_a_textarena_game_trains_through_the_adapter(tmp_path):
    """A real single-player TextArena game (GuessTheNumber) played by the `agent` strategy on the chat model
    (its context raised to 1024 positions: the game's rules alone are about 450 tokens), two steps."""
    pytest.importorskip("textarena")
    import shutil

    from groupwise.build import build as build_parts
    from groupwise.config import load_config
    from groupwise.models.chatstart import DEFAULT_OUT
    from groupwise.run import Run
    from groupwise.trainer import Trainer

    model = tmp_path / "model"
    shutil.copytree(DEFAULT_OUT, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    (tmp_path / "games.jsonl").write_text(json.dumps({"prompt": "guess", "game": "GuessTheNumber-v0-raw"}) + "\n")
    cfg, _ = load_config(
        "agent",
        [
            f'model.path="{model}"',
            f'data.path="{tmp_path / "games.jsonl"}"',
            'rollout.params={env = "textarena", max_turns = 2}',
            "rollout.max_new_tokens=6",
            "rollout.prompts_per_step=1",
            "rollout.group_size=2",
            "train.steps=2",
            "threads=1",
            "log.table_every=0",
            f'out="{tmp_path / "run"}"',
        ],
    )
    trainer = Trainer(build_parts(cfg))
    seen, prepare = [], trainer.prepare
    trainer.prepare = lambda batch: seen.append(prepare(batch)) or seen[-1]
    Run(trainer).train()
    assert len(seen) == 2
    for batch in seen:
        for e in range(batch.shape[1]):
            info = batch.info[0][e]
            transcript = info["log"]["transcript"]
            assert transcript[0]["role"] == "user" and "Guess The Number" in transcript[0]["content"]
            # the game answers each guess it did not end on: a hint, or the game's complaint about the format
            replies = [m["content"] for m in transcript[2::2]]
            assert len(replies) == len(transcript[1::2]) - (info["cut"] == "")
            assert batch.rewards[0, e].item() == info["env"]["reward"]
            assert info["env"]["turns"] == len(transcript[1::2])
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1] and all(m["agent/turns"] >= 2 for m in metrics)
