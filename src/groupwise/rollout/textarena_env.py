"""TextArena games as environments (optional extra ``agents``: ``pip install 'groupwise[agents]'``).

**Change vs GRPO**: none by itself — an adapter from TextArena's single-player games
(https://github.com/LeonGuertler/TextArena, ``textarena`` 0.7.x on PyPI) to the env contract
(``components.Env``), so the multi-turn strategies (``agent`` with a chat model, ``episodes`` in plain
text) train on them. Read for the API: ``textarena/core.py`` (``Env.reset / step / get_observation /
close``) and ``textarena/envs/GuessTheNumber/env.py``.

**Math** (one episode; ``game`` a registered TextArena id, e.g. ``"GuessTheNumber-v0-raw"``)::

    reset(row, seed):  game = textarena.make(game); game.reset(num_players=1, seed=seed mod 2^31)
                       observation = the text of the game's messages so far (its rules and the first prompt)
    step(action):      done, _ = game.step(action)
                       not done: (the text of the messages since, 0, False)
                       done:     rewards, info = game.close(); ("", rewards[0], True)

A message is one of the game's ``(sender, text, type)`` observations; the player's own action
(echoed back by the game) is left out, the others joined by newlines.

**Defaults**

- ``game = "GuessTheNumber-v0-raw"`` [INFERRED] a single-player game with short replies; the ``-raw``
  ids give the game's own messages (the wrapped ids re-render the whole history every turn, which a
  chat transcript already holds).
- the row may name its own game in a ``game`` column (a dataset of games).

**Notes**

1. Only single-player games: a two-player game needs an opponent policy, which the env contract
   does not have (``reset`` raises for ``num_players`` above 1).
2. The game's reward is ``rewards[0]`` at the end (TextArena: 1 win, 0 draw / loss, −1 an invalid
   move in some games); ``outcome()`` reports ``reward``, ``turns`` and ``invalid``.
3. The seed passed to ``reset`` is the runner's episode seed: episodes replay exactly on resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from groupwise.errors import ConfigError
from groupwise.registry import register


def _textarena():
    try:
        import textarena
    except ImportError:
        raise ConfigError(
            "env textarena: the textarena package is not installed; pip install 'groupwise[agents]' "
            "(or 'textarena>=0.7,<0.8')"
        ) from None
    return textarena


@register("env", "textarena")
@dataclass
class TextArena:
    """A single-player TextArena game as an environment (reset / step through the game's messages)."""

    game: str = "GuessTheNumber-v0-raw"
    _env: Any = field(default=None, init=False, repr=False)
    _player: int = field(default=0, init=False)
    _reward: float = field(default=0.0, init=False)
    _turns: int = field(default=0, init=False)
    _invalid: bool = field(default=False, init=False)

    def reset(self, row: dict, seed: int) -> str:
        ta = _textarena()
        game = str(row.get("game") or self.game)
        try:
            self._env = ta.make(env_id=game)
        except Exception as err:
            raise ConfigError(f"env textarena: no game {game!r} in textarena ({err})") from None
        try:
            self._env.reset(num_players=1, seed=int(seed) % (1 << 31))
        except Exception as err:
            raise ConfigError(f"env textarena: {game!r} is not a single-player game ({err})") from None
        self._reward, self._turns, self._invalid = 0.0, 0, False
        self._player, messages = self._env.get_observation()
        return self._text(messages)

    def step(self, action: str) -> tuple[str, float, bool]:
        self._turns += 1
        done, _ = self._env.step(action=action)
        if not done:
            self._player, messages = self._env.get_observation()
            return self._text(messages), 0.0, False
        rewards, info = self._env.close()
        self._reward = float((rewards or {}).get(self._player, 0.0))
        self._invalid = bool((info or {}).get(self._player, {}).get("invalid_move", False))
        return "", self._reward, True  # nothing follows the last turn

    def _text(self, messages: list) -> str:
        return "\n".join(str(m[1]) for m in messages if m[0] != self._player)

    def outcome(self) -> dict:
        return {"reward": self._reward, "turns": self._turns, "invalid": float(self._invalid)}
