"""A deduction puzzle in the style of temporal clue: who did it, with what, where, and when.

Each scenario's seed draws a solution among 4 suspects x 4 weapons x 4 rooms x 4 times and then
clues that are true of it — eliminations, "before/after" on the clock, "either ... or", "if in
the X then not with the Y" — until exactly one combination fits them all (checked by brute force
over the 256). The agent answers once, with JSON. Reward: the share of the four fields it got right.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import product
from typing import Any

from openai.types.chat.chat_completion_message import ChatCompletionMessage

SUSPECTS = ("Mrs. White", "Colonel Mustard", "Professor Plum", "Miss Scarlet")
WEAPONS = ("candlestick", "rope", "revolver", "wrench")
ROOMS = ("library", "kitchen", "study", "ballroom")
TIMES = ("9:00", "10:00", "11:00", "12:00")
FIELDS = ("suspect", "weapon", "room", "time")
SYSTEM = ("Solve the murder mystery from the clues: exactly one suspect, weapon, room and time fit them all. Think it "
          'through, then end with the answer as JSON: {"suspect": ..., "weapon": ..., "room": ..., "time": ...}.')

Case = tuple[str, str, str, str]
Clue = tuple[str, Callable[[Case], bool]]


def random_clue(draw: random.Random) -> Clue:
    """A clue (its text and what it says of a case), of a kind drawn at random."""
    kind = draw.choice(("not", "not", "clock", "either", "if"))
    if kind == "not":
        position = draw.randrange(4)
        value = draw.choice((SUSPECTS, WEAPONS, ROOMS, TIMES)[position])
        texts = (f"{value} did not do it.", f"The {value} was not the weapon.", f"It did not happen in the {value}.",
                 f"It did not happen at {value}.")
        return texts[position], lambda case: case[position] != value
    if kind == "clock":
        hour = draw.randrange(1, 4)
        if draw.random() < 0.5:
            return f"It happened before {TIMES[hour]}.", lambda case: TIMES.index(case[3]) < hour
        return f"It happened after {TIMES[hour - 1]}.", lambda case: TIMES.index(case[3]) > hour - 1
    if kind == "either":
        first, second = draw.sample(WEAPONS, 2)
        return f"Either the {first} or the {second} was used.", lambda case: case[1] in (first, second)
    room, weapon = draw.choice(ROOMS), draw.choice(WEAPONS)
    return (f"If it happened in the {room}, the weapon was not the {weapon}.",
            lambda case: case[2] != room or case[1] != weapon)


def make_puzzle(seed: int) -> tuple[Case, list[Clue]]:
    """A solution and clues that leave it as the only case (each clue: its text and what it says of a case)."""
    draw = random.Random(seed)
    solution: Case = (draw.choice(SUSPECTS), draw.choice(WEAPONS), draw.choice(ROOMS), draw.choice(TIMES))
    candidates = list(product(SUSPECTS, WEAPONS, ROOMS, TIMES))
    clues: list[Clue] = []
    while len(candidates) > 1:
        text, holds = random_clue(draw)
        remaining = [case for case in candidates if holds(case)]
        if holds(solution) and len(remaining) < len(candidates) and text not in (t for t, _ in clues):
            clues.append((text, holds))
            candidates = remaining
    draw.shuffle(clues)
    return solution, clues


@dataclass(frozen=True)
class Scenario:
    seed: int


def parse_answer(text: str | None) -> dict[str, str]:
    """The last JSON object in the reply, as strings (empty when there is none)."""
    for found in reversed(re.findall(r"\{[^{}]*\}", text or "")):
        try:
            data = json.loads(found)
        except ValueError:
            continue
        if isinstance(data, dict):
            return {str(k).lower(): str(v).strip() for k, v in data.items()}
    return {}


@dataclass
class Puzzle:
    """One puzzle, answered in one reply; see the module docstring."""

    scenario: Scenario
    tools: list[dict[str, Any]] | None = None
    max_turns: int = 1
    correct: int = 0
    answered: bool = False
    clues: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.solution, clues = make_puzzle(self.scenario.seed)
        self.clues = [text for text, _ in clues]

    def start(self) -> list[dict[str, Any]]:
        lines = "\n".join(f"{i}. {clue}" for i, clue in enumerate(self.clues, start=1))
        options = (f"Suspects: {', '.join(SUSPECTS)}. Weapons: {', '.join(WEAPONS)}. Rooms: {', '.join(ROOMS)}. "
                   f"Times: {', '.join(TIMES)}.")
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{options}\nClues:\n{lines}"}]

    def respond(self, message: ChatCompletionMessage) -> list[dict[str, Any]] | None:
        answer = parse_answer(message.content)
        self.answered = bool(answer)
        self.correct = sum(answer.get(name, "").lower() == value.lower()
                           for name, value in zip(FIELDS, self.solution, strict=True))
        return None

    def reward(self) -> float:
        return self.correct / len(FIELDS)

    def metrics(self) -> dict[str, float]:
        return {"solved": float(self.correct == len(FIELDS)), "answered": float(self.answered),
                "clues": float(len(self.clues))}
