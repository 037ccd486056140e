"""An untrusted inference worker (`swarmrl worker --orchestrator URL`).

    register (ed25519 key = identity) -> status -> newest allowed policy (signed by the trainer,
    sharded, fetched from relays over HTTP and checked shard by shard)
    -> lease (the orchestrator picks problems, seeds, settings) -> generate, building a TOPLOC
    proof per chunk of tokens from the last hidden states -> signed submit

The worker decides nothing that matters for training: problems, group size, temperature, token
limit, target lengths and the seed of every completion come from the lease, and the rewards
are recomputed by the orchestrator. What it owns is getting finished work delivered: a
submission is written to `<cache-dir>/outbox/` before it is sent and removed only once the
orchestrator accepted or refused it, or its lease expired, so an orchestrator restart or a
network blip loses nothing (a restarted worker sends what its outbox holds first).

Precision is the run's too: every lease names the dtype the run samples in, because the
validator prefills in it and honest work in another precision would be rejected as fraud. A
worker started without `--dtype` follows the leases (it learns the run's dtype from its first
lease and reloads the policy once if it guessed wrong); one started with `--dtype` stops with a
message on a lease that asks for another.

With `vllm` (`--engine vllm`), vLLM's offline engine runs in this process and proves its work as
the built-in engine does (inference/vllm_engine.py): each version is loaded into it in place, and
its groups declare the engine "vllm" and carry proofs, so any key may submit them.

With `endpoint` (`--engine openai`), the worker generates through an OpenAI-compatible server
instead (inference/remote.py): it still downloads and checks every version, then loads it into
the server; its groups carry no proofs and declare the engine and the server's precision, which
only a key the orchestrator trusts may submit (docs/engines.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
from pydantic import BaseModel, ValidationError

from swarmrl import plugins
from swarmrl.errors import SwarmrlError, WrongPrecision
from swarmrl.inference import backends
from swarmrl.inference.engine import RolloutEngine
from swarmrl.inference.remote import EndpointError
from swarmrl.proofs.toploc import build_proofs_many, encode
from swarmrl.protocol.client import Refused, Unavailable, WorkerClient, retrying
from swarmrl.protocol.manifest import manifest_digest
from swarmrl.protocol.messages import GroupIn, Lease, LeaseReply, SampleIn, SubmitIn, request_body, submission_parts
from swarmrl.protocol.rules import termination_problem
from swarmrl.protocol.signing import load_or_create_key
from swarmrl.protocol.tls import TLSError
from swarmrl.transport.broadcast import BroadcastError, SourceScores, fetch_policy
from swarmrl.transport.filesystem import atomic_write_text

PART_BYTES = 4 << 20
"""A submission is sent in parts of at most this many bytes (half the orchestrator's default
request limit), a group larger than that in pieces of it (POST /v1/rollouts/upload); after a 413,
one group a part, then pieces halved down to MIN_PIECE_BYTES."""
MIN_PIECE_BYTES = 256


def _log(msg: str) -> None:
    print(msg, flush=True)


class RefusedEngine(SwarmrlError):
    """The run's limits file does not accept the engine this worker runs (`engine_refused`)."""


class UnknownEnvironment(SwarmrlError):
    """The run's episodes need an environment this worker's installation does not register."""


class Worker:
    def __init__(
        self,
        orchestrator: str,
        *,
        key_file: str | Path,
        cache_dir: str | Path,
        name: str = "worker",
        device: str = "cpu",
        dtype: str | None = None,
        unreachable_s: float = float("inf"),
        log=_log,
        relays: list[str] = (),
        relay_files: list[str] = (),
        trainer_key: str | None = None,
        parallel: int = 4,
        timeout_s: float = 10.0,
        run_id: str | None = None,
        engine: str = "builtin",
        engine_options: BaseModel | None = None,
        streams: int = 1,
    ):
        self.key = load_or_create_key(key_file)
        # run_id pins the run: an orchestrator serving another one is refused (WrongRun).
        self.client = WorkerClient(orchestrator, self.key, run_id=run_id)
        self.cache = Path(cache_dir)
        self.part_bytes = PART_BYTES
        self.outbox = self.cache / "outbox"
        self.outbox.mkdir(parents=True, exist_ok=True)
        self.name, self.device = name, device
        # `dtype` None: sample in whatever the leases say. Until the first lease says it, policies
        # load in float32 (the default run's precision); a bf16 run costs one reload from the
        # local cache. Invariant: while `version` is set, the sampler runs in `self.dtype`.
        self.pinned_dtype = dtype
        self.dtype = dtype or "float32"
        self.policy_ref: dict | None = None  # the status's policy entry last loaded (to reload it)
        self.unreachable_s, self.log = unreachable_s, log
        # Weights: from these relays first, the origin the orchestrator names last; only versions
        # signed by the trainer's key. Without a configured key the key the orchestrator announces
        # is used (trusting the orchestrator for it), with a warning.
        self.relays, self.trainer_key = [r.rstrip("/") for r in relays], trainer_key
        # Relays that were not up yet when this worker started (`swarmrl relay --url-file`): each
        # joins `relays` once its file exists, so `swarmrl rl` can start workers beside the trainer.
        self.relay_files = [Path(f) for f in relay_files]
        self.parallel, self.timeout_s, self.scores = parallel, timeout_s, SourceScores()
        self.version: int | None = None
        self.digest: str | None = None
        self.bases: set[str] = set()  # content digests of LoRA bases checked by this process
        self.sampler: RolloutEngine | None = None
        self.tokenizer = None  # the loaded version's (episodes encode observations and read turns)
        # What generates: a registered engine backend (inference/backends.py), opened once; its
        # session loads each version (in place where it can). Without proofs, trusted keys only.
        self.backend = backends.get(engine)
        options = engine_options if engine_options is not None else self.backend.options()
        context = backends.EngineContext(device=device, cache=self.cache, streams=streams, log=log)
        self.session = self.backend.open(options, context)
        launcher = os.environ.get("SWARMRL_LAUNCHER_PID")
        self.parent = int(launcher) if launcher else None

    def _watchdog(self) -> None:
        if self.parent is not None and os.getppid() != self.parent:
            raise SystemExit("the swarmrl rl launcher is gone; stopping this worker")

    def _call(self, fn, what: str):
        return retrying(fn, what=what, give_up_s=self.unreachable_s, check=self._watchdog, log=self.log)

    # ---- policy ------------------------------------------------------------------------------
    def _relays(self) -> list[str]:
        """The relays to fetch from: the given ones, and those of `relay_files` written by now."""
        for f in list(self.relay_files):
            try:
                url = json.loads(f.read_text())["url"].rstrip("/")
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not written yet (or being written): the origin serves meanwhile
            self.relays.append(url)
            self.relay_files.remove(f)
        return self.relays

    def _ensure_policy(self, policy: dict) -> bool:
        """Load the orchestrator's newest version if we do not have it. False: try again later."""
        version, digest = policy["version"], manifest_digest(policy["manifest"])
        # The digest too: a trainer resumed from an older checkpoint rebuilds a version number
        # with other weights.
        if version == self.version and digest == self.digest:
            return True
        key = self.trainer_key
        if key is None:
            key = str(policy["manifest"].get("public_key", ""))
            if not getattr(self, "_warned_key", False):
                self.log(
                    f"no --trainer-key given: trusting the orchestrator's word that {key[:16]}… is the trainer's key"
                )
                self._warned_key = True
        before = {u: e["successes"] for u, e in self.scores.snapshot().items()}
        notes: list[str] = []  # what fetch_version says: whether it used a patch
        try:
            t0 = time.monotonic()
            sources = [*self._relays(), policy["url"]]
            # A LoRA run's version is an adapter: merged into the base it names (fetched once,
            # checked against the digest the trainer signed), so the sampler sees plain weights.
            folder, base = fetch_policy(
                version,
                policy["manifest"],
                sources,
                self.cache / "policies",
                public_key=key,
                verified=self.bases,
                scores=self.scores,
                keep=2,
                parallel=self.parallel,
                timeout_s=self.timeout_s,
                log=notes.append,
            )
            self.sampler, tok, where = self._load(folder, base, version)
        except (BroadcastError, OSError, ValueError) as e:
            # Pruned or replaced meanwhile, or the trainer restarted: ask for the status again.
            self.log(f"could not load policy v{version}: {e}")
            return False
        served = {u: e["successes"] - before.get(u, 0) for u, e in self.scores.snapshot().items()}
        patched = [n.split(": ", 1)[1] for n in notes if "and a patch of" in n]
        self.log(
            f"policy v{version} loaded {where} in {time.monotonic() - t0:.2f} s; "
            + (f"{patched[0]} from " if patched else "shards from ")
            + (", ".join(f"{u} ({n})" for u, n in served.items() if n > 0) or "the local cache")
        )
        self.version, self.digest, self.policy_ref = version, digest, policy
        self.tokenizer = tok
        return True

    def _load(self, folder: Path, base: Path | None, version: int):
        """(engine, tokenizer, where) for a fetched version: the backend's session loads it."""
        return self.session.load(folder, base, version, self.dtype)

    def _declared(self, lease: Lease) -> dict:
        """What this worker's groups declare of their engine (the validator's limits follow it)."""
        return self.session.declared(lease.dtype)

    def _follow_precision(self, lease: Lease) -> bool:
        """Have the policy loaded in the dtype the lease names. False: it could not be reloaded
        (the loop asks for the status again). Raises WrongPrecision for a pinned other dtype. An
        endpoint's server computes in its own precision, which its groups declare instead."""
        if lease.dtype == self.dtype or not self.backend.proves:
            return True
        if self.pinned_dtype is not None or (self.session.fixed_dtype and self.sampler is not None):
            # Sampling anyway would only produce groups the validator rejects as fraud.
            raise WrongPrecision(
                f"this run samples in {lease.dtype} (the lease says so) but this worker "
                + (
                    f"was started with --dtype {self.pinned_dtype}: restart without --dtype, or"
                    if self.pinned_dtype is not None
                    else f"started {self.session.describe()} in {self.dtype}, which it cannot change in place: restart"
                )
                + f" with --dtype {lease.dtype}"
            )
        self.log(f"this run samples in {lease.dtype}: reloading policy v{self.version} in it")
        self.dtype = lease.dtype
        # Forgetting the loaded version forces the reload (and lets subclasses that alter a
        # freshly loaded policy, like the adversaries, see it as fresh).
        policy, self.version, self.digest = self.policy_ref, None, None
        return policy is not None and self._ensure_policy(policy)

    # ---- work --------------------------------------------------------------------------------
    def generate(self, lease: Lease | dict) -> dict:
        """The submission body for a lease (what POST /v1/rollouts sends): `submission(lease)`."""
        return request_body(self.submission(lease))

    def submission(self, lease: Lease | dict) -> SubmitIn:
        """Sample every prompt of a lease with the lease's seeds and settings. The messages are
        built unchecked (`model_construct`): what the engine produced is sent as it is, and the
        orchestrator's checks say what is wrong with it."""
        lease = Lease.model_validate(lease)
        if not self._follow_precision(lease):
            raise RuntimeError(
                f"the policy could not be reloaded in {lease.dtype}, the precision this lease asks "
                "for (the log says why); load it again (_ensure_policy) before generating"
            )
        plain = [p for p in lease.prompts if p.environment is None]
        samples = self._completions(lease, plain) if plain else {}
        episodic = [p for p in lease.prompts if p.environment is not None]
        if episodic:
            samples.update(self._episodes(lease, episodic))
        declared = self._declared(lease)
        groups = [
            GroupIn.model_construct(slot=p.slot, policy_version=self.version, **declared, samples=samples[p.slot])
            for p in lease.prompts
        ]
        return SubmitIn.model_construct(lease_id=lease.lease_id, groups=groups)

    def _completions(self, lease: Lease, prompts: list) -> dict[int, list[SampleIn]]:
        """One completion per seed of each single-turn prompt: the samples by slot."""
        g = lease.group_size
        ids = [p.prompt_ids for p in prompts for _ in range(g)]
        seeds = [s for p in prompts for s in p.seeds]
        proves = self.sampler.provides_hidden
        outs = self.sampler.generate(
            ids, seeds, max_new_tokens=lease.max_new_tokens, temperature=lease.temperature, return_hidden=proves
        )
        if proves:
            proofs = [
                encode(p)
                for p in build_proofs_many(
                    [o.hidden for o in outs], chunk_size=lease.proof.chunk_size, topk=lease.proof.topk
                )
            ]
        else:
            self._check_endings(outs, lease)
            proofs = [[] for _ in outs]
        sample = [
            SampleIn.model_construct(
                token_ids=o.token_ids, logprobs=o.logprobs, finish_reason=o.finish_reason, proofs=pr
            )
            for o, pr in zip(outs, proofs)
        ]
        return {p.slot: sample[i * g : (i + 1) * g] for i, p in enumerate(prompts)}

    def _episodes(self, lease: Lease, prompts: list) -> dict[int, list[SampleIn]]:
        """One episode per seed of each prompt that names an environment (protocol v3): the model's
        turns sampled by the engine, the observations from the environment's code on this machine
        (the orchestrator replays it and refuses anything else), one TOPLOC proof per chunk of each
        turn, the turns' proofs in order."""
        from swarmrl.envs import registry
        from swarmrl.inference.episodes import EpisodeJob, play_episodes

        if self.tokenizer is None:
            raise RuntimeError("no tokenizer loaded: load a policy (_ensure_policy) before generating")
        proves = self.sampler.provides_hidden
        by_env: dict[str, list] = {}
        for p in prompts:
            by_env.setdefault(p.environment.name, []).append(p)
        out: dict[int, list[SampleIn]] = {}
        for name, ps in by_env.items():
            try:
                env = registry.get(name)
            except ValueError as e:
                raise UnknownEnvironment(
                    f"this run's tasks are episodes of environment {name!r}, which this worker does not have "
                    f"({e}): install the plug-in that registers it and name it in the run's plugins (docs/plugins.md)"
                ) from None
            spec = ps[0].environment
            jobs = [EpisodeJob(p.environment.task, p.environment.seed, p.prompt_ids, s) for p in ps for s in p.seeds]
            played = play_episodes(
                self.sampler,
                self.tokenizer,
                env,
                jobs,
                max_turns=spec.max_turns,
                max_tokens=spec.max_tokens,
                temperature=lease.temperature,
                return_hidden=proves,
                seed_of=self._turn_seed,
            )
            samples = []
            for e in played:
                proofs = []
                if proves:
                    for turn in build_proofs_many(e.hidden, chunk_size=lease.proof.chunk_size, topk=lease.proof.topk):
                        proofs += encode(turn)
                samples.append(
                    SampleIn.model_construct(
                        token_ids=e.episode.tokens,
                        logprobs=e.logprobs,
                        finish_reason=e.finish_reason,
                        proofs=proofs,
                        model_mask=e.episode.model_mask,
                    )
                )
            g = lease.group_size
            out.update({p.slot: samples[i * g : (i + 1) * g] for i, p in enumerate(ps)})
        return out

    def _turn_seed(self, seed: int, turn: int) -> int:
        from swarmrl.envs.episode import turn_seed

        return turn_seed(seed, turn)

    def _check_endings(self, outs: list, lease: Lease) -> None:
        """A server that stops on other tokens than the run's end token (a checkpoint's extra
        eos ids, stop strings) makes completions the orchestrator refuses as fraud: stop first."""
        for j, o in enumerate(outs):
            problem = termination_problem(
                list(o.token_ids), o.finish_reason, self.sampler.stop_token_ids, lease.max_new_tokens
            )
            if problem:
                raise EndpointError(
                    f"completion {j} from the server breaks the run's rule for how a completion ends ({problem}); "
                    f"a completion must stop at token {self.sampler.stop_token_ids[0]} or run to max_tokens. Start "
                    "vLLM with --generation-config vllm (the checkpoint's generation_config may add stop tokens); "
                    "docs/engines.md"
                )

    def deliver(self, path: Path) -> dict | None:
        """Send one outbox entry until it is accepted, refused, or its lease has expired: its
        groups in parts of at most `part_bytes` (a lease's groups together can exceed the
        orchestrator's request limit), the entry rewritten without each part once it is answered,
        so a restarted worker sends only what is left. The verdicts of every part together."""
        try:
            entry = json.loads(path.read_text())
            expires, submission = entry["expires_at"], entry["submission"]
            groups = list(submission["groups"])
        except (ValueError, KeyError, TypeError) as e:
            # A torn write (power loss) must not stop the worker on every start.
            path.rename(path.with_suffix(".corrupt"))
            self.log(f"outbox entry {path.name} is unreadable ({e}); moved aside")
            return None
        budget, verdicts = self.part_bytes, {"accepted": [], "rejected": []}
        while groups:
            part = submission_parts({**submission, "groups": groups}, budget)[0]
            try:
                if len(json.dumps(part)) > budget:  # one group alone over the budget: in pieces
                    result = self._upload(submission["lease_id"], part["groups"][0], expires, budget)
                else:
                    result = self._send(part, expires)
            except Refused as e:
                if e.code != "too_large":
                    raise
                # The orchestrator's limit is below ours: one group a part, then smaller pieces.
                if len(part["groups"]) > 1:
                    budget = len(json.dumps({**part, "groups": part["groups"][:1]}))
                    continue
                if budget > MIN_PIECE_BYTES:
                    budget = max(MIN_PIECE_BYTES, min(budget, len(json.dumps(part))) // 2)
                    continue
                self.log(
                    f"lease {submission['lease_id'][:8]}: even {budget}-byte pieces are over the orchestrator's "
                    f"request limit ({e.detail}); the group of slot {part['groups'][0].get('slot')} is dropped"
                )
                result = {"accepted": [], "rejected": []}
            if result is None:  # the whole lease was refused or expired: nothing more to send
                path.unlink(missing_ok=True)
                return None
            groups = groups[len(part["groups"]) :]
            for k in verdicts:
                verdicts[k] += result[k]
            if groups:
                atomic_write_text(
                    path, json.dumps({"expires_at": expires, "submission": {**submission, "groups": groups}})
                )
        path.unlink(missing_ok=True)
        return verdicts

    def _upload(self, lease_id: str, group: dict, expires: float, piece_bytes: int) -> dict | None:
        """One group too large for a request, in pieces of `piece_bytes` (POST /v1/rollouts/upload):
        each piece retried until answered, the next starting where the orchestrator says it has
        got to (after a dropped connection too). The group's verdicts, or None as `_send`."""
        data = json.dumps(group).encode()  # ASCII (json.dumps' default): any byte offset is a character's
        piece = {"lease_id": lease_id, "slot": group.get("slot"), "total": len(data)}
        piece["sha256"] = hashlib.sha256(data).hexdigest()
        offset = 0
        while True:
            chunk = data[offset : offset + piece_bytes].decode()
            try:
                reply = self._retrying(partial(self.client.upload, {**piece, "offset": offset, "data": chunk}), expires)
            except Refused as e:
                if e.code != "upload_offset":
                    raise
                # The orchestrator no longer holds what it had (its files went, or the group was
                # completed but its grading refused as busy): send the group again from the start.
                self.log(f"lease {lease_id[:8]}: {e.detail}; sending slot {piece['slot']} again from its start")
                offset = 0
                continue
            if reply is None:
                return None
            if reply.get("result") is not None:
                return self._verdicts(reply["result"])
            offset = reply["received"]

    def _send(self, part: dict, expires: float) -> dict | None:
        """One part of a submission, answered: its verdicts, or None when the lease is refused or
        expired. Raises Refused("too_large") for the caller to send smaller parts."""
        result = self._retrying(partial(self.client.submit, part), expires)
        return None if result is None else self._verdicts(result)

    def _retrying(self, call, expires: float) -> dict | None:
        """`call()` until the orchestrator answers it (through clock skew, a busy lane or an
        orchestrator away until the lease's expiry): its reply, or None when it refuses the
        lease or the lease expired meanwhile. A 413 is raised for the caller."""
        delay = 0.2
        while True:
            try:
                return call()
            except Refused as e:
                if e.code == "clock_skew" and time.time() < expires:
                    # Not a verdict on the work: retry (signed afresh) until the clocks agree.
                    self.log(f"submitting: {e.detail}")
                    time.sleep(min(5.0, delay))
                    delay = min(5.0, delay * 2)
                    continue
                if e.code in ("too_large", "upload_offset"):
                    raise
                self.log(f"submission refused: {e}")
                return None
            except Unavailable as e:
                if delay == 0.2:
                    self.log(f"submitting: {e}; kept in the outbox, retrying")
                # A 429 (a busy grading lane) comes from an orchestrator that holds the lease and
                # may keep it past its deadline for us: it says 410 once it is really gone.
                if time.time() > expires and e.status != 429:
                    self.log(f"the lease expired while the orchestrator was unreachable ({e}); dropping its groups")
                    return None
                self._watchdog()
                time.sleep(e.retry_after or delay)
                delay = min(5.0, delay * 2)

    def _verdicts(self, result: dict) -> dict:
        """The orchestrator's verdicts on submitted groups, logged; stops the worker on a refusal
        that every further group would get too."""
        for r in result["rejected"]:
            self.log(f"slot {r['slot']} rejected: {r['reason']}: {r['detail']}")
        refused = [r for r in result["rejected"] if r["reason"] == "engine_refused"]
        if refused:
            # Every further group would be refused the same way: stop and say which engine to run.
            raise RefusedEngine(f"the orchestrator refuses this worker's engine: {refused[0]['detail']}")
        if not self.backend.proves and any(r["reason"] == "proofs_missing" for r in result["rejected"]):
            # Taken off the trusted keys meanwhile: every further group would be more fraud.
            raise EndpointError(
                "the orchestrator refused this worker's groups for having no proofs: its key "
                f"{self.client.key_hex} is no longer trusted (orchestrator.trusted_keys_file)"
            )
        return result

    def flush_outbox(self) -> int:
        sent = 0
        for path in sorted(self.outbox.glob("*.json")):
            if self.deliver(path) is not None:
                sent += 1
        return sent

    def _check_trusted(self) -> None:
        """An endpoint worker's groups carry no proofs: only a trusted key may send them."""
        record = self._call(self.client.me, "record")
        if not record.get("trusted"):
            raise EndpointError(
                f"this worker's key {self.client.key_hex} is not trusted by the orchestrator, which refuses groups "
                "without TOPLOC proofs from it (proofs_missing): an OpenAI-compatible server cannot build them. Ask "
                "the run's operator to add the key to orchestrator.trusted_keys_file, or run the built-in engine"
            )
        self.log("this key is trusted: groups from the endpoint go without proofs")

    def run(self) -> None:
        me = self._call(lambda: self.client.register(self.name), "register")
        self.log(
            f"worker {self.name} registered as {self.client.key_hex} "
            f"(accepted {me['accepted']}, rejected {me['rejected']})"
        )
        if not self.backend.proves:
            self._check_trusted()
        # The run's plug-ins (its environments, say) before any lease: a missing one stops us now.
        plugins.follow(self._call(self.client.status, "status").get("plugins", []), where="the run's plugins")
        self.flush_outbox()
        while True:
            self._watchdog()
            st = self._call(self.client.status, "status")
            if st["finished"]:
                self.log("the run is finished")
                return
            if st["policy"] is None or not self._ensure_policy(st["policy"]):
                time.sleep(0.2)
                continue
            try:
                resp = self._call(lambda: self.client.lease(self.version), "lease")
            except Refused as e:
                if e.code == "run_finished":
                    return
                if e.code != "version_not_allowed":
                    raise  # banned, unregistered, ...: nothing this worker can fix by retrying
                time.sleep(0.05)  # our version fell out of the bound: the status says which to get
                continue
            received = time.time()
            try:
                lease = LeaseReply.model_validate(resp).lease
            except ValidationError as e:
                raise Refused(502, "bad_lease", f"the orchestrator sent a lease this worker cannot read: {e}") from None
            if lease is None:
                time.sleep(resp.get("retry_after_s", 0.2))
                continue
            if not self._follow_precision(lease):
                continue  # the lease expires unused; the next status says what to load
            submission = self.generate(lease)
            path = self.outbox / f"{lease.lease_id}.json"
            # Expiry on this machine's clock (receipt + lifetime), not the orchestrator's timestamp.
            expires = received + lease.expires_in_s
            atomic_write_text(path, json.dumps({"expires_at": expires, "submission": submission}))
            self.deliver(path)


def run_worker(
    orchestrator: str,
    *,
    key_file: str,
    cache_dir: str,
    name: str,
    threads: int | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    worker_class=None,
    relays: list[str] = (),
    relay_files: list[str] = (),
    trainer_key: str | None = None,
    run_id: str | None = None,
    engine: str = "builtin",
    engine_options: BaseModel | None = None,
    streams: int = 1,
) -> None:
    """Run a worker until the run ends. `worker_class` is `Worker` or a subclass taking the same
    arguments (the CLI passes a scripted adversary's class for `--adversary`); `engine` names the
    registered backend that generates (inference/backends.py) and `engine_options` are its options."""
    if threads:
        torch.set_num_threads(threads)
    worker = (worker_class or Worker)(
        orchestrator,
        key_file=key_file,
        cache_dir=cache_dir,
        name=name,
        device=device,
        dtype=dtype,
        relays=relays,
        relay_files=relay_files,
        trainer_key=trainer_key,
        run_id=run_id,
        engine=engine,
        engine_options=engine_options,
        streams=streams,
    )
    try:
        worker.run()
    except TLSError:
        raise  # a setting to fix (--ca-file): swarmrl.cli says so and exits 2, as for any bad flag
    except SwarmrlError as e:  # refused, unreachable, WrongPrecision, EndpointError, VllmUnavailable, ...
        print(f"swarmrl worker: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        close = getattr(worker.session, "close", None)
        if close is not None:
            close()  # e.g. a server this worker started (restart mode) stops with it
