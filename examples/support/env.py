"""Airline customer support, in the spirit of tau-bench's airline domain: tools, a policy, a checkable outcome.

A bundled database of flights and reservations; the agent helps a scripted customer through five
tools (``get_reservation``, ``search_flights``, ``change_flight``, ``cancel_reservation``,
``refund``). Each task states what the database must look like at the end (and, for questions,
what the answer must contain): the reward is 1 when it does, 0 otherwise — whatever the agent
said. The customer answers with the next line of its script whenever the agent replies in
text, and leaves when the script is done. Tools refuse impossible actions (no seats, another
route); the refund policy is the agent's to follow (the outcome check catches a wrong refund).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from openai.types.chat.chat_completion_message import ChatCompletionMessage

FLIGHTS: dict[str, dict[str, Any]] = {
    "FW100": {"origin": "SFO", "destination": "JFK", "date": "2025-06-01", "departs": "08:00", "seats": 4},
    "FW102": {"origin": "SFO", "destination": "JFK", "date": "2025-06-02", "departs": "08:00", "seats": 2},
    "FW104": {"origin": "SFO", "destination": "JFK", "date": "2025-06-02", "departs": "17:30", "seats": 0},
    "FW200": {"origin": "JFK", "destination": "SFO", "date": "2025-06-05", "departs": "14:30", "seats": 6},
    "FW300": {"origin": "LAX", "destination": "SEA", "date": "2025-06-03", "departs": "11:15", "seats": 3},
}
RESERVATIONS: dict[str, dict[str, Any]] = {
    "R1001": {"passenger": "Ada Lovelace", "flight": "FW100", "cabin": "economy", "paid": 320, "refundable": False},
    "R1002": {"passenger": "Bo Diddley", "flight": "FW300", "cabin": "business", "paid": 450, "refundable": True},
    "R1003": {"passenger": "Cy Twombly", "flight": "FW200", "cabin": "economy", "paid": 310, "refundable": False},
    "R1004": {"passenger": "Dee Dee Ramone", "flight": "FW200", "cabin": "economy", "paid": 310, "refundable": False},
}
POLICY = """You are a customer-support agent for Flywheel Air. Today is 2025-05-20.
Policy:
- Look the reservation up and check that the customer's name matches it before doing anything.
- Flight changes keep the same origin and destination. Economy changes cost a $50 fee, which change_flight charges;
  business changes are free.
- Cancellations: a business or refundable reservation is refunded in full to the original payment (cancel it, then
  refund the amount paid). Any other reservation gets no refund: cancel it and tell the customer the amount paid
  becomes travel credit.
- Before changing or cancelling anything, say what you will do and get the customer's yes.
- Answer questions from the reservation and flight data; never invent information."""


def _function(name: str, description: str, **properties: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {key: {"type": "string", "description": text}
                                         for key, text in properties.items()},
        "required": list(properties)}}}


TOOLS = [
    _function("get_reservation", "A reservation with its flight.", reservation_id="e.g. R1001"),
    _function("search_flights", "Flights on a route and day.", origin="airport code", destination="airport code",
              date="YYYY-MM-DD"),
    _function("change_flight", "Move a reservation to another flight of the same route.", reservation_id="id",
              flight="the new flight number"),
    _function("cancel_reservation", "Cancel a reservation (no refund by itself).", reservation_id="id"),
    _function("refund", "Refund an amount to the reservation's original payment.", reservation_id="id",
              amount="dollars"),
]


@dataclass(frozen=True)
class Task:
    name: str
    script: tuple[str, ...]  # the customer's lines: the first opens, each later one answers a text reply
    expected: dict[str, dict[str, Any]]  # reservation id -> fields it must have at the end
    answer_contains: str | None = None


TASKS = (
    Task("change", ("Hi, Ada Lovelace here, reservation R1001. Can you move me to the same flight one day later?",
                    "Yes, please go ahead.", "Thanks, that's all."),
         {"R1001": {"flight": "FW102", "fees": 50, "status": "active"}}),
    Task("refund", ("Bo Diddley, reservation R1002. I have to cancel my trip and I want my money back.",
                    "Yes, cancel it.", "Thank you."),
         {"R1002": {"status": "cancelled", "refunded": 450}}),
    Task("no-refund", ("I'm Cy Twombly, R1003. Cancel my flight and put the money back on my card.",
                       "Fine, cancel it anyway.", "OK."),
         {"R1003": {"status": "cancelled", "refunded": 0}}),
    Task("question", ("Dee Dee Ramone, R1004. What time does my flight leave?", "Great, thanks."),
         {"R1004": {"status": "active", "flight": "FW200"}}, answer_contains="14:30"),
    Task("full-flight", ("Ada Lovelace, R1001. Move me to the 5:30 pm flight on June 2, please.",
                         "No, only the evening one works for me.", "Then leave it as it is."),
         {"R1001": {"flight": "FW100", "fees": 0, "status": "active"}}),
)


@dataclass
class Conversation:
    """One support conversation; see the module docstring."""

    task: Task
    tools: list[dict[str, Any]] | None = field(default_factory=lambda: TOOLS)
    max_turns: int = 8
    tool_calls: int = 0
    tool_errors: int = 0
    replies: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.flights = copy.deepcopy(FLIGHTS)
        self.reservations = {rid: {**r, "status": "active", "fees": 0, "refunded": 0}
                             for rid, r in copy.deepcopy(RESERVATIONS).items()}
        self.lines = list(self.task.script)

    def start(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": POLICY}, {"role": "user", "content": self.lines.pop(0)}]

    def respond(self, message: ChatCompletionMessage) -> list[dict[str, Any]] | None:
        if message.tool_calls:
            return [{"role": "tool", "tool_call_id": call.id, "content": self.call(call.function.name,
                                                                                  call.function.arguments)}
                    for call in message.tool_calls if call.type == "function"]
        self.replies.append(message.content or "")
        return [{"role": "user", "content": self.lines.pop(0)}] if self.lines else None

    def call(self, name: str, arguments: str) -> str:
        """Run one tool; its answer (or error) as the JSON text the model reads."""
        self.tool_calls += 1
        try:
            args = json.loads(arguments or "{}")
            result = getattr(self, f"_{name}")(**args) if name in {t["function"]["name"] for t in TOOLS} else None
            if result is None:
                raise ValueError(f"no tool named {name!r}")
        except (ValueError, TypeError, KeyError) as exc:
            self.tool_errors += 1
            return json.dumps({"error": str(exc)})
        return json.dumps(result)

    def _reservation(self, reservation_id: str) -> dict[str, Any]:
        if reservation_id not in self.reservations:
            raise KeyError(f"no reservation {reservation_id}")
        return self.reservations[reservation_id]

    def _get_reservation(self, reservation_id: str) -> dict[str, Any]:
        reservation = self._reservation(reservation_id)
        return {"reservation_id": reservation_id, **reservation, "flight_details": self.flights[reservation["flight"]]}

    def _search_flights(self, origin: str, destination: str, date: str) -> dict[str, Any]:
        wanted = (origin, destination, date)
        return {"flights": [{"flight": number, **flight} for number, flight in self.flights.items()
                            if (flight["origin"], flight["destination"], flight["date"]) == wanted]}

    def _change_flight(self, reservation_id: str, flight: str) -> dict[str, Any]:
        reservation = self._reservation(reservation_id)
        old, new = self.flights[reservation["flight"]], self.flights.get(flight)
        if new is None or (new["origin"], new["destination"]) != (old["origin"], old["destination"]):
            raise ValueError(f"{flight} is not a flight on the reservation's route")
        if new["seats"] < 1 or reservation["status"] != "active":
            raise ValueError(f"{flight} has no seat left" if new["seats"] < 1 else "the reservation is cancelled")
        old["seats"], new["seats"] = old["seats"] + 1, new["seats"] - 1
        reservation["flight"] = flight
        reservation["fees"] += 50 if reservation["cabin"] == "economy" else 0
        return {"ok": True, "fee": 50 if reservation["cabin"] == "economy" else 0}

    def _cancel_reservation(self, reservation_id: str) -> dict[str, Any]:
        self._reservation(reservation_id)["status"] = "cancelled"
        return {"ok": True}

    def _refund(self, reservation_id: str, amount: str) -> dict[str, Any]:
        reservation = self._reservation(reservation_id)
        reservation["refunded"] += int(float(amount))
        return {"ok": True, "refunded": reservation["refunded"]}

    def solved(self) -> bool:
        state_ok = all(self.reservations[rid][key] == value for rid, fields in self.task.expected.items()
                       for key, value in fields.items())
        answer_ok = self.task.answer_contains is None or any(self.task.answer_contains in r for r in self.replies)
        return state_ok and answer_ok

    def reward(self) -> float:
        return 1.0 if self.solved() else 0.0

    def metrics(self) -> dict[str, float]:
        return {"tool_calls": float(self.tool_calls), "tool_errors": float(self.tool_errors),
                "replies": float(len(self.replies))}


def task(number: int) -> Task:
    """Scenario ``number``: the tasks in turn."""
    return TASKS[number % len(TASKS)]
