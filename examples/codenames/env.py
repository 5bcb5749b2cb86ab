"""Codenames, the guesser's side: given a clue and a number, name the board's words that go with it.

Each scenario draws an 11-word board from the bundled word sets: the clue's three words (yours), four
of the opponent's, three neutral words and the assassin. The agent guesses one word a turn
(``<guess>WAVE</guess>``, or ``<pass/>`` to stop); after each guess it is told what the word was.
The turn ends at the first word that is not yours, after number + 1 guesses, or on a pass.
Reward: (your words found - opponent's words named - 3 if the assassin was named) / number,
so 1.0 is a perfect turn; a reply that is neither a guess of a board word nor a pass ends the turn.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from openai.types.chat.chat_completion_message import ChatCompletionMessage

# Clue -> the words it points at. Boards mix one set (the team's) with words of the others.
WORD_SETS: dict[str, tuple[str, ...]] = {
    "ocean": ("WAVE", "SHIP", "FISH"), "space": ("STAR", "MOON", "ROCKET"), "kitchen": ("KNIFE", "OVEN", "PLATE"),
    "music": ("PIANO", "DRUM", "NOTE"), "winter": ("SNOW", "ICE", "SCARF"), "forest": ("TREE", "BEAR", "MOSS"),
    "money": ("BANK", "COIN", "PURSE"), "school": ("CHALK", "DESK", "EXAM"), "farm": ("COW", "BARN", "TRACTOR"),
    "castle": ("KING", "TOWER", "MOAT"), "weather": ("RAIN", "CLOUD", "THUNDER"), "garden": ("ROSE", "SPADE", "BEE"),
}
SYSTEM = ("You are the guesser in Codenames. Your spymaster gives a one-word clue and a number: how many words on "
          "the board go with the clue. Guess one board word per reply, like <guess>WORD</guess>, or stop with "
          "<pass/>. Avoid the opponent's words and above all the assassin.")
GUESS = re.compile(r"<guess>\s*([A-Za-z]+)\s*</guess>")


@dataclass(frozen=True)
class Scenario:
    seed: int


@dataclass
class Turn:
    """One guesser's turn; see the module docstring."""

    scenario: Scenario
    tools: list[dict[str, Any]] | None = None
    max_turns: int = 4
    found: int = 0
    opponent: int = 0
    assassin: bool = False
    guessed: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        draw = random.Random(self.scenario.seed)
        clues = sorted(WORD_SETS)
        draw.shuffle(clues)
        self.clue = clues[0]
        others = [word for clue in clues[1:] for word in WORD_SETS[clue]]
        draw.shuffle(others)
        self.roles = {word: "yours" for word in WORD_SETS[self.clue]}
        self.roles.update({w: "opponent's" for w in others[:4]} | {w: "neutral" for w in others[4:7]})
        self.roles[others[7]] = "the assassin"
        self.board = sorted(self.roles)
        draw.shuffle(self.board)
        self.number = len(WORD_SETS[self.clue])

    def start(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Board: {', '.join(self.board)}\nClue: {self.clue} {self.number}"}]

    def respond(self, message: ChatCompletionMessage) -> list[dict[str, Any]] | None:
        found = GUESS.search(message.content or "")
        word = found.group(1).upper() if found else None
        if word is None or word not in self.roles or word in self.guessed:
            return None  # a pass, or not a guess of a board word: the turn ends
        self.guessed.add(word)
        role = self.roles[word]
        self.found += role == "yours"
        self.opponent += role == "opponent's"
        self.assassin |= role == "the assassin"
        if role != "yours" or len(self.guessed) > self.number or self.found == self.number:
            return None
        return [{"role": "user", "content": f"{word} is yours. Guess again or <pass/>."}]

    def reward(self) -> float:
        return (self.found - self.opponent - 3 * self.assassin) / self.number

    def metrics(self) -> dict[str, float]:
        return {"found": float(self.found), "guesses": float(len(self.guessed)), "assassin": float(self.assassin)}
