"""A plug-in environment: guess the secret number in 1..high; a wrong guess is answered higher or lower.

Not registered: guess.toml names it in the rollout strategy's parameters, ``rollout.params.env =
"guess_env:GuessNumber"``, and groupwise registers it in the env stage under that name; the
multi-turn strategy ``episodes`` plays it (docs/extending.md).

The contract (``groupwise.components.Env``): one instance plays one episode; ``reset(row, seed)``
returns the first observation, ``step(action)`` returns (observation, reward, done). The secret is
the data row's ``secret`` column (guess.jsonl), so a group's episodes share it.

**Episode** (``episodes`` plays it with the whole transcript as the context)::

    reset:  "guess 1-16="
    step:   a valid guess g: g == secret -> ("right", 1, done); g < secret -> ("higher=", 0);
            g > secret -> ("lower=", 0); anything else -> ("invalid=", 0) (the turn is spent)
    transcript: guess 1-16=8 lower=4 higher=6 ...   (until right, or rollout.params.max_turns)

The observations end in ``=`` because the embedded model was fine-tuned to write digits after
one. ``outcome()`` reports ``won`` and ``guesses``; ``episodes`` logs their means as ``env/won`` and
``env/guesses``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GuessNumber:
    """Guess the secret in 1..high; the env answers higher or lower (example plug-in)."""

    high: int = 16
    secret: int = field(default=0, init=False)  # episode state, not parameters
    guesses: int = field(default=0, init=False)
    won: bool = field(default=False, init=False)

    def reset(self, row: dict, seed: int) -> str:
        if "secret" not in row:
            raise ValueError(f"guess_env: each data row needs a 'secret' column (1..{self.high}), got {sorted(row)}")
        self.secret, self.guesses, self.won = int(row["secret"]), 0, False
        return f"guess 1-{self.high}="

    def step(self, action: str) -> tuple[str, float, bool]:
        self.guesses += 1
        text = action.strip()
        guess = int(text) if text.isdigit() else None
        if guess is None or not 1 <= guess <= self.high:
            return "invalid=", 0.0, False
        if guess == self.secret:
            self.won = True
            return "right", 1.0, True
        return ("higher=" if guess < self.secret else "lower="), 0.0, False

    def outcome(self) -> dict:
        return {"won": float(self.won), "guesses": self.guesses}
