"""The orchestrator's logic, independent of HTTP: the door checks and key lists (gate.py), leases
(leasing.py), submissions (submissions.py), the validation queue (validation.py), batches and
policies (batches.py), each a component that is handed what it uses; `Orchestrator` builds and
wires them and is the one object the app, the server and the in-process validator talk to.

`app.py` maps requests onto its methods; every refusal is an `ApiError` whose code and message
reach the client as JSON. The rules it enforces:

  * workers never choose problems: a lease names them, with the group size, sampling settings,
    a target length per prompt and a sampling seed per completion, the policy versions allowed,
    and an expiry after which the problems go to someone else;
  * a submission is checked (lease owner, expiry, slot, sizes, token ids, policy version within
    the lease and within the async bound) and then scored here: rewards come only from the
    orchestrator's own verifiers, whatever the worker claims;
  * then it waits for the validator (`validator.rate` of the groups; all of them by default):
    `pending` until a validator claimed it, `validating` while one checks it, and then `queued`
    (or `uninformative`) if it passed, `rejected` if not. Only queued groups reach the trainer;
  * keys in `orchestrator.trusted_keys_file` may submit groups without proofs (an
    OpenAI-compatible server's, docs/engines.md); the validator checks the logprobs of
    `validator.trusted_rate` of those. Every other key's groups must carry proofs;
  * rejections an honest worker cannot get (FRAUD_REASONS) count against the worker; after
    `validator.ban_after` of them its key is refused, its open leases are expired and its
    queued groups go back to the validator for a full check;
  * batch n takes queued groups first in, first out, drops (and counts) those from a policy
    older than n - k, and is frozen in SQLite the moment it is complete.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from swarmrl.config import Config
from swarmrl.orchestrator.admission import GradingLanes, GradingMeter
from swarmrl.orchestrator.batches import Batches
from swarmrl.orchestrator.counters import Counters
from swarmrl.orchestrator.errors import ApiError
from swarmrl.orchestrator.gate import Gate
from swarmrl.orchestrator.leasing import Leasing
from swarmrl.orchestrator.store import Store
from swarmrl.orchestrator.submissions import Submissions
from swarmrl.orchestrator.uploads import Uploads, parse_group
from swarmrl.orchestrator.validation import ValidationQueue
from swarmrl.protocol import PROTOCOL_VERSION
from swarmrl.rewards.pool import DEFAULT_PRELOAD, VerifierPool
from swarmrl.rewards.registry import open_graders, preload_for
from swarmrl.tasks.source import task_rows
from swarmrl.transport.connlimit import SourceSlots


class Orchestrator:
    """The composition root: opens the store, the run's rows, graders and grading lanes, builds
    the components with what each uses, and answers for them (the methods below delegate).

    Who owns what (each component's docstring says more):
      * `store` (store.py): every durable state, behind one re-entrant lock; one transaction
        per operation, and the components' `db`-taking methods join their caller's;
      * `counters`: the /metrics totals, behind their own lock;
      * `gate`: the rate limiters (a lock each) and the allowed/trusted key files' contents;
      * `leasing`: the epoch's task order (under the store's lock) and the remembered refusals;
      * `submissions`: the resource graders' lock and the full-check draw; uses `lanes`
        (their own lock) and `graders`, which this object opens and closes;
      * `validation`, `batches`: nothing in memory.
    Calls go one way: submissions -> validation -> leasing -> gate, batches -> validation
    and leasing."""

    def __init__(
        self,
        cfg: Config,
        run_dir: str | Path,
        *,
        tokenizer,
        vocab_size: int,
        hidden_size: int,
        trainer_token: str,
        validator_token: str | None = None,
        pool: VerifierPool | None = None,
        log=print,
        limits: dict | None = None,
    ):
        self.cfg, self.rd = cfg, Path(run_dir)
        self.trainer_token, self.validator_token = trainer_token, validator_token
        self.log = log
        # The server's per-source connection slots (transport/connlimit.py), set by server.py
        # when it serves this orchestrator: its figures go to /metrics.
        self.connections: SourceSlots | None = None
        self.store = Store(self.rd / "orchestrator.sqlite")
        self.rows, _ = task_rows(cfg, log=lambda *_: None)
        # Code tasks need the sandbox: refuse to start (with the fix) rather than score them 0.
        self.graders = open_graders(self.rows, cfg.sandbox, log=log)
        o = cfg.orchestrator
        # Grading lanes: each a verifier pool serving one submission at a time (admission.py),
        # its processes forked from a server that imported the grader and the command line every
        # child runs again as its parent's main (`swarmrl orchestrator` too, not only `python -m
        # swarmrl.cli`), so one replaced after an answer ran out of its budget is back in ~0.05 s
        # (docs/security.md, "Grading").
        pools = [pool] if pool is not None else []
        pools += [
            VerifierPool(
                cfg.rewards.verify_workers,
                cfg.rewards.verify_timeout_s,
                memory_bytes=cfg.rewards.verify_memory_mb << 20,
                start_method="forkserver",
                preload=(*DEFAULT_PRELOAD, "swarmrl.cli", *preload_for(self.rows)),
            )
            for _ in range(o.grading_lanes - len(pools))
        ]
        meter = GradingMeter(o.unproven_grading_s, o.unproven_grading_window_s)
        self.lanes = GradingLanes(pools, o.grading_wait_s, meter)
        self.run_id = self.store.run_id()
        self.counters = Counters()
        self.gate = Gate(self.store, cfg, self.counters, log)
        if o.trusted_keys_file is not None:
            log(
                f"trusted keys: {len(self.gate.trusted_keys())} from {o.trusted_keys_file} may submit groups "
                "without proofs"
            )
        self.leasing = Leasing(self.store, cfg, self.rows, tokenizer, self.counters, self.gate)
        self.validation = ValidationQueue(self.store, cfg, self.counters, self.leasing, log, limits)
        # Scores summed under another file's tests (a run resumed with a new file) start again.
        if self.validation.restart_evidence():
            log(
                "validator limits: the evidence tests differ from those this run's scores were summed under: "
                "they start again at 0"
            )
        self.submissions = Submissions(
            self.store,
            cfg,
            self.rows,
            tokenizer,
            self.counters,
            self.gate,
            self.validation,
            self.lanes,
            self.graders,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
        )
        self.batches = Batches(self.store, cfg, self.counters, self.validation, self.leasing, log)
        self.uploads = Uploads(run_dir, o.max_group_bytes, o.max_upload_bytes_per_source)
        # validator.limits_file read again when it changes (limits_reload.py; set by server.py).
        self.limits_reload = None

    def close(self) -> None:
        self.lanes.close()
        self.graders.close()
        self.store.close()

    # ---- the run -----------------------------------------------------------------------------
    def status(self) -> dict:
        with self.store.read() as db:
            next_step, latest, finished = Store.progress(db)
            policy = None
            if latest is not None:
                row = self.store.policy(db, latest)
                policy = {"version": latest, "url": row["url"], "manifest": json.loads(row["manifest"])}
        k = self.cfg.async_.bound
        conns = self.connections
        return {
            **(
                {"connections_open": float(conns.count)}
                | {f"connections_refused_{why}": float(n) for why, n in conns.refused.items()}
                if conns is not None
                else {}
            ),
            "next_step": next_step,
            "latest_version": latest,
            "async_bound": k,
            "min_version": max(0, next_step - k),
            "finished": finished,
            "policy": policy,
            "total_steps": self.cfg.trainer.steps,
            "protocol_version": PROTOCOL_VERSION,
            "run_id": self.run_id,
            "plugins": list(self.cfg.plugins),
        }

    def trainer_public_key(self) -> str | None:
        """The trainer's broadcast signing key, once the trainer has written it to the run directory."""
        try:
            return (self.rd / "trainer.pub").read_text().strip() or None
        except OSError:
            return None

    def totals(self) -> dict[str, float]:
        return self.counters.totals()

    def gauges(self) -> dict[str, float]:
        with self.store.read() as db:
            next_step, latest, _ = Store.progress(db)
            counts = self.store.group_state_counts(db)
            open_leases = self.store.open_lease_count(db)
            workers = self.store.worker_count(db)
            banned = self.store.worker_count(db, banned=True)
        conns = self.connections
        return {
            **(
                {"connections_open": float(conns.count)}
                | {f"connections_refused_{why}": float(n) for why, n in conns.refused.items()}
                if conns is not None
                else {}
            ),
            "next_step": next_step,
            "latest_version": -1 if latest is None else latest,
            "open_leases": open_leases,
            "workers": workers,
            "workers_banned": banned,
            **{
                f"groups_{s}": float(counts.get(s, 0))
                for s in ("queued", "consumed", "stale", "uninformative", "pending", "validating", "rejected")
            },
        }

    # ---- workers (gate.py, leasing.py, submissions.py) ---------------------------------------
    def admit_source(self, source: str) -> None:
        self.gate.admit_source(source)

    def admit_registration(self, key: str, source: str = "local") -> None:
        self.gate.admit_registration(key, source)

    def authenticate(
        self, key: str, nonce: str, ts: float, *, registering: bool = False, allow_banned: bool = False
    ) -> dict:
        return self.gate.authenticate(key, nonce, ts, registering=registering, allow_banned=allow_banned)

    def register(self, key: str, name: str) -> dict:
        return self.gate.register(key, name)

    def is_trusted(self, key: str) -> bool:
        return self.gate.is_trusted(key)

    def worker_record(self, key: str) -> dict:
        return self.gate.worker_record(key)

    def check_lease_refusal(self, key: str) -> None:
        self.leasing.check_refusal(key)

    def lease(self, key: str, policy_version: int, source: str = "local", protocol_version: int = 2) -> dict:
        return self.leasing.lease(key, policy_version, source, protocol_version)

    def submit(self, key: str, lease_id: str, groups: list) -> dict:
        return self.submissions.submit(key, lease_id, groups)

    def upload(self, key: str, source: str, body) -> dict:
        """A piece of one group (uploads.py): checked against the key's open lease and slot before
        a byte is written; the whole group, once it has arrived, submitted as `submit` does."""
        now = time.time()
        self.uploads.sweep(now)
        with self.store.read() as db:
            lease = self.store.lease_row(db, body.lease_id)
            slot = self.store.lease_slots(db, body.lease_id).get(body.slot) if lease is not None else None
        if lease is None or lease["worker"] != key:
            raise ApiError(404, "unknown_lease", f"no lease {body.lease_id} of this key")
        if lease["state"] != "open" or lease["expires"] < now:
            raise ApiError(410, "lease_expired", f"lease {body.lease_id} has ended: lease again")
        if slot is None or slot["state"] != "open":
            raise ApiError(409, "slot_not_open", f"slot {body.slot} of lease {body.lease_id} is not open for a group")
        received, whole = self.uploads.append(
            key=key, source=source, lease_id=body.lease_id, slot=body.slot, expires=lease["expires"], body=body
        )
        if whole is None:
            return {"received": received, "total": body.total}
        self.counters.count("uploads_completed")
        group = parse_group(whole, body.slot)
        return {"received": received, "total": body.total, "result": self.submit(key, body.lease_id, [group])}

    # ---- validator (validation.py) -----------------------------------------------------------
    def claim_validation(self, max_groups: int) -> dict:
        return self.validation.claim_validation(max_groups)

    def record_verdicts(self, verdicts: list[dict], retry: list[int] = ()) -> dict:
        return self.validation.record_verdicts(verdicts, retry)

    # ---- trainer (batches.py) ----------------------------------------------------------------
    def build_batch(self, step: int) -> dict:
        return self.batches.build_batch(step)

    def publish(self, version: int, url: str, manifest: dict) -> dict:
        return self.batches.publish(version, url, manifest)

    def reopen(self) -> None:
        self.batches.reopen()

    def finish(self) -> dict:
        return self.batches.finish()
