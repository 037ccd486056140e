"""The validation queue: groups wait as `pending` until a validator claims them, verdicts settle
them (queued, uninformative or rejected), and fraud counts lead to bans."""

from __future__ import annotations

import json
import time

from swarmrl.orchestrator.store import Store


class ValidationQueue:
    """The Orchestrator's validation (a mixin: state and helpers live on the Orchestrator)."""

    def _settled(self, db, key: str, informative: bool, *, validated: bool) -> None:
        """A group passed every check it was given: it counts for its worker (as validated when
        the validator checked it) and the streak."""
        self.store.add_accepted(db, key, validated=validated)
        streak = 0 if informative else Store.get_meta(db, "uninformative_streak", 0) + 1
        Store.set_meta(db, "uninformative_streak", streak)

    def _name(self, db, key: str) -> str:
        name = self.store.worker_name(db, key)
        return f"{name if name is not None else '?'} ({key[:12]}…)"

    def _log_rejection(self, db, key: str, reason: str, detail: str) -> None:
        self.log(f"rejected: worker {self._name(db, key)}: {reason}: {detail}")

    def _maybe_ban(self, db, key: str, fraud: int) -> None:
        """Ban a worker once its fraud count reaches the limit: refuse its key from now on, give
        its open leases' problems to others, and send its not-yet-trained groups back to the
        validator for a full check (groups that got only the cheap checks included)."""
        if fraud < self.cfg.validator.ban_after:
            return
        if not self.store.ban(db, key):
            return
        self.store.end_worker_leases(db, key)
        self._expire(db, time.time())
        # Everything not yet trained or counted in a batch's metrics; each was counted as accepted,
        # and is again only if it passes.
        recheck = self.store.recheck_worker_groups(db, key)
        self.store.add_accepted(db, key, -recheck)
        self._count("workers_banned")
        self.log(f"banned: worker {self._name(db, key)} after {fraud} fraudulent groups; "
                 f"{recheck} of its queued groups go back to the validator")

    def _validation_metrics(self, db) -> dict[str, float]:
        m = {f"rejected/{reason}": float(n) for reason, n in self.store.rejection_counts(db).items()}
        m["workers/banned"] = float(self.store.worker_count(db, banned=True))
        m["validator/pending"] = float(self.store.count_groups(db, ("pending", "validating")))
        return m

    def claim_validation(self, max_groups: int) -> dict:
        """Up to `max_groups` pending groups for a validator, with the policies they claim."""
        cfg = self.cfg
        now = time.time()
        with self.store.tx() as db:
            next_step, _, _ = self._progress(db)
            lo = max(0, next_step - cfg.async_.bound)
            # Claims of a validator that died go back to the queue.
            self.store.release_claims(db, now - cfg.validator.claim_timeout_s)
            # Work too old to be trained now needs no check: it is dropped like any stale group.
            stale = self.store.drop_older(db, ("pending",), lo, next_step)
            if stale:
                self._count("off_policy_dropped", stale)
            rows = self.store.claim_pending(db, max_groups, now, cfg.orchestrator.proven_after)
            versions = sorted({r["policy_version"] for r in rows})
            policies = {}
            for v in versions:
                prow = self.store.policy(db, v)
                if prow is not None:
                    policies[str(v)] = {"url": prow["url"], "manifest": json.loads(prow["manifest"])}
        items = []
        for r in rows:
            g = json.loads(r["payload"])
            proofs = json.loads(r["proofs"] or "[]")
            items.append({"id": r["id"], "worker": r["worker"], "policy_version": r["policy_version"],
                          "temperature": g["temperature"], "prompt_ids": g["prompt_ids"],
                          "samples": [{"token_ids": smp["token_ids"], "logprobs": smp["logprobs"], "seed": smp["seed"],
                                       "proofs": proofs[i] if i < len(proofs) else []}
                                      for i, smp in enumerate(g["samples"])],
                          # Only a trusted key's group comes without proofs (submissions.py): its
                          # logprobs are all that can be checked.
                          "checks": "full" if any(proofs) else "logprobs",
                          "engine_dtype": g.get("engine_dtype")})
        self._count("validator/claimed", len(items))
        return {"items": items, "policies": policies, "min_version": lo, "config": cfg.validator.model_dump(),
                "dtype": cfg.sampling.dtype}

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
                if v["ok"]:
                    state = "queued" if row["informative"] else "uninformative"
                    self.store.set_verdict(db, v["id"], state, verdict)
                    self._settled(db, row["worker"], bool(row["informative"]), validated=True)
                    self._count("validator/passed")
                    continue
                reason = v.get("reason") or "validation"
                self.store.set_verdict(db, v["id"], "rejected", verdict)
                # The problem goes back to the pool, as for a slot refused at submission.
                self.store.reissue_slot(db, row["lease_id"], row["slot"])
                fraud = self.store.count_rejection(db, row["worker"], row["lease_id"], row["slot"], reason,
                                                   v.get("detail", ""), fraud=True)
                self._count(f"rejected/{reason}")
                self._log_rejection(db, row["worker"], reason, v.get("detail", ""))
                self._maybe_ban(db, row["worker"], fraud)
            for gid in retry:
                self.store.unclaim(db, gid)
        return {"recorded": recorded}
