"""DPA-GRPO's generator–verifier game: every decision rolled out both ways (paired counterfactual groups).

"Interactive Critique-Revision Training for Reliable Structured LLM Generation", Fei Xu Yu, Zuyuan
Zhang, Mahdi Imani, Nathaniel D. Bastian, Tian Lan, arXiv 2605.08327 (spec 47: abstract only, no code;
almost every choice below is [INFERRED] and an option). The game's formats are below; its tasks
(``verify_game``, the warm start's ``verify_game_sft``) are ``papers/47_dpa_grpo/verify_game.py``.

One LM plays both roles, told apart by the context's form (role prompts) [INFERRED]::

    generator, first move      "37+45="          ->  y0                  ("82")
    verifier                   "37+45=82?"       ->  "."  silent (no SAC), or "!" + evidence ("!83": the
                                                      Safety Assurance Case reduced to the verifier's total)
    generator, challenged      "37+45=82!83>"    ->  "k"  KEEP y0, or "r" + y1 ("r83": REVISE to y1)

**Change vs GRPO**: a step's batch is a game tree per first move. G first moves y0 per prompt form an
ordinary group (the generator's first move, GRPO on the no-SAC outcome); for each y0 the verifier's
two decisions are two rows with forced prefixes (M7, ``Request.prefix``): silent ``"."`` and a
challenge ``"!"`` + sampled evidence; under the challenge the generator's two decisions are two
more rows: KEEP ``"k"`` and REVISE ``"r"`` + a sampled total. Each decision's two rows are a pair
group, so the estimator (``grpo``, population std) gives ±1 within each pair.

**Math** (c(y) = 1 if y is the right total; p_r = π(r)/(π(k) + π(r)) from the forced rows' exact
``logp_sampler`` of the decision token; p_s = π(.)/(π(.) + π(!)) likewise)::

    c_keep = c(y0),  c_rev = c(y1)                   y1: the REVISE row's total
    c_sac  = c_rev if the generator revises else c_keep       sac_outcome = "sampled": revise ~ Bernoulli(p_r)
           = p_r·c_rev + (1 − p_r)·c_keep                      sac_outcome = "expected"
    R_V(silent) = c(y0),        R_V(SAC)    = c_sac − κ_int
    R_G2(KEEP)  = c_keep,       R_G2(REVISE) = c_rev − κ_rev
    R_G1(y0)    = c(y0)                                        first_reward = "no_sac"
                = c_sac if the verifier challenges else c(y0)  first_reward = "realised": challenge ~ Bernoulli(1 − p_s)

Each row's reward is the row extra ``game_reward`` (reward ``row_extra``, ``extra = "game_reward"``),
scored through ``ctx.finish``; the row extra ``game_role`` (0 generator, 1 verifier) lets the
objective give each role its own KL term (M7's ``rows`` filter).

**Defaults** (every one [INFERRED], spec 47 and design §6)

- ``kappa_int = 0.1`` (an unnecessary intervention is strictly worse: the abstract's "profitable
  deviation"), ``kappa_rev = 0.05``.
- ``train = "decision_and_content"``: the decision token and the chosen branch's content carry the
  loss (``Request.train_prefix``); ``"decision"``: the decision token alone.
- ``sac_outcome = "sampled"``, ``first_reward = "no_sac"``; ``branch = "both"`` is the only tree built.
- ``models = "shared"``: one LM with role prompts; ``"separate"``: the verifier is another model, the
  actor ``roles.<verifier>`` (``samples = true``, issue 42 M9): it samples and trains on the verifier
  pairs in its own tokens (returned as its own batch), the policy on the first moves and the
  challenged generator's pairs.
- ``play = "game"``; ``"first_move"`` is the generator-only GRPO baseline: the G first moves alone,
  rewarded c(y0), no verifier or challenged rows (``evaluate`` still plays the greedy game).

**Notes**

1. ``step_stats`` (exact, from the forced rows' decision log-probs, no extra sampling):
   ``dpa/correct_silence`` = mean p_s over right y0, ``dpa/missed_error`` = mean p_s over wrong y0,
   ``dpa/calibrated_revision`` = mean p_r over wrong y0 − over right y0 (NaN where a class is
   empty); also ``dpa/first_accuracy`` (mean c(y0)) and ``dpa/game_accuracy`` (mean of the realised
   final: c_sac where the verifier's drawn decision challenges, else c(y0)).
2. ``evaluate`` (held-out, greedy): y0 greedy, each decision the likelier of its two forced tokens,
   the revision greedy; ``game_accuracy`` (the final answer right), ``first_accuracy``, ``sac_rate``,
   ``revise_rate``.
3. The draws of Notes 1 and of ``sampled`` / ``realised`` are seeded by (seed, step, prompt id, row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rollout.context import RolloutContext
from groupwise.types import Request, Rollout

SILENT, CHALLENGE, KEEP, REVISE = ".", "!", "k", "r"  # the decision tokens (one token each in the embedded model)
ASK, SHOW = "?", ">"  # the verifier's and the challenged generator's context endings
PLAYS = ("game", "first_move")
TRAINS, SAC_OUTCOMES, FIRST_REWARDS = (
    ("decision_and_content", "decision"),
    ("sampled", "expected"),
    ("no_sac", "realised"),
)


def verifier_context(prompt: str, y0: str) -> str:
    return f"{prompt}{y0}{ASK}"


def challenge_context(prompt: str, y0: str, evidence: str) -> str:
    return f"{prompt}{y0}{CHALLENGE}{evidence}{SHOW}"


def answer_of(text: str) -> str:
    """The value a completion states: its text without surrounding blanks."""
    return text.strip()


def decision_probability(logp_yes: torch.Tensor, logp_no: torch.Tensor) -> torch.Tensor:
    """[N] P(yes) between the two decision tokens: π(yes) / (π(yes) + π(no)), from their log-probs."""
    return torch.sigmoid(logp_yes.double() - logp_no.double())  # [N]


def game_rewards(c0, c_rev, p_rev, kappa_int: float, kappa_rev: float, sac_outcome: str = "sampled", revise=None):
    """The rewards of one batch of game trees (module Math), all [N]: (R_V silent, R_V SAC, R_G2 keep, R_G2
    revise, c_sac). ``revise`` [N] bool: the generator's drawn decision (``sac_outcome = "sampled"``)."""
    c0, c_rev = c0.double(), c_rev.double()  # [N]
    c_sac = torch.where(revise, c_rev, c0) if sac_outcome == "sampled" else p_rev * c_rev + (1 - p_rev) * c0  # [N]
    return c0, c_sac - kappa_int, c0, c_rev - kappa_rev, c_sac


def decision_rates(c0: torch.Tensor, p_silent: torch.Tensor, p_rev: torch.Tensor) -> dict[str, float]:
    """Note 1's rates: [N] right y0 (bool), P(silent), P(revise | SAC)."""

    def mean(x: torch.Tensor) -> float:
        return float(x.mean()) if x.numel() else float("nan")

    right = c0.bool()
    return {
        "dpa/correct_silence": mean(p_silent[right]),
        "dpa/missed_error": mean(p_silent[~right]),
        "dpa/calibrated_revision": mean(p_rev[~right]) - mean(p_rev[right]),
    }


@register("rollout", "dpa_game")
@dataclass
class DPAGame:
    """DPA-GRPO's game: G first moves, then both decisions of verifier and challenged generator as forced pairs."""

    collects = ("game_reward", "game_role")
    kappa_int: float = 0.1
    kappa_rev: float = 0.05
    train: str = "decision_and_content"
    sac_outcome: str = "sampled"
    first_reward: str = "no_sac"
    branch: str = "both"
    models: str = "shared"
    play: str = "game"
    verifier: str = "verifier"  # models = "separate": the actor that plays the verifier

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("train", self.train, TRAINS),
            ("sac_outcome", self.sac_outcome, SAC_OUTCOMES),
            ("first_reward", self.first_reward, FIRST_REWARDS),
            ("branch", self.branch, ("both",)),
            ("play", self.play, PLAYS),
            ("models", self.models, ("shared", "separate")),
        ):
            if value not in allowed:
                raise ConfigError(f"rollout dpa_game: {name}={value!r}; use one of {', '.join(allowed)}")
        self._stats: dict[str, float] = {}

    @property
    def samples_with(self) -> tuple[str, ...]:
        return (self.verifier,) if self.models == "separate" else ()

    def check(self, components: list) -> None:
        """At build: the game's rows are scored by the reward ``row_extra`` reading ``game_reward`` alone."""
        rewards = [c for c in components if getattr(c, "stage", "") == "reward"]
        ok = [
            c
            for c in rewards
            if getattr(c, "registry_name", "") == "row_extra" and tuple(c.rollout_extras) == ("game_reward",)
        ]
        if len(ok) != 1 or len(rewards) != 1:
            named = [getattr(c, "registry_name", type(c).__name__) for c in rewards]
            raise ConfigError(
                f"rollout dpa_game sets each row's reward itself (row extra game_reward); the run's rewards are "
                f'{named}: use rewards = [{{name = "row_extra", extra = "game_reward"}}]'
            )

    def _play(self, ctx: RolloutContext, keys: list[int], first: Rollout, seed: int):
        """Both decisions of both players for every valid first move: (verifier pairs, generator pairs, facts)."""
        trained = self.train == "decision_and_content" or None
        where = first.group_valid.nonzero().tolist()  # [(b, g)] the first moves that exist
        prompts = [first.meta[b]["prompt"] for b, _ in where]
        y0 = [answer_of(first.completions[b][g]) for b, g in where]
        G0 = first.shape[1]

        def pair(contexts: list[str], yes: str, no: str, role: int, actor: str = "policy") -> Rollout:
            policy = ctx.policy_of(actor)  # the player of this decision, in its own tokens
            token = {t: policy.tokenizer.encode(t, add_special_tokens=False) for t in (yes, no)}
            reqs = [
                Request(key=keys[b], n=1, offset=G0 + 2 * (g * 2 + k), prompt=policy.encode(text), prefix=token[t],
                        train_prefix=bool(trained), extras={"game_role": [float(role)]})
                for (b, g), text in zip(where, contexts) for k, t in enumerate((no, yes))
            ]  # fmt: skip
            rows = ctx.generate(reqs, actor=actor)  # [2N,1,T]
            if self.train == "decision":  # the decision token alone carries the loss
                rows.loss_mask = rows.mask & (torch.arange(rows.shape[2]) < 1)  # [2N,1,T]
            return rows.regroup([[(2 * n, 0), (2 * n + 1, 0)] for n in range(len(where))])  # [N,2,T] (no, yes)

        verifier = self.verifier if self.models == "separate" else "policy"
        ver = pair([verifier_context(p, y) for p, y in zip(prompts, y0)], CHALLENGE, SILENT, 1, verifier)
        evidence = [answer_of(ver.completions[n][1][1:]) for n in range(len(where))]
        gen = pair([challenge_context(p, y, e) for p, y, e in zip(prompts, y0, evidence)], REVISE, KEEP, 0)
        answers = [first.meta[b]["answer"] for b, _ in where]
        c0 = torch.tensor([float(y == a) for y, a in zip(y0, answers)])  # [N]
        c_rev = torch.tensor([float(answer_of(gen.completions[n][1][1:]) == a) for n, a in enumerate(answers)])
        p_silent = decision_probability(ver.logp_sampler[:, 0, 0], ver.logp_sampler[:, 1, 0])  # [N]
        p_rev = decision_probability(gen.logp_sampler[:, 1, 0], gen.logp_sampler[:, 0, 0])  # [N]
        g = torch.Generator().manual_seed(seed)
        u = torch.rand(2, len(where), generator=g, dtype=torch.float64)  # [2,N] the drawn decisions
        facts = {"where": where, "c0": c0, "c_rev": c_rev, "p_silent": p_silent, "p_rev": p_rev}
        facts["revise"], facts["challenge"] = u[0] < p_rev, u[1] >= p_silent  # [N] bool each
        return ver, gen, facts

    def __call__(self, ctx: RolloutContext) -> Rollout | dict[str, Rollout]:
        info = ctx.info(0)
        keys = ctx.draw(ctx.batch_size)
        first = ctx.generate([Request(key=k, n=ctx.group_size) for k in keys])  # [B,G,T]
        first.set_extra("game_role", torch.zeros(first.shape[:2]), "row")
        if self.play == "first_move":  # the generator-only baseline: GRPO on c(y0), no game is played
            right = torch.tensor(
                [[float(answer_of(y) == m["answer"]) for y in row] for row, m in zip(first.completions, first.meta)]
            )  # [B,G]
            first.set_extra("game_reward", right * first.group_valid, "row")
            self._stats = {"dpa/first_accuracy": float(right[first.group_valid].mean())}
            batch = self._finish(ctx, first)
            return batch if self.models == "shared" else {"policy": batch, self.verifier: self._empty(ctx)}
        seed = (info.seed * 1_000_003 + info.step) * 1_000_003 + int(sum(keys))
        ver, gen, f = self._play(ctx, keys, first, seed)
        r_silent, r_sac, r_keep, r_rev, c_sac = game_rewards(
            f["c0"], f["c_rev"], f["p_rev"], self.kappa_int, self.kappa_rev, self.sac_outcome, f["revise"]
        )
        realised = torch.where(f["challenge"], c_sac, f["c0"].double())  # [N] the final answer's correctness
        r_first = torch.zeros(first.shape[:2])  # [B,G]
        for n, (b, g) in enumerate(f["where"]):
            r_first[b, g] = float(realised[n] if self.first_reward == "realised" else f["c0"][n])
        first.set_extra("game_reward", r_first, "row")
        ver.set_extra("game_reward", torch.stack([r_silent, r_sac], 1).float(), "row")  # [N,2]
        gen.set_extra("game_reward", torch.stack([r_keep, r_rev], 1).float(), "row")  # [N,2]
        self._stats = {
            **decision_rates(f["c0"], f["p_silent"], f["p_rev"]),
            "dpa/first_accuracy": float(f["c0"].mean()),
            "dpa/game_accuracy": float(realised.mean()),
        }
        if self.models == "separate":  # the verifier's pairs are its own batch, the rest the policy's
            return {
                "policy": self._finish(ctx, Rollout.concat([first, gen])),  # [B+N, max(G,2), T]
                self.verifier: self._finish(ctx, ver, self.verifier),  # [N,2,T]
            }
        return self._finish(ctx, Rollout.concat([first, ver, gen]))  # [B+2N, max(G,2), T]

    @staticmethod
    def _finish(ctx: RolloutContext, batch: Rollout, actor: str = "policy") -> Rollout:
        """Score the assembled batch (its rewards are the row extra ``game_reward``) and apply the sampler's
        verdict (to the policy's batch)."""
        B, G, _ = batch.shape
        batch.reward_parts = torch.zeros(B, G, 0, dtype=torch.float64)  # [B,G,0] no text rewards: row_extra scores
        batch.set_extra("reward_failed", torch.zeros(B, G, dtype=torch.bool), "row")
        batch = ctx.finish(batch, actor=actor)
        if actor != "policy":
            return batch
        keep = ctx.keep(batch)  # [B'] bool
        return batch if bool(keep.all()) else batch.select(keep.nonzero().flatten())

    def _empty(self, ctx: RolloutContext) -> Rollout:
        """The verifier's batch when it plays nothing (``play = "first_move"``): no groups."""
        return Rollout(
            prompt_ids=[],
            actions=torch.zeros(0, 2, 1, dtype=torch.long),
            mask=torch.zeros(0, 2, 1, dtype=torch.bool),
            group_valid=torch.zeros(0, 2, dtype=torch.bool),
            truncated=torch.zeros(0, 2, dtype=torch.bool),
            prompt_index=torch.zeros(0, dtype=torch.long),
        )

    def step_stats(self) -> dict[str, float]:
        return dict(self._stats)

    def evaluate(self, ctx: RolloutContext, rows: list[dict], info) -> dict[str, float]:
        """Note 2: the greedy game on the held-out rows."""
        keys = list(range(len(rows)))
        first = ctx.generate([Request(key=k, n=1) for k in keys])  # [R,1,T]
        ver, gen, f = self._play(ctx, keys, first, 0)
        challenge, revise = f["p_silent"] < 0.5, f["p_rev"] > 0.5  # [R] the likelier decisions
        final = torch.where(challenge & revise, f["c_rev"], f["c0"])  # [R]
        return {
            "game_accuracy": float(final.mean()),
            "first_accuracy": float(f["c0"].mean()),
            "sac_rate": float(challenge.double().mean()),
            "revise_rate": float((challenge & revise).double().mean()),
        }
