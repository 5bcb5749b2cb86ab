"""Tic-tac-toe: the agent plays X against a random (seeded) opponent and answers each board with a move.

The board is shown as rows A-C and columns 1-3; a move is ``<move>B2</move>``. The episode ends on a
win (reward 1), a draw (0.5), a loss (0) or a move that is not a free square (-1: the game is
forfeit). All rollouts of a scenario face the same opponent (same seed), so they compare.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from openai.types.chat.chat_completion_message import ChatCompletionMessage

SYSTEM = ("You are playing tic-tac-toe as X against O. Squares are named by row (A, B, C) and column (1, 2, 3). "
          "Reply with your move and nothing else, like <move>B2</move>. Choose a free square (shown as .).")
LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
MOVE = re.compile(r"<move>\s*([ABCabc])\s*([123])\s*</move>")
REWARDS = {"win": 1.0, "draw": 0.5, "loss": 0.0, "invalid": -1.0}


@dataclass(frozen=True)
class Scenario:
    seed: int


def render(board: list[str]) -> str:
    rows = [f"{name} " + " ".join(board[3 * i: 3 * i + 3]) for i, name in enumerate("ABC")]
    return "  1 2 3\n" + "\n".join(rows)


def winner(board: list[str]) -> str | None:
    for a, b, c in LINES:
        if board[a] != "." and board[a] == board[b] == board[c]:
            return board[a]
    return None


def parse_move(text: str | None) -> int | None:
    """The square index of ``<move>B2</move>`` (0-8), or None."""
    found = MOVE.search(text or "")
    return None if found is None else "ABC".index(found.group(1).upper()) * 3 + int(found.group(2)) - 1


@dataclass
class Game:
    """One game; see the module docstring."""

    scenario: Scenario
    tools: list[dict[str, Any]] | None = None
    max_turns: int = 5
    board: list[str] = field(default_factory=lambda: ["."] * 9)
    outcome: str | None = None
    moves: int = 0

    def __post_init__(self) -> None:
        self.opponent = random.Random(self.scenario.seed)

    def start(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{render(self.board)}\nYour move."}]

    def respond(self, message: ChatCompletionMessage) -> list[dict[str, Any]] | None:
        square = parse_move(message.content)
        if square is None or self.board[square] != ".":
            self.outcome = "invalid"
            return None
        self.board[square] = "X"
        self.moves += 1
        if self._over():
            return None
        self.board[self.opponent.choice([i for i, cell in enumerate(self.board) if cell == "."])] = "O"
        if self._over():
            return None
        return [{"role": "user", "content": f"{render(self.board)}\nYour move."}]

    def _over(self) -> bool:
        mark = winner(self.board)
        if mark is not None:
            self.outcome = "win" if mark == "X" else "loss"
        elif "." not in self.board:
            self.outcome = "draw"
        return self.outcome is not None

    def reward(self) -> float:
        return REWARDS.get(self.outcome or "", 0.25)  # unfinished within max_turns: between a loss and a draw

    def metrics(self) -> dict[str, float]:
        return {"moves": float(self.moves), "win": float(self.outcome == "win"),
                "invalid": float(self.outcome == "invalid")}
