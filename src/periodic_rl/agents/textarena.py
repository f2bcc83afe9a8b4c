"""`textarena <https://github.com/LeonGuertler/TextArena>`_ games as environments: a single-player
game (``GuessTheNumber-v0``, ``Wordle-v0``, ``Sudoku-v0``...) runs unchanged, one instance per
trajectory.

``AgentConfig(environment="periodic_rl.agents.textarena:TextArenaGame",
environment_kwargs={"env_id": "GuessTheNumber-v0"})``. The game is made without its observation
wrapper (``<env_id>-raw``), so that each turn appends only the game's new messages, not the whole
history again; its action formatting wrapper is kept. The trajectory's reward is the player's
reward when the game ends. Needs the ``agents`` extra (``pip install periodic-rl[agents]``).
"""

from __future__ import annotations

from typing import Any

from periodic_rl.extras import require

PLAYER = 0


class TextArenaGame:
    """One textarena game, played by the model as player 0 (an
    :class:`~periodic_rl.agents.environment.Environment`).

    Args:
        env_id: the game's textarena id (``"GuessTheNumber-v0"``...).
        make_kwargs: further arguments of ``textarena.make``.
    """

    def __init__(self, env_id: str, **make_kwargs: Any) -> None:
        self.env_id, self.make_kwargs = env_id, make_kwargs
        self.game: Any = None

    def reset(self, row: dict[str, Any], seed: int) -> str | None:
        textarena = require("textarena", "the textarena environments")
        from textarena.wrappers import ActionFormattingWrapper

        game = textarena.make(f"{self.env_id}-raw", **self.make_kwargs)
        self.game = ActionFormattingWrapper(game)
        self.game.reset(num_players=1, seed=seed % 2**32)
        return self._observation()

    def step(self, turn: str) -> tuple[str | None, float, bool]:
        done, _ = self.game.step(action=turn)
        if done:
            rewards, _ = self.game.close()
            return None, float((rewards or {}).get(PLAYER, 0.0)), True
        return self._observation(), 0.0, False

    def _observation(self) -> str | None:
        player, messages = self.game.get_observation()
        if player != PLAYER:
            raise RuntimeError(
                f"{self.env_id}: the game waits for player {player}; only single-player games "
                "run as environments"
            )
        mapping = getattr(self.game.state, "role_mapping", {})
        lines = [  # the game echoes the model's own move: the trajectory has it already
            f"[{mapping.get(sender, 'GAME' if sender < 0 else f'Player {sender}')}] {text}"
            for sender, text, *_ in messages or []
            if sender != PLAYER
        ]
        return "\n".join(lines) or None
