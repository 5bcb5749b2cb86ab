"""The seed examples: their environments' rules, and a few episodes of each through a real gateway (tiny model).

The tiny model's moves are random text, so the episodes test the plumbing (every form runs, rewards
reach the gateway as feedback or as logged metrics, RULER judges through a scripted judge); the
environments' own tests check that a right answer earns its reward and a wrong one does not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import product
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat.chat_completion_message import ChatCompletionMessage

import flywheel
from examples.codenames import zero_code as codenames_zero_code
from examples.codenames.env import Scenario as Board
from examples.codenames.env import Turn
from examples.email_search import explicit as email_explicit
from examples.email_search.env import QUESTIONS, Search
from examples.game_2048 import explicit as game_2048_explicit
from examples.game_2048 import zero_code as game_2048_zero_code
from examples.game_2048.env import slide
from examples.support import explicit as support_explicit
from examples.support import zero_code as support_zero_code
from examples.support.env import TASKS, Conversation
from examples.temporal_clue import explicit as temporal_explicit
from examples.temporal_clue.env import FIELDS, ROOMS, SUSPECTS, TIMES, WEAPONS, Puzzle, make_puzzle
from examples.temporal_clue.env import Scenario as Puzzle_
from examples.tictactoe import explicit as tictactoe_explicit
from examples.tictactoe import zero_code as tictactoe_zero_code
from examples.tictactoe.env import Game, parse_move
from examples.tictactoe.env import Scenario as Seed
from tests.conftest import ADMIN_KEY
from tests.gateway_process import GatewayProcess
from tests.scripted_judge import ScriptedJudge


def said(text: str) -> ChatCompletionMessage:
    return ChatCompletionMessage(role="assistant", content=text)


def called(name: str, **arguments: Any) -> ChatCompletionMessage:
    return ChatCompletionMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]})


def test_tictactoe_rules() -> None:
    assert parse_move("I take <move>b2</move>.") == 4 and parse_move("B2") is None
    game = Game(Seed(0))
    game.start()
    assert game.respond(said("<move>B2</move>")) is not None and game.board[4] == "X" and game.board.count("O") == 1
    taken = game.board.index("O")
    assert game.respond(said(f"<move>{'ABC'[taken // 3]}{taken % 3 + 1}</move>")) is None
    assert (game.outcome, game.reward()) == ("invalid", -1.0)


def test_2048_rules() -> None:
    board = [[2, 2, 4, 4], [0, 0, 0, 0], [2, 0, 0, 0], [2, 0, 0, 0]]
    assert slide(board, "left")[0] == [4, 8, 0, 0]
    assert [row[0] for row in slide(board, "up")] == [4, 2, 0, 0]
    assert slide(board, "right")[0] == [0, 0, 4, 8]


def test_codenames_scores_found_words_against_mistakes() -> None:
    turn = Turn(Board(3))
    yours = sorted(w for w, role in turn.roles.items() if role == "yours")
    assert turn.respond(said(f"<guess>{yours[0]}</guess>")) is not None
    assassin = next(w for w, role in turn.roles.items() if role == "the assassin")
    assert turn.respond(said(f"<guess>{assassin}</guess>")) is None
    assert turn.reward() == pytest.approx((1 - 3) / 3)


def test_support_outcomes_follow_the_policy() -> None:
    change = Conversation(TASKS[0])
    change.start()
    change.respond(called("change_flight", reservation_id="R1001", flight="FW102"))
    change.respond(said("Done: you are on FW102, a $50 fee applies."))
    assert change.reward() == 1.0
    refund_against_policy = Conversation(TASKS[2])
    refund_against_policy.respond(called("cancel_reservation", reservation_id="R1003"))
    refund_against_policy.respond(called("refund", reservation_id="R1003", amount="310"))
    assert refund_against_policy.reward() == 0.0
    full = Conversation(TASKS[4])
    answer = full.respond(called("change_flight", reservation_id="R1001", flight="FW104"))
    assert answer is not None and "no seat" in answer[0]["content"] and full.reward() == 1.0
    question = Conversation(TASKS[3])
    question.respond(said("It leaves at 14:30."))
    assert question.reward() == 1.0 and Conversation(TASKS[3]).reward() == 0.0


def test_email_search_rewards_the_fact_and_its_source() -> None:
    question = QUESTIONS[1]  # the churn number, corrected in a later email
    cited = Search(question)
    assert cited.respond(called("search_emails", keywords=["churn"])) is not None
    assert cited.respond(called("return_final_answer", answer="2.9 percent", sources=["m11"])) is None
    uncited, stale = Search(question), Search(question)
    uncited.respond(said("It was 2.9 percent."))
    stale.respond(called("return_final_answer", answer="3.1 percent", sources=["m10"]))
    assert (cited.reward(), uncited.reward(), stale.reward()) == (1.0, 0.5, 0.0)


def test_temporal_clue_puzzles_have_one_solution() -> None:
    for seed in range(5):
        solution, clues = make_puzzle(seed)
        fits = [case for case in product(SUSPECTS, WEAPONS, ROOMS, TIMES) if all(holds(case) for _, holds in clues)]
        assert fits == [solution]
        assert Puzzle(Puzzle_(seed)).clues == [text for text, _ in clues]
    puzzle = Puzzle(Puzzle_(7))
    assert puzzle.respond(said("I give up.")) is None and puzzle.reward() == 0.0
    puzzle.respond(said("Easy. " + json.dumps(dict(zip(FIELDS, puzzle.solution, strict=True)))))
    assert puzzle.reward() == 1.0


@pytest.fixture(scope="module")
def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = GatewayProcess(tmp_path_factory.mktemp("examples"), f"""
[engines.local]
model = "{tiny_model}"
[aliases.agent]
engine = "local"
[auth]
admin_key = "{ADMIN_KEY}"
""", name="examples").start()
    yield process
    process.stop()


def rewarded(gateway: GatewayProcess) -> int:
    with flywheel.Gateway(gateway.url, admin_key=ADMIN_KEY) as admin:
        return len(admin.trajectories(has_reward=True, limit=1000)["data"])


@pytest.mark.parametrize("example", [tictactoe_zero_code, game_2048_zero_code, codenames_zero_code,
                                     support_zero_code], ids=lambda m: m.__name__.split(".")[1])
async def test_zero_code_examples_report_every_episode(gateway: GatewayProcess, example: Any) -> None:
    before = rewarded(gateway)
    curve = await example.main(["--base-url", f"{gateway.url}/v1", "--steps", "1", "--groups", "1", "--group-size",
                                "2", "--max-tokens", "6"])
    assert len(curve) == 1
    assert rewarded(gateway) == before + 2


def logged_rows(gateway: GatewayProcess) -> int:
    with flywheel.Gateway(gateway.url, admin_key=ADMIN_KEY) as admin:
        return len(admin.eval_metrics("agent", split="train"))


@pytest.mark.parametrize("example", [tictactoe_explicit, game_2048_explicit, support_explicit, temporal_explicit],
                         ids=lambda m: m.__name__.split(".")[1])
async def test_explicit_examples_gather_and_log(gateway: GatewayProcess, example: Any) -> None:
    before = logged_rows(gateway)
    curve = await example.main(["--gateway", gateway.url, "--admin-key", ADMIN_KEY, "--steps", "1", "--groups", "1",
                                "--group-size", "2", "--max-tokens", "6", "--no-train"])
    assert len(curve) == 1
    assert logged_rows(gateway) > before


async def test_the_email_search_example_is_judged_by_ruler(gateway: GatewayProcess) -> None:
    with ScriptedJudge() as judge:
        curve = await email_explicit.main([
            "--gateway", gateway.url, "--admin-key", ADMIN_KEY, "--steps", "1", "--groups", "2", "--group-size", "2",
            "--max-tokens", "6", "--no-train", "--judge-model", "openai/judge", "--judge-api-base", judge.base_url,
            "--judge-api-key", "unused"])
        assert len(judge.requests) == 2 and len(curve) == 1
