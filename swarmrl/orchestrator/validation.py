"""The validation queue: groups wait as `pending` until a validator claims them, verdicts settle
them (queued, uninformative or rejected), and fraud counts lead to bans."""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable

from swarmrl.config import Config
from swarmrl.orchestrator import curriculum
from swarmrl.orchestrator.counters import Counters
from swarmrl.orchestrator.leasing import Leasing
from swarmrl.orchestrator.store import Store
from swarmrl.proofs.evidence import DriftReference, EvidenceModel, group_llr
from swarmrl.proofs.limits import evidence_identity
from swarmrl.protocol.messages import ClaimedGroup
from swarmrl.protocol.rollouts import Group

# The drift watch (`ValidationQueue.drift_report`): passed groups per engine it looks back over,
# how many it needs before it judges, how often it judges, and how unlikely the excess over the
# calibration's 90th percentile must be under honest work as calibrated to raise the alarm.
DRIFT_WINDOW = 200
DRIFT_MIN_GROUPS = 100
DRIFT_EVERY = 20
DRIFT_P = 1e-6


class ValidationQueue:
    """The validation queue and what its verdicts do to a worker (accepted counts, the
    uninformative streak, fraud, bans).

    Owns no state in memory but the drift watch (a warning, rebuilt after a restart): the groups'
    states, claims, verdicts, workers' counts and bans are in the store, and every change is one
    store transaction (its lock). The methods taking `db` run inside their caller's transaction
    (submissions settle and reject through them, batches read `metrics`). Calls leasing
    (`expire`) when it bans a key."""

    def __init__(
        self,
        store: Store,
        cfg: Config,
        counters: Counters,
        leasing: Leasing,
        log: Callable[[str], None],
        limits: dict | None = None,
    ):
        self.store, self.cfg, self.counters, self.leasing, self.log = store, cfg, counters, leasing, log
        self._set_limits(limits)

    def _set_limits(self, limits: dict | None) -> None:
        """Everything this queue derives from a limits file, built first and assigned together:
        a file that fails halfway (a malformed statistic) changes nothing."""
        # The run's limits file (proofs/limits.py, loaded and checked by the service):
        # the hard limits validators apply per engine, and the evidence models applied here.
        engines = (limits or {}).get("engines", {})
        accepted = {name: e for name, e in engines.items() if not e.get("refused")}
        evidence = {name: [EvidenceModel.from_dict(d) for d in e.get("evidence") or []] for name, e in accepted.items()}
        # Whether the run's work still looks like the honest work the calibration measured, per
        # engine, on the group statistic and each evidence test's: in memory (a warning, not a
        # verdict: nothing is refused or banned by it, and a restart starts it afresh).
        measured = ((limits or {}).get("measured") or {}).get("honest") or {}
        drift_refs: dict[str, list[DriftReference]] = {}
        for name in accepted:
            honest = measured.get(name) or []
            stats = dict.fromkeys(["mant_err_group", *(m.statistic for m in evidence.get(name, []))])
            if len(honest) >= 20:
                drift_refs[name] = [DriftReference.of(st, [float(g.get(st, 0.0)) for g in honest]) for st in stats]
        self.limits, self.accepted, self.evidence, self.drift_refs = limits, accepted, evidence, drift_refs
        self._recent: dict[str, deque] = {name: deque(maxlen=DRIFT_WINDOW) for name in drift_refs}
        self._seen = dict.fromkeys(drift_refs, 0)
        self._drift: dict[str, dict] = {}

    def replace_limits(self, limits: dict) -> int | None:
        """Judge by another limits file from now on (measured again near the current version, as
        the drift watch asks; orchestrator/limits_reload.py). Validators get its hard limits with
        their next claim; the drift watch starts afresh against its honest work. Returns what
        `restart_evidence` does."""
        with self.store.lock:  # no verdict is weighed half by one file, half by the other
            self._set_limits(limits)
            return self.restart_evidence()

    def restart_evidence(self) -> int | None:
        """Per engine, when its evidence tests differ from those the store's scores were summed
        under (a new file, at a reload or a restart), each key's CUSUM for that engine starts
        again at 0 (its groups and peak stay, for the record). A file is measured again because
        the old one stopped describing honest work (the drift watch): scores summed under it are
        not evidence that a key cheats, and an honest key whose score drift had raised must not
        carry it into bounds fitted elsewhere. What a cheating key gains is the groups a new ban
        takes (tens); to make an operator measure again it would have to send enough work the
        drift watch counts, every group of which adds to its own evidence. Returns the number of
        keys whose score restarted, None when no engine's tests changed (scores carry on), and
        None for a store whose scores were summed before the tests were recorded (a run started
        by an earlier version and resumed: its file is the one it ran with)."""
        if self.limits is None:
            return None
        now = evidence_identity(self.limits)
        with self.store.tx() as db:
            was = Store.get_meta(db, "evidence_models")
            Store.set_meta(db, "evidence_models", now)
            if not isinstance(was, dict):
                return None
            changed = sorted(e for e in set(now) | set(was) if now.get(e) != was.get(e))
            if not changed:
                return None
            return self.store.restart_evidence(db, changed)

    def engine_refusal(self, engine: str) -> str | None:
        """Why this run refuses proofs from `engine` (None: it accepts them). Only runs with a limits
        file refuse any: they accept the engines their calibration measured and did not refuse."""
        if self.limits is None or engine in self.accepted:
            return None
        entry = self.limits["engines"].get(engine)
        if entry is not None:
            return entry["refused"]
        names = ", ".join(sorted(self.accepted)) or "none"
        return (
            f"this run's calibration (validator.limits_file) did not measure the {engine!r} engine; it accepts "
            f"{names}: run the worker with one of those"
        )

    def settled(self, db, key: str, informative: bool, *, validated: bool) -> None:
        """A group passed every check it was given: it counts for its worker (as validated when
        the validator checked it), the all-equal streak (the no-signal stop, batches.py) and the
        run's totals of groups and all-equal groups (what the trainer says while it waits)."""
        self.store.add_accepted(db, key, validated=validated)
        streak = 0 if informative else Store.get_meta(db, "uninformative_streak", 0) + 1
        Store.set_meta(db, "uninformative_streak", streak)
        Store.set_meta(db, "groups_settled", Store.get_meta(db, "groups_settled", 0) + 1)
        if not informative:
            Store.set_meta(db, "groups_all_equal", Store.get_meta(db, "groups_all_equal", 0) + 1)

    def _name(self, db, key: str) -> str:
        name = self.store.worker_name(db, key)
        return f"{name if name is not None else '?'} ({key[:12]}…)"

    def record_fraud(self, db, key: str, reason: str, detail: str, total: int) -> None:
        """A fraudulent group of `key` was rejected, its `total`-th: log it, and ban the key once
        that reaches the limit."""
        self.log(f"rejected: worker {self._name(db, key)}: {reason}: {detail}")
        if self._maybe_ban(db, key, total):
            return
        # Its clean streak is over (store.count_rejection): what it sent under sampled validation and
        # nobody trained on yet gets the full check after all (validator.sample_after).
        recheck = self.store.recheck_worker_groups(db, key, unchecked_only=True)
        if recheck:
            self.store.add_accepted(db, key, -recheck)
            self.counters.count("validator/rechecked_after_fraud", recheck)
            self.log(f"worker {self._name(db, key)}: {recheck} of its unchecked groups go back to the validator")

    def _maybe_ban(self, db, key: str, fraud: int) -> bool:
        """Ban a worker once its fraud count reaches the limit: refuse its key from now on, give
        its open leases' problems to others, and send its not-yet-trained groups back to the
        validator for a full check (groups that got only the cheap checks included)."""
        if fraud < self.cfg.validator.ban_after:
            return False
        if not self.store.ban(db, key):
            return True  # banned already
        self.store.end_worker_leases(db, key)
        self.leasing.expire(db, time.time())
        # Everything not yet trained or counted in a batch's metrics; each was counted as accepted,
        # and is again only if it passes.
        recheck = self.store.recheck_worker_groups(db, key)
        self.store.add_accepted(db, key, -recheck)
        self.counters.count("workers_banned")
        self.log(
            f"banned: worker {self._name(db, key)} after {fraud} fraudulent groups; "
            f"{recheck} of its queued groups go back to the validator"
        )
        return True

    def suspect(self, db, key: str, share: float = 0.25) -> bool:
        """Whether any of the key's evidence tests stands at `share` of its ban bound or more."""
        for engine, test, score in self.store.evidence_scores(db, key):
            bound = self.bound(engine, test)
            if bound and score >= share * bound:
                return True
        return False

    def bound(self, engine: str, test: str) -> float | None:
        """The ban bound of an engine's evidence test `test` (None: no such test in this run)."""
        for m in self.evidence.get(engine) or []:
            if m.name == test:
                return m.bound
        return None

    def _weigh(self, db, row, stats: dict, verdict: str) -> bool:
        """Add a passed group's evidence to its key's sequential test; when the score reaches the
        bound, ban the key and refuse every group of it not yet trained on (this one included).
        True when it banned."""
        models = self.evidence.get(row["engine"]) or []
        if not models or self.store.is_banned(db, row["worker"]):
            return False
        crossed = None
        for model in models:  # one CUSUM per test, each updated by every group
            value = float(stats.get(model.statistic, 0.0))
            score = self.store.add_evidence(
                db, row["worker"], row["engine"], model.name, group_llr(value, model), value
            )
            if score >= model.bound and crossed is None:
                crossed = (model, score)
        if crossed is None:
            return False
        model, score = crossed
        self.store.ban(db, row["worker"])
        self.store.end_worker_leases(db, row["worker"])
        self.leasing.expire(db, time.time())
        # Its groups that counted as accepted stop counting; then none of its untrained ones stays.
        self.store.add_accepted(db, row["worker"], -self.store.recheck_worker_groups(db, row["worker"]))
        refused = self.store.reject_worker_groups(db, row["worker"], verdict)
        rate, horizon = self.limits["false_ban_rate"], self.limits["horizon"]
        detail = (
            f"the sequential test over its {row['engine']} groups reached {score:.1f} (bound {model.bound:.1f}: an "
            f"honest key reaches it with probability at most {rate:g} in {horizon} groups) on {model.name}"
        )
        self.store.count_rejection(db, row["worker"], row["lease_id"], row["slot"], "evidence", detail, fraud=True)
        self.counters.count("rejected/evidence")
        self.counters.count("workers_banned")
        self.log(f"banned: worker {self._name(db, row['worker'])}: {detail}; {refused} of its untrained groups refused")
        return True

    def _watch(self, engine: str, worker: str, stats: dict) -> None:
        """One more passed group for the drift watch of its engine; judged every DRIFT_EVERY."""
        recent = self._recent.get(engine)
        if recent is None:
            return
        recent.append((worker, stats))
        self._seen[engine] += 1
        if len(recent) < DRIFT_MIN_GROUPS or self._seen[engine] % DRIFT_EVERY:
            return
        worst: dict | None = None
        for ref in self.drift_refs[engine]:
            values = [float(s.get(ref.statistic, 0.0)) for _, s in recent]
            above, p = ref.surprise(values)
            if worst is None or p < worst["p"]:
                keys = {w for w, s in recent if float(s.get(ref.statistic, 0.0)) > ref.level}
                worst = {
                    "statistic": ref.statistic,
                    "level": ref.level,
                    "window": len(values),
                    "above": above,
                    "expected_at_most": round(ref.share * len(values), 1),
                    "p": p,
                    "keys": len(keys),
                }
        was = self._drift.get(engine, {}).get("alarm", False)
        assert worst is not None  # every watched engine has at least the group statistic
        worst["alarm"] = worst["p"] < DRIFT_P
        self._drift[engine] = worst
        if worst["alarm"] and not was:
            self.log(
                f"validation drift: engine {engine}: {worst['above']} of the last {worst['window']} passed groups "
                f"(from {worst['keys']} keys) have {worst['statistic']} above the calibration's honest 90th "
                f"percentile {worst['level']:.3g}, where honest work as calibrated puts at most "
                f"{worst['expected_at_most']:g} (probability {worst['p']:.1e}): the limits file no longer describes "
                "this run's work, and honest keys' evidence rises with it. Measure the limits again near the "
                "current version before trusting bans: swarmrl calibrate --model RUN_DIR/policies/vNNNNNN with "
                "the run's settings, --out the run's validator.limits_file (the run takes it when it is "
                "written). A cheating key's groups count here too until it is banned"
            )
        elif was and not worst["alarm"]:
            self.log(f"validation drift: engine {engine}: its passed groups are within the calibration again")

    def limits_summary(self) -> dict | None:
        """What the run judges by now, for the dashboard and `swarmrl status` (None: no limits file)."""
        if self.limits is None:
            return None
        model = self.limits.get("model") or {}
        return {
            "measured_on": model.get("version", 0),  # the policy version; 0: the run's starting model
            "dtype": self.limits.get("dtype"),
            "cpu": (self.limits.get("cpu") or {}).get("kind"),
            "engines": sorted(self.accepted),
            "created": self.limits.get("created"),
        }

    def drift_report(self) -> dict[str, dict]:
        """Per engine the drift watch's last judgement (the statistic furthest from the
        calibration), for the dashboard; empty without a limits file that measured honest work."""
        return {name: dict(d) for name, d in self._drift.items()}

    def metrics(self, db) -> dict[str, float]:
        """Rejections by reason, banned workers and groups awaiting the validator, for a batch's metrics."""
        m = {f"rejected/{reason}": float(n) for reason, n in self.store.rejection_counts(db).items()}
        m["workers/banned"] = float(self.store.worker_count(db, banned=True))
        m["validator/pending"] = float(self.store.count_groups(db, ("pending", "validating")))
        if self.cfg.tasks.retire_after:
            m["tasks/retired"] = float(curriculum.retired_count(db))  # problems leases now skip
        return m

    def claim_validation(self, max_groups: int) -> dict:
        """Up to `max_groups` pending groups for a validator, with the policies they claim."""
        cfg = self.cfg
        now = time.time()
        with self.store.tx() as db:
            next_step, _, finished = Store.progress(db)
            lo = max(0, next_step - cfg.async_.bound)
            # Claims of a validator that died go back to the queue.
            self.store.release_claims(db, now - cfg.validator.claim_timeout_s)
            # Work too old to be trained now needs no check: it is dropped like any stale group.
            stale = self.store.drop_older(db, ("pending",), lo, next_step)
            if stale:
                self.counters.count("off_policy_dropped", stale)
            # Once the trainer has taken its last step, what still waits will never be trained:
            # checking it would only keep validators fetching versions whose origin (the trainer)
            # is gone, and an external validator waiting for them would never see the run end.
            # The groups stay pending (not dropped), so a resumed run checks them as before.
            rows = [] if finished else self.store.claim_pending(db, max_groups, now, cfg.orchestrator.proven_after)
            versions = sorted({r["policy_version"] for r in rows})
            policies = {}
            for v in versions:
                prow = self.store.policy(db, v)
                if prow is not None:
                    policies[str(v)] = {"url": prow["url"], "manifest": json.loads(prow["manifest"])}
            # The file judged by now, read under the lock a reload takes (limits_reload.py).
            limits, accepted = self.limits, self.accepted
        items = [
            ClaimedGroup.of(r["id"], Group.from_json(r["payload"]), json.loads(r["proofs"] or "[]")).model_dump()
            for r in rows
        ]
        self.counters.count("validator/claimed", len(items))
        return {
            "items": items,
            "policies": policies,
            "min_version": lo,
            "config": cfg.validator.model_dump(),
            "dtype": cfg.sampling.dtype,
            "calibrated": {name: e["limits"] for name, e in accepted.items()} if limits else None,
            "calibrated_cpu": (limits.get("cpu") or {}).get("kind") if limits else None,
        }

    def record_verdicts(self, verdicts: list[dict], retry: list[int] = ()) -> dict:
        """Apply a validator's verdicts: passed groups join the queue, failed ones are rejected
        (fraud) against their worker; `retry` ids go back to pending (their policy could not be
        loaded just now)."""
        recorded = 0
        with self.store.tx() as db:
            for v in verdicts:
                row = self.store.group_for_verdict(db, v["id"])
                if row is None or row["state"] not in ("validating", "pending"):
                    continue  # a verdict for a group already settled (e.g. a second validator's)
                recorded += 1
                verdict = json.dumps({"ok": v["ok"], "reason": v.get("reason"), "stats": v.get("stats", {})})
                if v["ok"] and self._weigh(db, row, v.get("stats") or {}, verdict):
                    continue  # its key was banned by the evidence: the group was refused with its others
                if v["ok"]:
                    self._watch(row["engine"], row["worker"], v.get("stats") or {})
                    state = "queued" if row["informative"] else "uninformative"
                    self.store.set_verdict(db, v["id"], state, verdict)
                    self.settled(db, row["worker"], bool(row["informative"]), validated=True)
                    self.counters.count("validator/passed")
                    continue
                reason = v.get("reason") or "validation"
                self.store.set_verdict(db, v["id"], "rejected", verdict)
                # The problem goes back to the pool, as for a slot refused at submission.
                self.store.reissue_slot(db, row["lease_id"], row["slot"])
                fraud = self.store.count_rejection(
                    db, row["worker"], row["lease_id"], row["slot"], reason, v.get("detail", ""), fraud=True
                )
                self.counters.count(f"rejected/{reason}")
                self.record_fraud(db, row["worker"], reason, v.get("detail", ""), fraud)
            for gid in retry:
                self.store.unclaim(db, gid)
        return {"recorded": recorded}
