"""2048: the agent slides the tiles of a 4x4 board (``<move>left</move>``) until it cannot, or for ``max_turns``.

Equal tiles that slide into each other merge. After each move a 2 (or, one time in ten, a 4) appears
on a free square, drawn from the scenario's seed, so every rollout of a scenario gets the same
tiles for the same moves. Reward: log2 of the largest tile over log2(2048) (1.0 = reaching 2048);
a move that changes nothing (or is not a move) ends the game where it stands.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from typing import Any

from openai.types.chat.chat_completion_message import ChatCompletionMessage

SYSTEM = ("You are playing 2048. Slide the tiles up, down, left or right; equal tiles that meet merge into their sum. "
          "Reach 2048. Reply with your move and nothing else, like <move>left</move>.")
MOVE = re.compile(r"<move>\s*(up|down|left|right)\s*</move>", re.IGNORECASE)
SIZE = 4


@dataclass(frozen=True)
class Scenario:
    seed: int


def slide_row_left(row: list[int]) -> list[int]:
    """One row slid left with merges (each tile merges at most once per move)."""
    tiles = [tile for tile in row if tile]
    merged: list[int] = []
    while tiles:
        if len(tiles) > 1 and tiles[0] == tiles[1]:
            merged.append(tiles[0] * 2)
            tiles = tiles[2:]
        else:
            merged.append(tiles.pop(0))
    return merged + [0] * (SIZE - len(merged))


def slide(board: list[list[int]], direction: str) -> list[list[int]]:
    """The board after one move (a new board; the input is left as it was)."""
    if direction in ("left", "right"):
        rows = [row[::-1] if direction == "right" else row for row in board]
        moved = [slide_row_left(row) for row in rows]
        return [row[::-1] if direction == "right" else row for row in moved]
    columns = [[board[r][c] for r in range(SIZE)] for c in range(SIZE)]
    shifted = [slide_row_left(col[::-1] if direction == "down" else col) for col in columns]
    shifted = [col[::-1] if direction == "down" else col for col in shifted]
    return [[shifted[c][r] for c in range(SIZE)] for r in range(SIZE)]


def render(board: list[list[int]]) -> str:
    return "\n".join(" ".join(f"{tile or '.':>4}" for tile in row) for row in board)


@dataclass
class Game:
    """One game; see the module docstring."""

    scenario: Scenario
    tools: list[dict[str, Any]] | None = None
    max_turns: int = 20
    board: list[list[int]] = field(default_factory=lambda: [[0] * SIZE for _ in range(SIZE)])
    moves: int = 0
    invalid: bool = False

    def __post_init__(self) -> None:
        self.tiles = random.Random(self.scenario.seed)
        self._spawn()
        self._spawn()

    def _spawn(self) -> None:
        free = [(r, c) for r in range(SIZE) for c in range(SIZE) if not self.board[r][c]]
        if free:
            r, c = self.tiles.choice(free)
            self.board[r][c] = 4 if self.tiles.random() < 0.1 else 2

    def start(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{render(self.board)}\nYour move."}]

    def respond(self, message: ChatCompletionMessage) -> list[dict[str, Any]] | None:
        found = MOVE.search(message.content or "")
        moved = slide(self.board, found.group(1).lower()) if found else self.board
        if moved == self.board:
            self.invalid = True
            return None
        self.board = moved
        self.moves += 1
        self._spawn()
        if self.max_tile() >= 2048 or all(slide(self.board, d) == self.board for d in ("up", "down", "left", "right")):
            return None
        return [{"role": "user", "content": f"{render(self.board)}\nYour move."}]

    def max_tile(self) -> int:
        return max(max(row) for row in self.board)

    def reward(self) -> float:
        return math.log2(self.max_tile()) / math.log2(2048)

    def metrics(self) -> dict[str, float]:
        return {"moves": float(self.moves), "max_tile": float(self.max_tile()), "invalid": float(self.invalid)}
