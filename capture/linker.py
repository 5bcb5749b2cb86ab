"""The linker: which trajectory, and which parent turn, each captured turn continues (architecture §4).

It runs in the store process, on the recorder's writer thread, once per batch
(:meth:`flywheel.capture.store.Store.write_turns`): :meth:`TrajectoryLinker.prefetch` reads every
candidate the batch can need with a few indexed queries, :meth:`TrajectoryLinker.link`
then decides each turn in memory, :meth:`TrajectoryLinker.finish` records what rewritten
histories changed, and the store writes the rows it produced.

Rules, first match wins (docs/capture.md has an example of each):

1. **explicit**: ``X-Flywheel-Trajectory-Id`` names the trajectory; inside it the parent is
   found by the rules below, else it is the trajectory's latest turn.
2. **prefix**: the request's messages up to its last assistant message hash to a stored
   turn's ``h_out``: the client repeated that conversation verbatim (a retry or a rewind
   when that turn has a child already: a branch).
3. **tail**: the request's last assistant message is an answer the gateway gave
   (``turns.h_answer``: its canonical form with its tool-call ids), though what came before
   it changed. The candidates that agree best (the message before it too, ``h_replied_to``)
   must all lie in one trajectory; otherwise the evidence is ambiguous and is refused.
4. **prefix** on an older assistant message, when the latest matched nothing (the client
   edited the model's last answer): a branch from the turn the request still repeats.
5. **summary**: a request holding no assistant message quotes, in a message before its last, an answer the
   gateway gave (a summary the model wrote, sent in place of the history); the turns that gave it must lie
   in one trajectory, one of them unclaimed.
6. **new**: a trajectory of its own.

Several writers (gateway replicas on one PostgreSQL store, docs/storage.md): a batch locks the
trajectories it may continue (``SELECT ... FOR UPDATE``, in id order) before it reads which of
their turns already have a child, so a turn is claimed by one writer and the others see it claimed;
and a turn whose last answer no stored turn gave yet may wait for it (:class:`ParentWait`): the
replica that answered it may not have written it yet.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from itertools import islice
from types import SimpleNamespace
from typing import Any, TypeVar

import orjson
from sqlalchemy import bindparam, text
from sqlalchemy import select as sa_select
from sqlmodel import Session, col

from flywheel.capture.canonical import content_text, message_hash
from flywheel.capture.history import history_edits
from flywheel.capture.models import Trajectory, Turn
from flywheel.capture.turns import PreparedTurn, new_id

log = logging.getLogger("flywheel.linker")
T = TypeVar("T")

# Plain SQL (no statement cache on DuckDB); forks are never continued: the client never saw them
# DuckDB reads a table through an index only when the index's column is the one condition: forks are left out here.
_CANDIDATES = text("SELECT id, trajectory_id, depth, client_key_id, h_out, h_answer, source FROM turns "
                   "WHERE h_out IN :hashes ORDER BY created_at, id").bindparams(bindparam("hashes", expanding=True))
# Tail lookups capped at TAIL_CANDIDATES + 1 rows: an index range read, however many turns gave the answer
_TAIL_COLUMNS = "SELECT id, trajectory_id, depth, client_key_id, h_replied_to, created_at, h_answer"
_AGREEING = text(_TAIL_COLUMNS + " FROM turns WHERE h_answer = :h AND h_replied_to = :r AND source <> 'fork' "
                 "LIMIT :limit")
_ANSWERS = text(_TAIL_COLUMNS + " FROM turns WHERE h_answer = :h AND source <> 'fork' LIMIT :limit")
# DuckDB: a statement a batch (each is dear), on the h_answer index alone (any other condition makes it scan the
# table): up to :limit client turns per answer, and per (answer, replied-to) for the popular answers only; forks
# are counted apart and left out here.
_ANSWERS_BATCH = text(_TAIL_COLUMNS + ", source FROM turns WHERE h_answer IN :answers "
                      "QUALIFY row_number() OVER (PARTITION BY h_answer, source = 'fork') <= :limit"
                      ).bindparams(bindparam("answers", expanding=True))
_AGREEING_BATCH = text(_TAIL_COLUMNS + ", source FROM turns WHERE h_answer IN :answers "
                       "QUALIFY row_number() OVER (PARTITION BY h_answer, h_replied_to, source = 'fork') <= :limit"
                       ).bindparams(bindparam("answers", expanding=True))
_PARENTS = text("SELECT DISTINCT parent_turn_id FROM turns WHERE parent_turn_id IN :ids").bindparams(
    bindparam("ids", expanding=True))
_CONVERSATIONS = text("SELECT id, request_messages, response_message FROM turns WHERE id IN :ids").bindparams(
    bindparam("ids", expanding=True))

_TRAJECTORIES = Trajectory.__table__  # type: ignore[attr-defined]
# The trajectory columns linking a turn changes (TrajectoryLinker._touch_trajectory).
TOUCHED_COLUMNS = ("status", "closed_at", "close_reason", "turn_count", "branch_count", "latest_turn_id", "updated_at",
                   "group_key")
# An answer whose preceding message changed too is evidence alone only when it is hard to repeat by chance.
DISTINCT_ANSWER_CHARS = 40
# Evidence more stored turns share ("OK" after "thanks") is ambiguous: refused without reading them all
TAIL_CANDIDATES = 32
# A summary follows its template's label or a line break: tried after the first QUOTE_STARTS of them, never all
_QUOTE_START = re.compile(r"[:\n]\s*")
QUOTE_STARTS = 4
_QUOTING_ROLES = ("system", "developer", "user")


@dataclass
class _Candidate:
    turn_id: str
    trajectory_id: str
    depth: int
    client_key_id: str | None
    has_children: bool
    h_answer: str | None = None
    h_replied_to: str | None = None


@dataclass(frozen=True)
class _Tail:
    """A request's last assistant message, as the tail rule matches it."""

    index: int  # its position in the request
    answer: str  # message_hash of it
    replied_to: str | None  # message_hash of the message before it
    distinct: bool  # it carries tool-call ids or at least DISTINCT_ANSWER_CHARS of text


@dataclass(frozen=True)
class _Quote:
    """Text of a request's message that may be an answer the gateway gave, quoted (the summary rule)."""

    index: int  # the quoting message's position in the request
    answer: str  # message_hash of the text as an assistant answer


@dataclass(frozen=True)
class _Match:
    parent: _Candidate
    how: str  # prefix | tail | summary | latest
    position: int | None  # where the parent's answer sits in the request (None: it does not)


class TrajectoryLinker:
    """Finds the trajectory (and the parent turn) each new turn of a batch continues (the rules above).

    Among stored turns a prefix matches (same client key), an unclaimed one (no child yet) is
    continued, oldest first, so identical conversations are claimed one each instead of
    merged; if all are claimed, the client rewound or retried and the new turn starts a
    branch (when they lie in one trajectory). A tail match must be unambiguous: where it is
    not, a new trajectory is better than a wrong link. ``counts`` tallies each turn's rule
    (``link_prefix``, ``link_tail``, ``link_summary``, ``link_explicit``, ``link_new``) and the tails and
    quoted summaries refused (``tail_ambiguous``).

    :meth:`prefetch` reads every candidate a batch can need: the last assistant prefix of
    every request (``h_out IN (...)``), then, for the requests it did not resolve, their
    older prefixes and their tails (``h_answer IN (...)``). Linking then runs in memory, and
    turns of the same batch see each other. Per request that is O(messages) hashing and a
    few index probes, never a scan.
    """

    def __init__(self, session: Session, *, lock: bool = False) -> None:
        self.session = session
        self.lock = lock  # several writers: lock the trajectories a batch may continue (PostgreSQL)
        self._batched_tails = session.get_bind().dialect.name == "duckdb"  # _probe_answers: statements are dear
        # Plain records, not ORM objects: those are dear to build, and each would flush as its own UPDATE
        self._trajectories: dict[str, SimpleNamespace] = {}  # stored ones this batch may continue (candidates)
        self._continued: dict[str, None] = {}  # ... and those it did, in order
        self._new_trajectories: dict[str, SimpleNamespace] = {}  # created by this batch
        self._by_hash: dict[str, list[_Candidate]] = {}  # by h_out
        self._by_answer: dict[tuple[str, str | None], list[_Candidate]] = {}  # by (h_answer, h_replied_to | None)
        self._popular: set[tuple[str, str | None]] = set()  # evidence too many stored turns share
        self._latest: dict[str, _Candidate] = {}  # explicit trajectories' latest turns
        self._candidates: dict[str, _Candidate] = {}  # by turn id
        self._tails: dict[str, _Tail | None] = {}  # by the new turn's id
        self._quotes: dict[str, list[_Quote]] = {}  # by the new turn's id
        self._rewritten: list[tuple[dict[str, Any], str]] = []  # (turn, parent id): history_edits to compute
        self._batch_turns: dict[str, dict[str, Any]] = {}  # this batch's turns by id
        self.turns: list[dict[str, Any]] = []
        self.counts: Counter[str] = Counter()

    def prefetch(self, batch: list[PreparedTurn]) -> None:
        # Most requests continue their last assistant message: one index probe per turn in the common case
        linkable = [item for item in batch if item.row["source"] != "fork"]
        last = {item.assistant_prefix_hashes[0] for item in linkable if item.assistant_prefix_hashes}
        self._probe(last)
        unresolved: list[PreparedTurn] = []
        answered_in_batch: set[str] = set()
        for item in linkable:
            hashes = item.assistant_prefix_hashes
            if hashes and hashes[0] not in answered_in_batch and not self._resolves(item, hashes[0]):
                unresolved.append(item)
            answered_in_batch.add(item.row["h_out"])
        # A request without assistant messages may quote a summary the model wrote: probed with the tails.
        quoted = {(quote.answer, None) for item in linkable if not item.explicit_trajectory_id
                  for quote in self._quoted(item)}
        self._probe_answers({(tail.answer, tail.replied_to) for tail in map(self._tail, unresolved) if tail} | quoted)
        # Older prefixes (rule 4) only where the tail settles nothing: each is one more index probe
        self._probe({h for item in unresolved if not self._tail_pool(item) for h in item.assistant_prefix_hashes[1:]}
                    - last)
        wanted = sorted({c.trajectory_id for c in self._candidates.values()} |
                        {item.explicit_trajectory_id for item in batch if item.explicit_trajectory_id} |
                        {item.parent_trajectory_id for item in batch if item.parent_trajectory_id})
        for chunk in chunks(wanted, 500):
            query = sa_select(*_TRAJECTORIES.columns).where(_TRAJECTORIES.c.id.in_(chunk))
            if self.lock:  # held to the commit; in id order, so two batches never wait for each other in a cycle
                query = query.order_by(_TRAJECTORIES.c.id).with_for_update()
            for row in self.session.execute(query).mappings().all():
                self._trajectories[row["id"]] = SimpleNamespace(**row)
        latest_ids = sorted(t.latest_turn_id for t in self._trajectories.values() if t.explicit and t.latest_turn_id)
        columns = (col(Turn.id), col(Turn.trajectory_id), col(Turn.depth), col(Turn.client_key_id))
        for chunk in chunks(latest_ids, 500):
            for turn_id, trajectory_id, depth, key in self.session.execute(sa_select(*columns)
                                                                           .where(col(Turn.id).in_(chunk))).all():
                self._latest[trajectory_id] = self._candidate(turn_id, trajectory_id, depth, key)
        # Claimed candidates, read after the lock: a child another writer added is committed, or waits for us
        by_id = self._candidates
        for chunk in chunks(sorted(by_id), 500):
            for (parent_id,) in self.session.execute(_PARENTS, {"ids": chunk}).all():
                by_id[parent_id].has_children = True

    def _probe(self, hashes: set[str]) -> None:
        """Stored turns whose ``h_out`` is one of ``hashes``, into ``_by_hash`` (oldest first)."""
        for chunk in chunks(sorted(hashes), 500):
            for turn_id, trajectory_id, depth, key, h_out, h_answer, source in self.session.execute(
                    _CANDIDATES, {"hashes": chunk}).all():
                if source == "fork":
                    continue
                candidate = self._candidate(turn_id, trajectory_id, depth, key)
                candidate.h_answer = h_answer
                self._by_hash.setdefault(h_out, []).append(candidate)

    def _probe_answers(self, tails: set[tuple[str, str | None]]) -> None:
        """For each (answer, message it replied to): the stored turns that gave the answer after that message, and
        those that gave it at all, into ``_by_answer`` (oldest first); either set larger than TAIL_CANDIDATES goes
        into ``_popular`` instead, none of its turns read."""
        keys = {key for answer, replied_to in tails for key in ((answer, None), (answer, replied_to)) if
                key not in self._by_answer and key not in self._popular}
        limit = TAIL_CANDIDATES + 1
        found: dict[tuple[str, str | None], list[Any]] = {key: [] for key in keys}
        if self._batched_tails:
            answered: dict[str, list[Any]] = {answer: [] for answer, _ in keys}
            for chunk in chunks(sorted(answered), 500):
                for row in self.session.execute(_ANSWERS_BATCH, {"answers": chunk, "limit": limit}).all():
                    if row[7] != "fork":
                        answered[row[6]].append(row)
            popular = sorted({answer for answer, replied_to in keys if replied_to and len(answered[answer]) >= limit})
            for answer, replied_to in keys:  # an answer given fewer times: every turn that gave it is read already
                found[(answer, replied_to)] = [row for row in answered[answer] if replied_to in (None, row[4])]
            for chunk in chunks(popular, 500):
                asked = set(chunk)
                agreeing: dict[tuple[str, str | None], list[Any]] = {k: [] for k in keys if k[0] in asked and k[1]}
                for row in self.session.execute(_AGREEING_BATCH, {"answers": chunk, "limit": limit}).all():
                    if row[7] != "fork" and (row[6], row[4]) in agreeing:
                        agreeing[(row[6], row[4])].append(row)
                found.update(agreeing)
        else:  # PostgreSQL: one bounded index range read per key (LIMIT), however many turns gave the answer
            for answer, replied_to in sorted(keys, key=str):
                query, params = (_AGREEING, {"r": replied_to}) if replied_to else (_ANSWERS, {})
                found[(answer, replied_to)] = list(self.session.execute(query, {"h": answer, "limit": limit,
                                                                                **params}).all())
        for key, rows in found.items():
            if len(rows) > TAIL_CANDIDATES:
                self._popular.add(key)
                continue
            self._by_answer[key] = []
            for turn_id, trajectory_id, depth, client_key, h_replied_to, *_ in sorted(rows, key=_oldest_first):
                candidate = self._candidate(turn_id, trajectory_id, depth, client_key)
                candidate.h_answer, candidate.h_replied_to = key[0], h_replied_to
                self._by_answer[key].append(candidate)

    def _resolves(self, item: PreparedTurn, h: str) -> bool:
        """Whether the stored turns ending in ``h`` settle this turn's parent: some exist (same key; same explicit
        trajectory), all in one trajectory (else a retry may be refused and the other rules asked)."""
        trajectories = {c.trajectory_id for c in self._by_hash.get(h, ()) if c.client_key_id == item.row[
            "client_key_id"] and item.explicit_trajectory_id in (None, c.trajectory_id)}
        return len(trajectories) == 1

    def _candidate(self, turn_id: str, trajectory_id: str, depth: int, key: str | None) -> _Candidate:
        """One object per stored turn, so marking it claimed is seen by every path that found it."""
        if turn_id not in self._candidates:
            self._candidates[turn_id] = _Candidate(turn_id, trajectory_id, depth, key, False)
        return self._candidates[turn_id]

    def _tail(self, item: PreparedTurn) -> _Tail | None:
        """The request's last assistant message and the one before it, hashed once per turn."""
        turn_id = item.row["id"]
        if turn_id not in self._tails:
            messages = item.row["request_messages"] or []
            index = _last_assistant(messages)
            if index is None:
                self._tails[turn_id] = None
            else:
                answer = messages[index]
                distinct = any(isinstance(c, dict) and c.get("id") for c in answer.get("tool_calls") or []) or \
                    len(content_text(answer.get("content"))) >= DISTINCT_ANSWER_CHARS
                self._tails[turn_id] = _Tail(index, message_hash(answer),
                                             message_hash(messages[index - 1]) if index else None, distinct)
        return self._tails[turn_id]

    def _quoted(self, item: PreparedTurn) -> list[_Quote]:
        """In a request holding no assistant message, the system, developer and user messages before its last one,
        from after each of their first QUOTE_STARTS colons or line breaks (as sent and stripped), that are
        at least DISTINCT_ANSWER_CHARS long: hashed as an answer would be, once per turn."""
        turn_id = item.row["id"]
        if turn_id not in self._quotes:
            quotes: dict[str, _Quote] = {}
            messages = item.row["request_messages"] or []
            for index, message in enumerate(messages[:-1] if not item.assistant_prefix_hashes else ()):
                text = content_text(message.get("content")) if message.get("role") in _QUOTING_ROLES else ""
                if len(text) < DISTINCT_ANSWER_CHARS:
                    continue
                # never the whole message: an answer handed on verbatim as a prompt (a sub-agent's task) is no summary
                starts = [m.end() for m in islice(_QUOTE_START.finditer(text), QUOTE_STARTS)]
                for quoted in {variant for start in starts for variant in (text[start:], text[start:].strip())}:
                    if len(quoted) >= DISTINCT_ANSWER_CHARS:
                        h = message_hash({"role": "assistant", "content": quoted})
                        quotes.setdefault(h, _Quote(index, h))
            self._quotes[turn_id] = list(quotes.values())
        return self._quotes[turn_id]

    def awaits_parent(self, item: PreparedTurn) -> bool:
        """Whether no stored turn (of its client key; of its explicit trajectory, when it names one) that gave the
        request's last assistant message is unclaimed, by prefix or by tail, nor one this batch linked so far.

        Then the turn that gave it to this conversation may still be on its way from another replica: linking
        now would start a trajectory of its own, or branch (or continue) another conversation that happened to
        say the same. Side-effect free: rules 2 and 3 looked up, nothing linked or counted."""
        hashes = item.assistant_prefix_hashes
        if item.row["source"] == "fork" or not hashes:
            return False
        within = item.explicit_trajectory_id
        last = _last_assistant(item.row["request_messages"] or [])
        prefix = [c for c in self._prefix_candidates(item, hashes[0], last) if within in (None, c.trajectory_id)]
        return all(c.has_children for c in (*prefix, *(self._tail_pool(item, within) or ())))

    def link(self, item: PreparedTurn) -> dict[str, Any]:
        """The turn's row with its trajectory, parent, depth and link rule filled in."""
        row = item.row
        match: _Match | None = None
        if row["source"] == "fork":  # a sibling the client never saw: its own one-turn trajectory
            trajectory_id, rule = new_id("traj"), "new"
        elif item.explicit_trajectory_id and self._owned_by(item.explicit_trajectory_id, row["client_key_id"]):
            trajectory_id, rule = item.explicit_trajectory_id, "explicit"
            match = self._parent_in(trajectory_id, item)
        else:
            match = self._find_parent(item)
            rule = match.how if match else "new"
            trajectory_id = match.parent.trajectory_id if match else new_id("traj")
            existing = self._trajectory(trajectory_id) if match else None
            if existing is not None and existing.status == "closed":
                trajectory_id = new_id("traj")  # closed ones are never reopened; parent_turn_id keeps the history
            if trajectory_id == item.parent_trajectory_id:
                trajectory_id = new_id("traj")  # the client says this is a sub-agent, not its parent's next turn
        parent = match.parent if match else None
        turn = {**row, "trajectory_id": trajectory_id, "parent_turn_id": parent.turn_id if parent else None,
                "depth": parent.depth + 1 if parent else 0, "link_rule": rule,
                "parent_message_index": match.position if match else None, "history_edits": None}
        if match is not None and match.how != "prefix":
            self._rewritten.append((turn, match.parent.turn_id))
        self._touch_trajectory(turn, explicit=trajectory_id == item.explicit_trajectory_id,
                               branched=parent is not None and parent.has_children,
                               parent_trajectory_id=item.parent_trajectory_id)
        if parent is not None:
            parent.has_children = True
        mine = _Candidate(turn["id"], trajectory_id, turn["depth"], turn["client_key_id"], False,
                          row.get("h_answer"), row.get("h_replied_to"))
        self._by_hash.setdefault(turn["h_out"], []).append(mine)  # later turns of this batch see this one
        if row.get("h_answer"):
            for key in {(row["h_answer"], None), (row["h_answer"], row.get("h_replied_to"))}:
                self._by_answer.setdefault(key, []).append(mine)
        self._latest[trajectory_id] = mine
        self._batch_turns[turn["id"]] = turn
        self.turns.append(turn)
        self.counts[f"link_{rule}"] += 1
        return turn

    def finish(self) -> None:
        """Record what each turn linked to a rewritten history changed (``history_edits``): one read of the
        stored parents' messages for the whole batch."""
        stored = sorted({parent_id for _, parent_id in self._rewritten if parent_id not in self._batch_turns})
        conversations: dict[str, list[dict[str, Any]]] = {}
        for chunk in chunks(stored, 500):
            for turn_id, request, response in self.session.execute(_CONVERSATIONS, {"ids": chunk}).all():
                conversations[turn_id] = [*(_json_value(request) or []), _json_value(response) or {}]
        for turn, parent_id in self._rewritten:
            parent = self._batch_turns.get(parent_id)
            previous = [*parent["request_messages"], parent["response_message"]] if parent else \
                conversations.get(parent_id, [])
            sent = turn["request_messages"] or []
            at = turn["parent_message_index"]
            if at is None:  # no answer of the parent in the request: compare up to its last assistant message
                tail = self._tails.get(turn["id"])
                at = tail.index if tail else -1
            turn["history_edits"] = history_edits(previous, sent[:at + 1])
        self._rewritten.clear()

    def new_trajectories(self) -> list[dict[str, Any]]:
        """Rows of the trajectories this batch started (the store inserts them)."""
        return [vars(t) for t in self._new_trajectories.values()]

    def touched_trajectories(self) -> list[dict[str, Any]]:
        """Stored trajectories this batch continued (or closed): the store updates their :data:`TOUCHED_COLUMNS`;
        the candidates it read and left alone are not written."""
        return [vars(self._trajectories[trajectory_id]) for trajectory_id in self._continued]

    def owners(self) -> dict[str, str | None]:
        """The client key of each trajectory this batch started or read."""
        return {t.id: t.client_key_id for t in (*self._trajectories.values(), *self._new_trajectories.values())}

    def close(self, trajectory_ids: set[str], reason: str, at: datetime) -> set[str]:
        """Close those of ``trajectory_ids`` still open that this batch started or continued, in the rows it writes
        (no ``UPDATE`` after them); the ids closed here."""
        closed = set()
        for trajectory_id in trajectory_ids:
            trajectory = self._new_trajectories.get(trajectory_id) or \
                (self._trajectories[trajectory_id] if trajectory_id in self._continued else None)
            if trajectory is not None and trajectory.status != "closed":
                trajectory.status, trajectory.closed_at, trajectory.close_reason = "closed", at, reason
                closed.add(trajectory_id)
        return closed

    def _find_parent(self, item: PreparedTurn) -> _Match | None:
        """Rules 2-5: the last assistant prefix, the tail, the older prefixes; without any, a quoted summary."""
        hashes = item.assistant_prefix_hashes
        if not hashes:  # no answer in the history: a first request, or one a summary stands for
            return self._summary_match(item)
        last = _last_assistant(item.row["request_messages"] or [])
        if last is None:
            return None
        found = self._prefix_match(item, hashes[0], last)
        if found is not None:
            return _Match(found, "prefix", last)
        tail = self._tail_match(item)
        if tail is not None:
            return tail
        positions = _assistant_positions(item)
        for h, position in zip(hashes[1:], positions[1:], strict=True):
            found = self._prefix_match(item, h, position)
            if found is not None:
                return _Match(found, "prefix", position)
        return None

    def _prefix_match(self, item: PreparedTurn, h: str, position: int) -> _Candidate | None:
        """A stored turn whose conversation the request repeats up to ``position``: the unclaimed one, oldest
        first, else the latest (a retry or a rewind: a branch) when they all lie in one trajectory; a retry
        that several identical conversations could have made starts a trajectory of its own. Conversations
        alike but for their tool-call ids (the prefix hashes leave them out) are told apart by the answer's
        own hash, ids included."""
        candidates = self._prefix_candidates(item, h, position)
        unclaimed = [c for c in candidates if not c.has_children]
        if unclaimed:
            return unclaimed[0]
        return candidates[-1] if len({c.trajectory_id for c in candidates}) == 1 else None

    def _prefix_candidates(self, item: PreparedTurn, h: str, position: int | None) -> list[_Candidate]:
        """Stored turns (same key) whose conversation ends in ``h``; several are told apart by the answer at
        ``position`` with its tool-call ids, when that leaves any."""
        candidates = [c for c in self._by_hash.get(h, ()) if c.client_key_id == item.row["client_key_id"]]
        if len(candidates) > 1 and position is not None:
            answer = message_hash(item.row["request_messages"][position])
            candidates = [c for c in candidates if c.h_answer == answer] or candidates
        return candidates

    def _tail_match(self, item: PreparedTurn, within: str | None = None) -> _Match | None:
        """Rule 3 (inside trajectory ``within`` when given): the stored turns (same key) that gave the request's
        last answer and agree best must all lie in one trajectory; its unclaimed one (or, all claimed, its
        latest: a retry after the history changed) is the parent. A refusal outside an explicit trajectory
        is counted."""
        pool = self._tail_pool(item, within)
        tail = self._tail(item)
        if not pool or tail is None:
            if pool == [] and within is None:
                self.counts["tail_ambiguous"] += 1
            return None
        unclaimed = [c for c in pool if not c.has_children]
        return _Match(unclaimed[0] if unclaimed else pool[-1], "tail", tail.index)

    def _tail_pool(self, item: PreparedTurn, within: str | None = None) -> list[_Candidate] | None:
        """The candidates rule 3 chooses from: None when no stored turn gave the request's last answer, ``[]`` when
        some did but the evidence is ambiguous (several trajectories, or a short answer alone)."""
        tail = self._tail(item)
        if tail is None:
            return None

        def mine(key: tuple[str, str | None]) -> list[_Candidate]:
            return [c for c in self._by_answer.get(key, ()) if c.client_key_id == item.row["client_key_id"]
                    and within in (None, c.trajectory_id)]

        if (tail.answer, tail.replied_to) in self._popular:
            return []
        agreeing = mine((tail.answer, tail.replied_to)) if tail.replied_to is not None else []
        if agreeing:
            pool = agreeing
        elif (tail.answer, None) in self._popular:
            return []
        else:
            candidates = mine((tail.answer, None))
            if not candidates:
                return None
            pool = candidates if tail.distinct else []
        return pool if len({c.trajectory_id for c in pool}) == 1 else []

    def _summary_match(self, item: PreparedTurn) -> _Match | None:
        """Rule 5: the stored turns (same key) whose answer the request quotes must all lie in one trajectory, and
        one must be unclaimed: the latest of those is the parent. An answer already continued (a document summary
        pasted into every new conversation, a retry) links nothing; a refusal is counted with the tails'."""
        found: list[tuple[_Quote, _Candidate]] = []
        for quote in self._quoted(item):
            if (quote.answer, None) in self._popular:
                self.counts["tail_ambiguous"] += 1
                return None
            found += [(quote, c) for c in self._by_answer.get((quote.answer, None), ())
                      if c.client_key_id == item.row["client_key_id"]]
        unclaimed = [(quote, c) for quote, c in found if not c.has_children]
        if len({c.trajectory_id for _, c in found}) == 1 and unclaimed:
            quote, parent = max(unclaimed, key=lambda pair: pair[1].depth)
            return _Match(parent, "summary", quote.index)
        if found:
            self.counts["tail_ambiguous"] += 1
        return None

    def _parent_in(self, trajectory_id: str, item: PreparedTurn) -> _Match | None:
        """Rule 1: inside an explicit trajectory, rules 2-4 restricted to it, else its latest turn."""
        hashes, positions = item.assistant_prefix_hashes, _assistant_positions(item)
        for index, (h, position) in enumerate(zip(hashes, positions, strict=True)):
            found = [c for c in self._by_hash.get(h, ()) if c.trajectory_id == trajectory_id]
            if found:
                return _Match(found[-1], "prefix", position)
            if index == 0:
                tail = self._tail_match(item, within=trajectory_id)
                if tail is not None:
                    return tail
        latest = self._latest.get(trajectory_id)
        return _Match(latest, "latest", None) if latest is not None else None

    def _owned_by(self, trajectory_id: str, client_key_id: str | None) -> bool:
        """An explicit id binds only within one client key: key B cannot append to key A's trajectory."""
        existing = self._trajectory(trajectory_id)
        if existing is None or existing.client_key_id == client_key_id:
            return True
        log.warning("explicit trajectory id %s belongs to another client key; starting a new trajectory",
                    trajectory_id)
        return False

    def _trajectory(self, trajectory_id: str) -> SimpleNamespace | None:
        return self._trajectories.get(trajectory_id) or self._new_trajectories.get(trajectory_id)

    def _sub_agent_parent(self, requested: str | None, trajectory_id: str, client_key_id: str | None) -> str | None:
        """The parent a sub-agent's new trajectory names, when it is another trajectory of the same client key
        that exists already (so parents never form a cycle and no key attaches to another's)."""
        if not requested or requested == trajectory_id:
            return None
        parent = self._trajectory(requested)
        if parent is None or parent.client_key_id != client_key_id:
            log.warning("parent trajectory id %s is unknown or belongs to another client key; %s is not linked "
                        "to it", requested, trajectory_id)
            return None
        return requested

    def _touch_trajectory(self, turn: dict[str, Any], *, explicit: bool, branched: bool,
                          parent_trajectory_id: str | None) -> None:
        trajectory = self._trajectory(turn["trajectory_id"])
        if trajectory is None:  # a sub-agent's parent is set when its trajectory starts, never later
            trajectory = SimpleNamespace(
                id=turn["trajectory_id"], alias=turn["alias"], status="open", explicit=explicit,
                client_key_id=turn["client_key_id"], task_key=turn["task_key"], group_key=turn["group_key"],
                created_at=turn["created_at"], updated_at=turn["created_at"], closed_at=None, close_reason=None,
                turn_count=0, branch_count=1, latest_turn_id=None, extra_metadata=turn["request_metadata"],
                parent_trajectory_id=self._sub_agent_parent(parent_trajectory_id, turn["trajectory_id"],
                                                            turn["client_key_id"]))
            self._new_trajectories[trajectory.id] = trajectory
        elif trajectory.id in self._trajectories:
            self._continued[trajectory.id] = None
        if trajectory.status == "closed":  # only an explicit id gets here: the client chose to continue it
            trajectory.status, trajectory.closed_at, trajectory.close_reason = "open", None, None
        if turn["source"] == "fork":
            trajectory.status, trajectory.closed_at, trajectory.close_reason = "closed", turn["created_at"], "fork"
        trajectory.turn_count += 1
        trajectory.branch_count += 1 if branched else 0
        trajectory.latest_turn_id = turn["id"]
        trajectory.updated_at = turn["created_at"]
        trajectory.group_key = trajectory.group_key or turn["group_key"]


class ParentWait:
    """Turns held back because their last answer is not stored yet: each may wait ``wait_s`` from when it was
    first held, then it is linked by the rules that remain (an older prefix, or a trajectory of its own).

    With one writer (DuckDB) a turn's parent is always written first: the store process reads one ordered
    stream. With several replicas the turn that gave an answer may sit in another replica's batch for up to
    its ``batch_wait_s`` plus a write, while the client already sent the next request to this one. The holder
    (the recorder) passes :meth:`take` back in with each batch, oldest first, so a held chain links in order.

    A fast client alternating between two replicas makes a longer chain: its turn k waits here for turn k-1 on
    the other replica, which waits there for turn k-2, held here, and so on, one batch per link. So a turn of
    whose conversation an older turn is held here too stays out of the batches (nothing to link it to yet, and
    relinking every held turn with every batch made the batches slow) and its wait starts again each time:
    it counts from when no older turn of its conversation is held here (bench/replicas.py, conversations part).
    """

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._turns: list[PreparedTurn] = []
        self._deadlines: dict[str, float] = {}  # by turn id, from the first hold

    def __len__(self) -> int:
        return len(self._turns)

    def ids(self) -> set[str]:
        return {item.row["id"] for item in self._turns}

    def may_wait(self, item: PreparedTurn) -> bool:
        deadline = self._deadlines.get(item.row["id"])
        return self.wait_s > 0 and (deadline is None or time.monotonic() < deadline)

    def hold(self, turns: list[PreparedTurn]) -> int:
        """Keep ``turns`` (what a write held back); returns how many are held for the first time."""
        now = time.monotonic()
        first = [item for item in turns if item.row["id"] not in self._deadlines]
        for item in first:
            self._deadlines[item.row["id"]] = now + self.wait_s
        self._turns.extend(turns)
        held = {item.row["id"] for item in self._turns}
        self._deadlines = {turn_id: at for turn_id, at in self._deadlines.items() if turn_id in held}
        return len(first)

    def take(self) -> list[PreparedTurn]:
        """The held turns to link again with the next batch, oldest first (:meth:`hold` keeps their deadlines); a
        turn that continues another held turn (its ``h_out`` among the turn's prefix hashes) stays held."""
        held = {item.row["h_out"] for item in self._turns}
        now, turns, waiting, self._turns = time.monotonic(), [], self._turns, []
        for item in waiting:
            if held.intersection(item.assistant_prefix_hashes):
                self._turns.append(item)
                self._deadlines[item.row["id"]] = now + self.wait_s  # its parent cannot have been written yet
            else:
                turns.append(item)
        return turns


def _oldest_first(row: Any) -> tuple[Any, str]:
    """A tail lookup's row (``_TAIL_COLUMNS``) by arrival, then id: the order the prefix probe reads in."""
    return row[5], row[0]


def _last_assistant(messages: list[dict[str, Any]]) -> int | None:
    """Where the request's last assistant message sits (a scan from the end: it is usually near)."""
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") == "assistant":
            return index
    return None


def _assistant_positions(item: PreparedTurn) -> list[int]:
    """Where the request's assistant messages sit, last first (aligned with ``assistant_prefix_hashes``)."""
    messages = item.row["request_messages"] or []
    return [i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "assistant"]


def _json_value(value: Any) -> Any:
    """A JSON column read by plain SQL: text on DuckDB and SQLite, already decoded on PostgreSQL."""
    return orjson.loads(value) if isinstance(value, str | bytes) else value


def chunks(items: list[T], size: int) -> Iterator[list[T]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]
