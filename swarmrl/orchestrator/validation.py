"""The validation queue: groups wait as `pending` until a validator claims them, verdicts settle
them (queued, uninformative or rejected), and fraud counts lead to bans."""

from __future__ import annotations

import json
import time

from swarmrl.orchestrator.store import Store


class ValidationQueue:
    """The Orchestrator's validation (a mixin: state and helpers live on the Orchestrator)."""

    def _settled(self, db, key: str, informative: bool) -> None:
        """A group passed every check it was given: it counts for its worker and the streak."""
        db.execute("UPDATE workers SET accepted = accepted + 1 WHERE key = ?", (key,))
        streak = 0 if informative else Store.get_meta(db, "uninformative_streak", 0) + 1
        Store.set_meta(db, "uninformative_streak", streak)

    def _name(self, db, key: str) -> str:
        row = db.execute("SELECT name FROM workers WHERE key = ?", (key,)).fetchone()
        return f"{row[0] if row else '?'} ({key[:12]}…)"

    def _log_rejection(self, db, key: str, reason: str, detail: str) -> None:
        self.log(f"rejected: worker {self._name(db, key)}: {reason}: {detail}")

    def _maybe_ban(self, db, key: str, fraud: int) -> None:
        """Ban a worker once its fraud count reaches the limit: refuse its key from now on, give
        its open leases' problems to others, and send its not-yet-trained groups back to the
        validator for a full check (groups that got only the cheap checks included)."""
        if fraud < self.cfg.validator.ban_after:
            return
        if not db.execute("UPDATE workers SET banned = 1 WHERE key = ? AND banned = 0", (key,)).rowcount:
            return
        db.execute("UPDATE leases SET expires = 0 WHERE worker = ? AND state = 'open'", (key,))
        self._expire(db, time.time())
        # Everything not yet trained or counted in a batch's metrics; each was counted as accepted,
        # and is again only if it passes.
        recheck = db.execute("UPDATE groups SET state = 'pending', claimed = NULL WHERE worker = ? AND "
                             "(state = 'queued' OR (state = 'uninformative' AND resolved_step IS NULL))",
                             (key,)).rowcount
        db.execute("UPDATE workers SET accepted = accepted - ? WHERE key = ?", (recheck, key))
        self._count("workers_banned")
        self.log(f"banned: worker {self._name(db, key)} after {fraud} fraudulent groups; "
                 f"{recheck} of its queued groups go back to the validator")

    @staticmethod
    def _validation_metrics(db) -> dict[str, float]:
        m = {f"rejected/{reason}": float(n) for reason, n in
             db.execute("SELECT reason, COUNT(*) FROM rejections GROUP BY reason").fetchall()}
        m["workers/banned"] = float(db.execute("SELECT COUNT(*) FROM workers WHERE banned = 1").fetchone()[0])
        m["validator/pending"] = float(db.execute("SELECT COUNT(*) FROM groups WHERE state IN ('pending', 'validating')")
                                       .fetchone()[0])
        return m

    def claim_validation(self, max_groups: int) -> dict:
        """Up to `max_groups` pending groups for a validator, with the policies they claim."""
        cfg = self.cfg
        now = time.time()
        with self.store.tx() as db:
            next_step, _, _ = self._progress(db)
            lo = max(0, next_step - cfg.async_.bound)
            # Claims of a validator that died go back to the queue.
            db.execute("UPDATE groups SET state = 'pending', claimed = NULL WHERE state = 'validating' AND claimed < ?",
                       (now - cfg.validator.claim_timeout_s,))
            # Work too old to be trained now needs no check: it is dropped like any stale group.
            stale = db.execute("UPDATE groups SET state = 'stale', resolved_step = ? WHERE state = 'pending' "
                               "AND policy_version < ?", (next_step, lo)).rowcount
            if stale:
                self._count("off_policy_dropped", stale)
            rows = db.execute("SELECT id, worker, policy_version, payload, proofs FROM groups WHERE state = 'pending' "
                              "ORDER BY id LIMIT ?", (max_groups,)).fetchall()
            if rows:
                marks = ",".join("?" * len(rows))
                db.execute(f"UPDATE groups SET state = 'validating', claimed = ? WHERE id IN ({marks})",
                           (now, *[r["id"] for r in rows]))
            versions = sorted({r["policy_version"] for r in rows})
            policies = {}
            for v in versions:
                prow = db.execute("SELECT url, manifest FROM policies WHERE version = ?", (v,)).fetchone()
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
                                      for i, smp in enumerate(g["samples"])]})
        self._count("validator/claimed", len(items))
        return {"items": items, "policies": policies, "min_version": lo, "config": cfg.validator.model_dump()}

    def record_verdicts(self, verdicts: list[dict], retry: list[int] = ()) -> dict:
        """Apply a validator's verdicts: passed groups join the queue, failed ones are rejected
        (fraud) against their worker; `retry` ids go back to pending (their policy could not be
        loaded just now)."""
        recorded = 0
        with self.store.tx() as db:
            for v in verdicts:
                row = db.execute("SELECT worker, lease_id, slot, informative, state FROM groups WHERE id = ?",
                                 (v["id"],)).fetchone()
                if row is None or row["state"] not in ("validating", "pending"):
                    continue  # a verdict for a group already settled (e.g. a second validator's)
                recorded += 1
                verdict = json.dumps({"ok": v["ok"], "reason": v.get("reason"), "stats": v.get("stats", {})})
                if v["ok"]:
                    state = "queued" if row["informative"] else "uninformative"
                    db.execute("UPDATE groups SET state = ?, verdict = ? WHERE id = ?", (state, verdict, v["id"]))
                    self._settled(db, row["worker"], bool(row["informative"]))
                    self._count("validator/passed")
                    continue
                reason = v.get("reason") or "validation"
                db.execute("UPDATE groups SET state = 'rejected', verdict = ? WHERE id = ?", (verdict, v["id"]))
                # The problem goes back to the pool, as for a slot refused at submission.
                db.execute("INSERT INTO reissue (problem, target_length) SELECT problem, target_length "
                           "FROM slots WHERE lease_id = ? AND slot = ?", (row["lease_id"], row["slot"]))
                fraud = self.store.count_rejection(db, row["worker"], row["lease_id"], row["slot"], reason,
                                                   v.get("detail", ""), fraud=True)
                self._count(f"rejected/{reason}")
                self._log_rejection(db, row["worker"], reason, v.get("detail", ""))
                self._maybe_ban(db, row["worker"], fraud)
            for gid in retry:
                db.execute("UPDATE groups SET state = 'pending', claimed = NULL WHERE id = ? AND state = 'validating'",
                           (gid,))
        return {"recorded": recorded}
