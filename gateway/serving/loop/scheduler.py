"""The loop: APScheduler jobs in the gateway process that turn captured traffic into served adapters.

Jobs, each on its own interval, each at most one run at a time, each run that acted or failed
recorded in ``job_runs`` (start, end, outcome, counts, error; of a quiet streak, its first run)::

    close_idle   (all aliases)  open trajectories with no new turn for capture.idle_close_s are closed
    form_groups  (all aliases)  closed trajectories become groups (explicit, same task, forks, cohorts)
    score        (per alias)    closed groups get rewards: feedback, and RULER where feedback is missing
    train        (per alias)    enough scored groups -> one round in a child process -> a candidate version
    gate         (per alias)    candidate -> offline gate -> canary (or promoted, or rejected)
    ab           (per alias)    canary: sequential test -> promote / reject; after a promotion: the monitor
                                compares with the predecessor's recorded rewards and rolls back on a drop

State lives in the store (versions and their gate results, groups, job runs), never only in
memory: after a restart the jobs pick up where the store says things are. With several replicas
on one PostgreSQL store the jobs run on one of them, the leader (``gateway/serving/loop/leader.py``);
every replica follows the store: each ``replicas.follow_s`` it serves the version the store says
serves each alias, and its canary, through the same hot swap. A job that raises is
logged, recorded ``failed`` and tried again at its next tick; it never stops the others, and
nothing here is on a client request's path. ``close_idle`` and ``form_groups`` always run
(capture's housekeeping); the others only with ``[loop] enabled``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from flywheel.capture.turns import new_id
from flywheel.gateway.core.config import LoopConfig
from flywheel.gateway.core.store_api import QUIET_STATUSES, AliasVersions, JobRunRecord, Pending, Version
from flywheel.gateway.serving.canary import CanarySplit
from flywheel.gateway.serving.gateway_state import GatewayState
from flywheel.gateway.serving.loop import gate as offline
from flywheel.gateway.serving.loop.abtest import Finished, SequentialTest, pair_finished
from flywheel.gateway.serving.loop.leader import Leadership, shared_store
from flywheel.gateway.serving.loop.promotion import promote_version
from flywheel.gateway.serving.loop.training_child import TrainingChild
from flywheel.gateway.serving.observability.loop_jobs import Observability
from flywheel.gateway.serving.store_client import as_it_is

log = logging.getLogger("flywheel.loop")


def _not_a_skipped_tick(record: logging.LogRecord) -> bool:
    """A tick that finds its job still running is skipped by design (max_instances=1); APScheduler warns of
    each, once a second while a round trains. A filter, not a level: LiteLLM's import resets that logger's level."""
    return "maximum number of running instances reached" not in record.getMessage()


logging.getLogger("apscheduler.scheduler").addFilter(_not_a_skipped_tick)

ALIAS_JOBS = ("score", "train", "gate", "ab")
GLOBAL_JOBS = ("close_idle", "form_groups")
SETTLE_S = 2.0  # the canary pairs rewards this old and older: the store's writes have landed by then
RUNS_SEND_S = 5.0  # scheduled runs are sent to the store together, at most this long after they end
MAX_UNSENT = 1000  # runs kept while the store process cannot take them; beyond, the oldest are let go


@dataclass
class Outcome:
    """What a run did: ``ok`` (it acted), ``idle`` (nothing to do), ``waiting`` (not yet), ``failed``."""

    status: str
    detail: str = ""
    counts: dict[str, Any] = field(default_factory=dict)


def offline_verdict(offline: dict[str, Any] | None, *, canary: bool) -> tuple[bool, str]:
    """What the offline gate's result means for the candidate: (rejected, why; empty when it passed or did not run)."""
    if offline is None:
        return False, ""
    decision = offline.get("decision") or ("passed" if offline["passed"] else "failed")  # rows before "decision"
    losses = f" ({offline['losses']} losses vs {offline['wins']} wins: p={offline['loss_p_value']:.3f})" \
        if "loss_p_value" in offline else ""
    if decision == "failed":
        return True, f"offline gate: win rate {offline['win_rate']:.2f} < {offline['threshold']:.2f}{losses}"
    if decision != "inconclusive":
        return False, ""
    if offline["ties"] == offline["contexts"]:
        unsure = f"offline gate inconclusive: all {offline['contexts']} contexts tie"
    else:
        unsure = f"offline gate inconclusive: win rate {offline['win_rate']:.2f}, losses not significant{losses}"
    return (False, f"{unsure}, the canary decides") if canary else (True, f"{unsure} and no canary to decide")


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)  # the store writes UTC


def training_due(pending: Pending, loop: LoopConfig, started_at: float) -> bool:
    """The loop's rule for a round (the store's ``pending`` of an alias): ``min_groups`` scored groups wait, or
    one does and the last round (with none yet: ``started_at``, when this loop started) is ``train_every_s`` old."""
    scored, last = pending.scored_groups, pending.last_trained_at
    since_last = time.time() - (_aware(last).timestamp() if last else started_at)
    return scored >= loop.min_groups or bool(scored and since_last >= loop.train_every_s)


class Loop:
    """Schedules the jobs and runs each one with its record in ``job_runs``."""

    def __init__(self, state: GatewayState, observability: Observability | None = None) -> None:
        self.state = state
        self.observability = observability or Observability()  # a span per run, the tracker's cue
        self.settings = state.settings
        self.child = TrainingChild(state.settings, state.store)
        self.scheduler = AsyncIOScheduler()
        self.stopping = False
        self.started_at = time.time()  # before any round: "every train_every_s" counts from the loop's start (lead)
        self._locks: dict[tuple[str, str | None], asyncio.Lock] = {}
        self.latest: dict[tuple[str, str | None], JobRunRecord] = {}  # each job's latest run here, per alias
        self._written: dict[tuple[str, str | None], str] = {}  # the status of each job's last run written
        self._unsent: list[JobRunRecord] = []  # runs for job_runs, sent every RUNS_SEND_S
        self._sent_at = time.monotonic()
        self._head_seen: dict[str, tuple[Any, ...]] = {}  # per alias, the versions the forks' head was chosen at
        self.jobs: dict[str, Callable[[str | None], Awaitable[Outcome]]] = {
            "close_idle": self.close_idle, "form_groups": self.form_groups, "score": self.score,
            "train": self.train, "gate": self.gate, "ab": self.ab}
        replicas = state.settings.replicas
        self.leadership = Leadership.for_database(state.settings.database, replicas.campaign_s, self._lead)

    # -- lifecycle ----------------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.follow()  # a canary that ran when the gateway stopped (or runs on another replica) goes on
        if shared_store(self.settings.database):
            self.scheduler.add_job(self.follow, "interval", seconds=self.settings.replicas.follow_s, id="follow",
                                   max_instances=1, coalesce=True, misfire_grace_time=None)
        self.scheduler.start()
        await self.leadership.start()

    async def _lead(self, leading: bool) -> None:
        """Schedule the jobs when this replica becomes the leader; remove them (and stop its rounds) when it stops."""
        if not leading:
            for job in self.scheduler.get_jobs():
                if job.id != "follow":
                    job.remove()
            await self.child.stop_all()  # the new leader records them failed
            await self.send_runs()
            self._head_seen.clear()  # as every follower, forks answer from the serving version until it leads again
            for alias in list(self.state.router.explorers):
                await self.state.router.explore(alias, 0, None)
            return
        self.started_at = time.time()
        self.latest.clear()  # the runs shown are this leadership's
        self._written.clear()
        try:
            # Trainer workers' rounds are not this replica's children: their versions time out instead (train job).
            recovered = await self.state.store.recover(rounds=not self.settings.train.workers)
            if recovered.rounds_failed:
                log.warning("loop: after the last leader stopped, %s", recovered)
        except Exception as exc:  # the store process is (re)starting: what is stale is found at the next start
            log.warning("loop: could not recover what the last leader left (%s)", exc)
        loop = self.settings.loop
        idle_s = self.settings.capture.idle_close_s
        intervals: dict[str, float] = {"close_idle": max(1.0, min(60.0, idle_s / 4)),
                                       "form_groups": self.settings.groups.form_every_s,
                                       "score": loop.score_every_s, "train": loop.tick_s, "gate": loop.tick_s,
                                       "ab": loop.tick_s}
        for job in GLOBAL_JOBS:
            self._schedule(job, None, intervals[job])
        if loop.enabled:
            for alias in self.settings.aliases:
                for job in ALIAS_JOBS:
                    self._schedule(job, alias, intervals[job])

    @staticmethod
    def of(request: Any) -> Loop:
        loop: Loop = request.app.state.loop
        return loop

    def lock(self, job: str, alias: str | None) -> asyncio.Lock:
        """One run of a job (per alias) at a time, whether the scheduler or a person started it."""
        return self._locks.setdefault((job, alias), asyncio.Lock())

    def _schedule(self, job: str, alias: str | None, seconds: float) -> None:
        self.scheduler.add_job(self.tick, "interval", args=[job, alias], seconds=seconds, id=f"{job}:{alias or '*'}",
                               max_instances=1, coalesce=True, misfire_grace_time=None,
                               next_run_time=datetime.now(UTC))  # first run at start, not one interval later

    async def stop(self) -> None:
        self.stopping = True
        await self.leadership.stop()  # removes the jobs, stops the rounds: they are recorded failed at the next start
        await self.send_runs()
        self.scheduler.shutdown(wait=False)

    async def follow(self) -> None:
        """Serve what the store says serves each alias, and its canary; never raises.

        Every replica does it every ``replicas.follow_s`` (a switch made on another replica reaches this one
        within that, plus the engine's load); at start it restores a canary that was running. A change this
        process made while the store was read is left to the next look, which reads the store again.
        """
        router = self.state.router
        generation = router.generation
        try:
            with as_it_is():
                rows = await self.state.store.serving()
        except Exception as exc:  # the store process is restarting: the next look follows
            log.warning("loop: could not read the serving versions (%s)", exc)
            return
        for alias in self.settings.aliases:
            if router.generation != generation:
                return
            try:
                if alias in rows:
                    await self._follow(alias, rows[alias])
            except Exception:
                log.exception("loop: %s could not follow the store; trying again at the next look", alias)

    async def _follow(self, alias: str, rows: AliasVersions) -> None:
        router = self.state.router
        current = rows.serving
        version = current.version if current else 0
        if router.get(alias).version != version:
            await router.switch(alias, version, current.path if current else None)
            log.info("loop: %s follows the store: version %d serves", alias, version)
        flight, split = rows.in_flight, router.canaries.get(alias)
        if split is None and flight is not None and flight.status == "canary":
            started = ((flight.gate or {}).get("online") or {}).get("started_at") or _now()
            await self._start_canary(alias, flight, started)
        elif split is not None and (flight is None or flight.version != split.served.version):
            await router.stop_canary(alias)  # decided elsewhere (promoted, rejected)

    # -- running one job ------------------------------------------------------------------------------------

    async def tick(self, job: str, alias: str | None) -> None:
        """A scheduled run: it reads the store as it is; turns still in the store process's batch, the next
        tick reads (a run a person starts, :meth:`run`, sees every turn answered before it)."""
        with as_it_is():
            await self.run(job, alias, scheduled=True)

    async def run(self, job: str, alias: str | None, *, scheduled: bool = False) -> dict[str, Any]:
        """Run ``job`` now (for ``alias``), recorded in ``job_runs`` (traced, tracked); never raises.

        Only the leader runs jobs: on a follower this answers ``follower`` and does nothing."""
        if not self.leadership.leading:
            return {"job": job, "alias": alias, "status": "follower",
                    "detail": "another replica runs the loop's jobs (the leader); this one follows the store"}
        try:
            return await self.observability.run_job(job, alias, lambda: self._run(job, alias, scheduled))
        except asyncio.CancelledError:
            if not self.stopping:
                raise
            # The scheduler's shutdown cancels a run in flight: the gateway is stopping, not the job failing.
            return {"job": job, "alias": alias, "status": "stopped", "detail": "the gateway stopped during the run"}

    async def _run(self, job: str, alias: str | None, scheduled: bool) -> dict[str, Any]:
        lock = self.lock(job, alias)
        if lock.locked():
            return {"job": job, "alias": alias, "status": "busy", "detail": "a run of this job is in progress"}
        async with lock:
            started, started_at = time.monotonic(), datetime.now(UTC)
            self.latest[(job, alias)] = JobRunRecord(id=new_id("job"), job=job, alias=alias, status="running",
                                                     started_at=started_at)
            error = None
            try:
                outcome = await self.jobs[job](alias)
            except Exception as exc:
                log.exception("loop: %s for %s failed; it runs again at its next tick", job, alias or "all aliases")
                outcome, error = Outcome("failed", f"{type(exc).__name__}: {exc}"), f"{type(exc).__name__}: {exc}"
            run = self.latest[(job, alias)].model_copy(update={
                "status": outcome.status, "finished_at": datetime.now(UTC), "counts": outcome.counts,
                "detail": outcome.detail, "error": error})
            self.latest[(job, alias)] = run
            self._record(run)
            if not scheduled or time.monotonic() - self._sent_at >= RUNS_SEND_S:  # a person's run shows at once
                await self.send_runs()
            if outcome.status not in QUIET_STATUSES:
                log.info("loop: %s %s: %s %s (%.1f s)", job, alias or "*", outcome.status, outcome.detail,
                         time.monotonic() - started)
            return {"job": job, "alias": alias, "status": outcome.status, "detail": outcome.detail,
                    "counts": outcome.counts, "error": error}

    def _record(self, run: JobRunRecord) -> None:
        """Keep ``run`` for ``job_runs`` unless it is quiet and so was the last run kept of its job: a quiet tick
        (several a second) is seen in :meth:`latest_runs`, and the store keeps the runs that acted."""
        key = (run.job, run.alias)
        if run.status in QUIET_STATUSES and self._written.get(key) == run.status:
            return
        self._written[key] = run.status
        self._unsent.append(run)

    async def send_runs(self) -> None:
        """Send the runs kept since the last send to the store, in one call; kept for the next send if it fails."""
        runs, self._unsent, self._sent_at = self._unsent, [], time.monotonic()
        if not runs:
            return
        try:
            await self.state.store.record_runs(runs)
        except Exception as exc:  # the store process is restarting: the next send takes them
            self._unsent = (runs + self._unsent)[-MAX_UNSENT:]
            log.warning("loop: could not record %d job runs (%s)", len(runs), exc)

    def latest_runs(self, alias: str, jobs: list[str]) -> dict[str, JobRunRecord]:
        """This process's latest run of each of ``jobs`` for ``alias`` (or alias-wide), running ones included:
        on the leader, fresher than ``job_runs``, which holds a quiet streak's first run."""
        found = {job: self.latest.get((job, alias)) or self.latest.get((job, None)) for job in jobs}
        return {job: run for job, run in found.items() if run is not None}

    # -- the jobs -------------------------------------------------------------------------------------------

    async def close_idle(self, alias: str | None) -> Outcome:
        closed = await self.state.store.close_idle()
        return Outcome("ok" if closed else "idle", f"closed {closed}", {"closed": closed})

    async def form_groups(self, alias: str | None) -> Outcome:
        formed = await self.state.store.form_groups()
        by_alias: dict[str, int] = {}
        for group in formed:
            by_alias[group.alias] = by_alias.get(group.alias, 0) + 1
        return Outcome("ok" if formed else "idle", f"formed {len(formed)} groups", {"formed": by_alias})

    async def score(self, alias: str | None) -> Outcome:
        summary = await self.state.store.score(alias)
        if not summary.groups:
            return Outcome("idle", "no closed groups", summary.model_dump(exclude={"fork_taught"}))
        for group_alias, position, taught in summary.fork_taught:  # where forking teaches (fork_turns = "untied")
            self.state.fork_yield.record(group_alias, position, taught)
        return Outcome("ok", f"scored {summary.scored}/{summary.groups} groups, {summary.failed} failed",
                       summary.model_dump(exclude={"failed_group_ids", "fork_taught"}))

    async def train(self, alias: str | None) -> Outcome:
        assert alias is not None
        store, loop = self.state.store, self.settings.loop
        rows = (await store.serving())[alias]
        flight, busy = rows.in_flight, rows.training
        if busy is not None:
            if self.settings.train.workers and \
                    time.time() - _aware(busy.created_at).timestamp() > loop.train_timeout_s:
                await store.record_failed_round(
                    alias, busy.version, f"no trainer worker reported the round within {loop.train_timeout_s:.0f} s")
                return Outcome("failed", f"version {busy.version}: no report from its trainer worker")
            return Outcome("idle", f"version {busy.version} is training: one round at a time")
        # Pipelined: while a canary runs, the next round trains on (a newer candidate supersedes a waiting one);
        # a candidate waiting for its offline gate with no canary running is next in line: wait for it.
        if flight is not None and (flight.status != "canary" or self.settings.train.workers):
            return Outcome("idle", f"version {flight.version} is {flight.status}: one candidate at a time")
        pending = await store.pending(alias)
        scored = pending.scored_groups
        if not training_due(pending, loop, self.started_at):
            return Outcome("waiting", f"{scored}/{loop.min_groups} scored groups", {"scored_groups": scored})
        if self.settings.train.workers:
            return Outcome("waiting", f"{scored} scored groups wait for a trainer worker", {"scored_groups": scored})
        result = await self.child.run(alias)
        if self.stopping:  # stopped with the gateway: the next start records the round as failed
            return Outcome("failed", "stopped with the gateway")
        if result.reply is None or result.reply.summary is None:  # the child recorded the round failed
            why = result.reply.error if result.reply else f"training process exited with {result.returncode}"
            log = f" (log {result.log_path})" if result.log_path else ""
            return Outcome("failed", f"{why}{log}", {"scored_groups": scored})
        summary = result.reply.summary
        timing = {"round_s": summary.round_s, "train_s": summary.train_s, "warm": summary.warm}
        if summary.status != "finished":
            return Outcome("ok", f"nothing trainable in the batch ({summary.status})",
                           {"scored_groups": scored, **timing})
        return Outcome("ok", f"version {summary.version} trained: a candidate",
                       {"scored_groups": scored, "version": summary.version, **timing})

    async def gate(self, alias: str | None) -> Outcome:
        assert alias is not None
        store, config = self.state.store, self.settings.loop
        rows = (await store.serving())[alias]
        if self.settings.groups.fork_from == "head":
            await self._follow_head(alias, rows)
        flight = rows.in_flight
        if flight is None or flight.status != "candidate":
            return Outcome("idle", "no candidate")
        version, results = flight.version, flight.gate or {}
        if config.gate.offline and "offline" not in results:
            checked = await self._offline_gate(alias, flight)
            if checked is None:
                return Outcome("waiting", "not enough held-out contexts yet", {"version": version})
            results = {**results, "offline": checked}
            await store.record_gate(alias, version, {"offline": checked})
        rejected, why = offline_verdict(results.get("offline") if config.gate.offline else None,
                                         canary=config.canary.enabled)
        if rejected:
            log.info("alias %s: version %d rejected: %s", alias, version, why)
            await self._unload(alias, flight)
            await store.decide(alias, version, "rejected", why)
            return Outcome("ok", f"version {version} rejected: {why}", {"version": version})
        if config.canary.enabled:
            started = _now()
            await self._start_canary(alias, flight, started)
            reason = f"on canary ({why})" if why else "on canary"
            log.info("alias %s: version %d %s", alias, version, reason)
            await store.decide(alias, version, "canary", reason,
                               gate={"online": {"started_at": started, "fraction": config.canary.fraction}})
            return Outcome("ok", f"version {version} {reason}, {config.canary.fraction:.0%} of conversations",
                           {"version": version})
        await promote_version(self.state, alias, version, reason="passed the offline gate")
        return Outcome("ok", f"version {version} promoted", {"version": version})

    async def ab(self, alias: str | None) -> Outcome:
        assert alias is not None
        if alias in self.state.router.canaries:
            return await self._judge_canary(alias)
        if self.settings.loop.monitor.enabled:
            return await self._monitor(alias)
        return Outcome("idle", "no canary, no monitor")

    # -- gate, canary, monitor --------------------------------------------------------------------------------

    async def _follow_head(self, alias: str, rows: AliasVersions) -> None:
        """Forks' siblings from the training head (``groups.fork_from = "head"``), read again when a version
        was trained or decided; never raises (the forks keep the version they had)."""
        seen = tuple((v.version, v.status) if v else None for v in (rows.serving, rows.in_flight, rows.waiting))
        if self._head_seen.get(alias) == seen:
            return
        try:
            head = await self.state.store.training_head(alias)
            await self.state.router.explore(alias, head.version if head else 0, head.path if head else None)
            self._head_seen[alias] = seen
        except Exception as exc:
            log.warning("loop: %s's forks stay on their version: the head could not be loaded (%s)", alias, exc)

    async def _offline_gate(self, alias: str, flight: Version) -> dict[str, Any] | None:
        config = self.settings.loop.gate
        contexts = await self.state.store.heldout_contexts(alias, config.contexts)
        if len(contexts) < config.min_contexts:
            return None
        candidate = self.state.router.version_model(alias, flight.version, flight.path)
        await self.state.router.load(candidate)
        hook = offline.gate_hook(config, self.settings.judge)
        scorer = offline.hook_scorer(hook) if hook else offline.ruler_scorer(self.settings.judge)
        return await offline.offline_gate(candidate, self.state.router.get(alias), contexts, config, scorer,
                                          scorer_name=hook or "ruler")

    async def _unload(self, alias: str, flight: Version) -> None:
        candidate = self.state.router.version_model(alias, flight.version, flight.path)
        if not self.state.router.in_use(candidate.adapter) and candidate.adapter in await candidate.engine.adapters():
            await candidate.engine.unload_adapter(candidate.adapter)

    async def _start_canary(self, alias: str, flight: Version, started_at: str) -> None:
        candidate = self.state.router.version_model(alias, flight.version, flight.path)
        await self.state.router.start_canary(CanarySplit(served=candidate, fraction=self.settings.loop.canary.fraction,
                                                         started_at=started_at))

    async def _judge_canary(self, alias: str) -> Outcome:
        store, config = self.state.store, self.settings.loop.canary
        split = self.state.router.canaries[alias]
        baseline, candidate = self.state.router.get(alias).version, split.served.version
        rows = await store.canary_rewards(alias, datetime.fromisoformat(split.started_at), [baseline, candidate])
        finished = [Finished(at=r.at, candidate=r.version == candidate, context=r.context, reward=r.reward)
                    for r in rows]
        ours = [r.reward for r in finished if r.candidate]
        theirs = [r.reward for r in finished if not r.candidate]
        test = SequentialTest(alpha=config.alpha, margin=config.margin, max_pairs=config.max_pairs,
                              low=config.reward_min, high=config.reward_max, min_gain=config.min_gain)
        # Rewards written in the last seconds may still be joined by earlier ones (commit order): not looked at yet.
        decision = test.add_pairs(pair_finished(finished, now=time.time() - SETTLE_S, wait_s=config.pair_wait_s))
        online = {**test.summary(), "started_at": split.started_at, "fraction": split.fraction,
                  "n_candidate": len(ours), "n_baseline": len(theirs), "baseline_version": baseline,
                  "mean_candidate": sum(ours) / len(ours) if ours else None,
                  "mean_baseline": sum(theirs) / len(theirs) if theirs else None}
        same = test.kinds.get("context", 0)
        counts = {"pairs": test.pairs, "same_context": same, "candidate": len(ours), "baseline": len(theirs)}
        if decision == "continue":
            newer = await self._newer_candidate(alias, test.pairs)
            if newer is not None:
                online["decision"] = "handed_over"
                reason = (f"canary: handed over to version {newer} undecided after {test.pairs} pairs "
                          f"(p(better)={test.better.p_value:.3f}, p(worse)={test.worse.p_value:.3f})")
                await store.decide(alias, candidate, "rejected", reason, gate={"online": online})
                await self.state.router.stop_canary(alias)
                return Outcome("ok", f"version {candidate} {reason[len('canary: '):]}", counts)
            await store.record_gate(alias, candidate, {"online": online})
            return Outcome("waiting", f"canary: {test.pairs} pairs ({same} on the same context), "
                                      f"p(better)={test.better.p_value:.3f}", counts)
        if decision == "better" or (decision == "max_pairs" and config.on_max == "promote"):
            shown = (f"better than version {baseline} (p={test.better.p_value:.4f}" if decision == "better" else
                     f"not shown worse than version {baseline} by max_pairs (on_max = promote; "
                     f"p(worse)={test.worse.p_value:.4f}")
            await store.record_gate(alias, candidate, {"online": online})
            await promote_version(self.state, alias, candidate, reason=f"canary: {shown}, {test.pairs} pairs)")
            return Outcome("ok", f"version {candidate} promoted by the canary", counts)
        if decision == "worse":
            shown = f"worse than version {baseline} (p={test.worse.p_value:.4f}"
        elif decision == "not_better" and test.not_better is not None:
            shown = (f"not better than version {baseline} by min_gain {config.min_gain:g} "
                     f"(p={test.not_better.p_value:.4f}")
        else:
            shown = f"not shown better than version {baseline} by max_pairs (p(better)={test.better.p_value:.4f}"
        # The store first: a replica that looks meanwhile sees a decided version, never a canary to restart.
        await store.decide(alias, candidate, "rejected", f"canary: {shown}, {test.pairs} pairs)",
                           gate={"online": online})
        await self.state.router.stop_canary(alias)
        return Outcome("ok", f"version {candidate} rejected by the canary", counts)

    async def _newer_candidate(self, alias: str, pairs: int) -> int | None:
        """A newer candidate the undecided canary hands over to (``hand_over_pairs``), if one waits."""
        after = self.settings.loop.canary.hand_over_pairs
        if after is None or pairs < after:
            return None
        waiting = (await self.state.store.serving())[alias].waiting
        return waiting.version if waiting is not None else None

    async def _monitor(self, alias: str) -> Outcome:
        """After a promotion: the new version's live rewards against its predecessor's recorded ones."""
        store, config = self.state.store, self.settings.loop.monitor
        current = (await store.serving())[alias].serving
        if current is None or current.previous_version is None or current.promoted_at is None:
            return Outcome("idle", "nothing promoted to watch")
        watched = (current.gate or {}).get("monitor") or {}
        if watched.get("finished"):
            return Outcome("idle", f"version {current.version} passed its monitor")
        previous, version = current.previous_version, current.version
        since = await store.rewards(alias, since=current.promoted_at, versions_in=[version])
        before = await store.rewards(alias, until=current.promoted_at, versions_in=[previous])
        ours = [r.reward for r in since.rewards]
        theirs = [r.reward for r in before.rewards][-config.baseline:]
        canary = self.settings.loop.canary
        test = SequentialTest(alpha=config.alpha, margin=config.margin, max_pairs=config.max_pairs,
                              low=canary.reward_min, high=canary.reward_max)
        decision = test.add_all(ours, theirs)
        summary = {**test.summary(), "baseline_version": previous, "n_new": len(ours), "n_baseline": len(theirs)}
        if decision == "worse":
            await store.record_gate(alias, version, {"monitor": {**summary, "finished": True}})
            await promote_version(self.state, alias, previous, replaced_status="rolled_back",
                                  reason=f"monitor: version {version} dropped below version {previous} "
                                         f"(p={test.worse.p_value:.4f}, {test.pairs} pairs)")
            return Outcome("ok", f"version {version} rolled back to {previous}", {"pairs": test.pairs})
        finished = decision in ("better", "max_pairs")  # shown no worse for long enough: stop watching
        await store.record_gate(alias, version, {"monitor": {**summary, "finished": finished}})
        return Outcome("waiting", f"monitor: {test.pairs} pairs, p(worse)={test.worse.p_value:.3f}",
                       {"pairs": test.pairs})
