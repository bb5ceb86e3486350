"""Agent episodes on a chat model: chat transcripts, tool calls, one row per episode.

The chat form of ``episodes`` (trajectory-level GRPO, ``rollout/episodes.py``): an episode is a list
of messages rendered by the model's chat template (``rollout/chat.py``); the assistant may call tools
(``rollout/tools.py``) between the environment's turns. Loss mask and per-turn segments as in
``episodes``: the assistant's sampled tokens train, every rendered token between them is a hole. The
same way multi-turn RL frameworks train tool-using agents (TRL's GRPO tool loop,
``trl/trainer/grpo_trainer.py`` ``_tool_call_loop``: prompt + completion + rendered tool suffix,
tool tokens masked; slime's ``MultiTurnLossMaskGenerator``).

**Change vs GRPO**: the G completions of a prompt are G chat episodes: each row is the assistant's
sampled turns and the rendered tool / environment messages between them (holes in the loss mask);
the reward is the episode's return; the advantage is the configured estimator.

**Math** (episode e of row ``key``; the env as in ``rollout/env.py``: ``reset(row, seed)`` gives
the first user message (a string, or a list of messages), ``step(answer)`` the reply)::

    M_0 = [system?] + reset(row)                          messages
    tools = the toolbox's + env.tools() if the env has it  (bound to this episode's env, ``trl_env.py``)
    c_0 = encode(render(M_0, tools, generation prompt))   the first context (the row's prompt)
    turn t:  a_t ~ policy(c_t)                            sampled ids (EOS included when sampled)
             calls = parse(text(a_t))
             calls: M += [assistant text(a_t)] + [tool message per call]     (the env is not stepped)
             none:  r_t, o, done = env.step(text(a_t)); M += [assistant text(a_t)] + [user o] unless done
             S_t   = decode(c_t ‖ a_t)                    the transcript so far, as text
             e_t   = encode(render(M, tools, generation prompt)[len(S_t):])   the rendered messages after a_t
             c_{t+1} = c_t ‖ a_t ‖ e_t
    row = a_0 ‖ e_0 ‖ a_1 ‖ … ‖ a_last;  loss_mask 1 on every a_t;  reward = Σ_t r_t

The next context extends the last one token for token (the model is trained on the ids it sampled),
which needs a prefix-preserving template: ``render(M)`` must start with ``S_t``; a template that
rewrites earlier turns is refused with the turn that broke it (TRL refuses such templates for tools
too, ``is_chat_template_prefix_preserving``).

**Defaults**

- ``max_turns = 8`` [INFERRED] assistant turns, tool calls included (TRL's
  ``max_tool_calling_iterations`` counts tool rounds only).
- ``tool_timeout = 5.0`` s [INFERRED]; ``tool_parser = "hermes"`` the Hermes / Qwen
  ``<tool_call>{json}</tool_call>`` format, or any ``"module:function"`` (``rollout/tools.py``).
- ``sandbox = {}`` options of the sandbox that code tools run in (``rollout/code_tools.py``):
  ``unsafe_local``, ``python``, ``cgroup`` (as the ``code`` reward's), ``memory_mb`` [256].
- ``system = None`` no system message of our own (the template writes the tool list).
- ``env = None`` the row's ``env`` column (the agent tasks name ``answer``); ``env_params = {}``.

**Notes**

1. Cuts as in ``episodes``: a turn is played only if its context plus ``rollout.max_new_tokens`` fits
   ``min(model context, max_context)`` (``cut = "context"``), else the episode stops with the
   rewards it has; ``max_turns`` reached: ``cut = "max_turns"``.
2. ``samples.jsonl`` rows get ``transcript`` (the messages) and ``turns`` (per assistant turn: its
   sampled token ids, and the ids of the rendered messages after it) through ``info["log"]``.
3. ``step_stats``: ``agent/turns`` (assistant turns this step), ``agent/tool_calls``,
   ``agent/success`` (share of episodes with a positive return), ``tools/<name>/calls``,
   ``tools/<name>/error_rate`` (errors / calls), ``tools/malformed`` (unreadable calls), ``tools/unknown``
   (calls of no such tool), and the
   env's ``outcome()`` means as ``env/<key>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rollout.chat import encode as encode_text
from groupwise.rollout.chat import render, require_template
from groupwise.rollout.env import ENV_STREAM, EnvCopies, Episode, Played, check_env_rewards, score_returns
from groupwise.rollout.episodes import transcripts
from groupwise.rollout.tools import Toolbox, schema
from groupwise.seeds import sample_seed
from groupwise.types import Request, Rollout


def _messages(observation: Any, who: str) -> list[dict]:
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, list) and all(isinstance(m, dict) and "role" in m for m in observation):
        return [dict(m) for m in observation]
    raise ConfigError(
        f"rollout {who}: an env's observation is a string (a user message) or a list of messages "
        f"({{'role': ..., 'content': ...}}), got {type(observation).__name__}"
    )


def play_chat(
    ctx: Any,
    keys: list[int],
    n: int,
    max_turns: int,
    toolbox: Toolbox,
    env: str | None = None,
    env_params: dict | None = None,
    *,
    system: str | None = None,
    max_context: int | None = None,
    sampling: dict | None = None,
    who: str = "agent",
) -> tuple[Played, list[list[list[dict]]]]:
    """Play ``n`` chat episodes of each row in ``keys`` (module docstring); (played, messages [B][n])."""
    tokenizer = ctx.policy.tokenizer
    require_template(tokenizer, f"rollout {who}")
    info = ctx.info(0)
    limit = min(x for x in (getattr(ctx.policy, "context", None), max_context, 1 << 62) if x)
    budget = ctx.sampling["max_new_tokens"]
    schemas = toolbox.schemas
    eos = set(getattr(ctx.policy, "eos", None) or [tokenizer.eos_token_id])
    fresh = EnvCopies(env, env_params, who)
    episodes, state = [], {}
    for key in keys:
        row = ctx.meta(key)
        group = []
        for e in range(n):
            instance = fresh(row)
            first = instance.reset(row, sample_seed(info.seed, info.step, key, ENV_STREAM + e))
            messages = ([{"role": "system", "content": system}] if system else []) + _messages(first, who)
            # an env may offer tools of its own (bound to this episode's instance), next to the toolbox's
            own = toolbox.bind(instance.tools(), f"rollout {who}") if hasattr(instance, "tools") else {}
            own_schemas = schemas + [schema(fn) for fn in own.values()]
            text = render(tokenizer, messages, own_schemas, generation_prompt=True)
            ep = Episode(key, e, [text])
            state[id(ep)] = {
                "env": instance,
                "messages": messages,
                "ids": encode_text(tokenizer, text),
                "text": text,
                "tools": own,
                "schemas": own_schemas,
            }
            group.append(ep)
        episodes.append(group)
    parts, seen = [], 0
    for t in range(max_turns):
        requests, chosen = [], []
        for ep in (ep for group in episodes for ep in group if not ep.done and not ep.cut):
            context = state[id(ep)]["ids"]
            if len(context) + budget > limit:
                ep.cut = "context"
                continue
            requests.append(
                Request(key=ep.key, n=1, offset=ep.index * max_turns + t, prompt=context, sampling=sampling)
            )
            chosen.append(ep)
        if not requests:
            break
        gen = ctx.generate(requests, 0)  # [R,1,T] gathered, in request order
        lengths = gen.mask[:, 0].sum(-1).tolist()  # [R]
        for i, ep in enumerate(chosen):
            st = state[id(ep)]
            action = gen.actions[i, 0, : lengths[i]].tolist()
            stop = len(action) - 1 if action and action[-1] in eos else len(action)
            text = tokenizer.decode(action[:stop], skip_special_tokens=False)  # special tokens sampled mid-turn stay:
            # the message then renders to exactly the sampled text (a prefix-preserving template's condition)
            st["messages"].append({"role": "assistant", "content": text})
            calls = toolbox.parse(text)
            reward = 0.0
            if calls:
                st["messages"] += [toolbox.run(call, st["tools"]) for call in calls]
            else:
                obs, reward, done = st["env"].step(text)
                ep.done = bool(done)
                if not ep.done:
                    st["messages"] += _messages(obs, who)
            ep.contexts.append(st["ids"])
            ep.actions.append(action)
            ep.texts.append(text)
            ep.rewards.append(float(reward))
            ep.rows.append(seen + i)
            if not ep.done:
                following = render(tokenizer, st["messages"], st["schemas"], generation_prompt=True)
                so_far = st["text"] + tokenizer.decode(action, skip_special_tokens=False)
                if not following.startswith(so_far) and action and action[-1] in eos:
                    # a stop token the template does not write (another EOS id): the template's own end follows
                    so_far = st["text"] + tokenizer.decode(action[:-1], skip_special_tokens=False)
                if not following.startswith(so_far):
                    raise ConfigError(
                        f"rollout {who}: the chat template is not prefix-preserving: after assistant turn {t} of "
                        f"row {ep.key} the rendered messages no longer start with the transcript so far "
                        f"({so_far[-60:]!r} vs {following[len(so_far) - 60 : len(so_far)]!r}); use a template that "
                        f"renders earlier messages the same whatever follows (e.g. one that does not strip or rewrite "
                        f"assistant turns)"
                    )
                tail = encode_text(tokenizer, following[len(so_far) :])
                ep.env_tokens.append(tail)
                ep.observations.append(following[len(so_far) :])
                st["ids"], st["text"] = st["ids"] + action + tail, following
        parts.append(gen)
        seen += len(chosen)
    for ep in (ep for group in episodes for ep in group if not ep.done and not ep.cut):
        ep.cut = "max_turns"
    for ep in (ep for group in episodes for ep in group):
        outcome = getattr(state[id(ep)]["env"], "outcome", None)
        ep.facts = dict(outcome()) if outcome is not None else {}
    if not parts:
        raise ConfigError(
            f"rollout {who}: no episode could take a single turn (the first rendered context plus "
            f"rollout.max_new_tokens={budget} exceeds the context limit {limit}); raise max_context, shorten the "
            f"messages or use a model with a longer context"
        )
    played = Played(episodes, Rollout.concat(parts), [False] * len(episodes))
    return played, [[state[id(ep)]["messages"] for ep in g] for g in episodes]


@register("rollout", "agent")
@dataclass
class Agent:
    """Chat episodes with tool calls, one row per episode; only the assistant's sampled tokens train."""

    max_turns: int = 8
    tools: list = field(default_factory=list)
    tool_timeout: float = 5.0
    tool_parser: str = "hermes"
    sandbox: dict = field(default_factory=dict)  # code tools' sandbox: unsafe_local, python, cgroup, memory_mb
    system: str | None = None
    max_context: int | None = None
    env: str | None = None
    env_params: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.tool_timeout <= 0 or (self.max_context is not None and self.max_context < 2):
            raise ConfigError(
                f"rollout agent: need max_turns >= 1, tool_timeout > 0, max_context >= 2 or None; got "
                f"max_turns={self.max_turns}, tool_timeout={self.tool_timeout}, max_context={self.max_context}"
            )
        self._toolbox = Toolbox(
            self.tools, self.tool_timeout, self.tool_parser, self.sandbox
        )  # fails at build on a bad tool

    def check(self, components: list) -> None:
        check_env_rewards(components, "agent")

    def __call__(self, ctx) -> Any:
        played, messages = play_chat(
            ctx,
            ctx.draw(ctx.batch_size),
            ctx.group_size,
            self.max_turns,
            self._toolbox,
            self.env,
            self.env_params,
            system=self.system,
            max_context=self.max_context,
        )
        batch, outcome = transcripts(played)
        tokenizer = ctx.policy.tokenizer
        for b, group in enumerate(played.episodes):
            for e, ep in enumerate(group):
                text = "".join(
                    tokenizer.decode(a, skip_special_tokens=False)
                    + (tokenizer.decode(ep.env_tokens[t], skip_special_tokens=False) if t < len(ep.env_tokens) else "")
                    for t, a in enumerate(ep.actions)
                )
                batch.completions[b][e] = text
                batch.info[b][e]["log"] = {
                    "transcript": messages[b][e],
                    "turns": [
                        {"action": a, "after": ep.env_tokens[t] if t < len(ep.env_tokens) else []}
                        for t, a in enumerate(ep.actions)
                    ],
                }
        score_returns(ctx, batch, outcome, "agent")
        success = [ep.ret > 0 for g in played.episodes for ep in g]
        self._stats = {
            "agent/turns": float(played.actions),
            "agent/tool_calls": float(sum(m["role"] == "tool" for g in messages for ms in g for m in ms)),
            "agent/success": sum(success) / max(1, len(success)),
            **self._toolbox.stats(),
            **played.fact_means(),
        }
        keep = ctx.keep(batch)  # [B] bool
        return batch if bool(keep.all()) else batch.select(keep.nonzero().flatten())

    def step_stats(self) -> dict[str, float]:
        return dict(getattr(self, "_stats", {}))


@register("env", "answer")
@dataclass
class Answer:
    """One question, answered once: the row's ``prompt`` as the user message; reward 1 when the
    assistant's final reply (a turn without tool calls) is the row's ``answer``, stripped."""

    answer: str = field(default="", init=False)
    answered: bool = field(default=False, init=False)
    right: bool = field(default=False, init=False)

    def reset(self, row: dict, seed: int) -> str:
        if "prompt" not in row or "answer" not in row:
            raise ValueError(f"env answer: each row needs 'prompt' and 'answer' columns, got {sorted(row)}")
        self.answer = str(row["answer"]).strip()
        return str(row["prompt"])

    def step(self, action: str) -> tuple[str, float, bool]:
        self.answered, self.right = True, action.strip() == self.answer
        return "", float(self.right), True

    def outcome(self) -> dict:
        return {"answered": float(self.answered), "right": float(self.right)}


def greedy_success(policy: Any, rows: list[dict], sampling: dict, info: Any, agent: Agent) -> float:
    """The share of ``rows`` whose greedy episode (one per row) ends with a positive return."""
    from groupwise.rollout.env import _Rows

    played, _ = play_chat(
        _Rows(policy, rows, sampling, info),
        list(range(len(rows))),
        1,
        agent.max_turns,
        agent._toolbox,
        agent.env,
        agent.env_params,
        system=agent.system,
        max_context=agent.max_context,
        sampling={"greedy": True},
    )
    return sum(g[0].ret > 0 for g in played.episodes) / max(1, len(rows))
