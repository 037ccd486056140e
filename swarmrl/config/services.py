"""The services of a run: the orchestrator, weight broadcast, validation, and logging."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from swarmrl.config.base import Section


class OrchestratorConfig(Section):
    host: str = "127.0.0.1"
    """Address the orchestrator binds. Keep loopback unless workers on other machines must reach it."""
    port: int = Field(0, ge=0, le=65535)
    """TCP port; 0 picks a free one (written to <run-dir>/orchestrator.json for the other roles)."""
    lease_timeout_s: float = Field(120.0, gt=0)
    """A lease not submitted within this many seconds expires; its problems go to other workers
    and a late submission is refused."""
    max_request_bytes: int = Field(8 << 20, ge=1024)
    """Largest request body accepted; bigger ones get 413 before being parsed."""
    max_group_bytes: int = Field(64 << 20, ge=1024)
    """Largest group (its JSON, proofs included) a worker may send in pieces when it is over
    max_request_bytes (POST /v1/rollouts/upload): 16 completions of 32,000 tokens are about 20 MB."""
    max_upload_bytes_per_source: int = Field(256 << 20, ge=1024)
    """Unfinished uploads from one address hold at most this many bytes of the run directory's
    disk (429 beyond); an upload is deleted when its lease ends."""
    keep_payload_steps: Annotated[int, Field(ge=0)] | Literal["all"] = 8
    """Once a group has been trained on (or dropped as stale or all-equal) and its batch is older
    than both the trainer's second-newest checkpoint and this many steps, its tokens and proofs
    leave the store and an audit summary stays (sender, problem, version, rewards, lengths, the
    payload's SHA-256): the store grows with the run's steps, not its tokens (docs/scale.md).
    "all" keeps every payload."""
    max_clock_skew_s: float = Field(60.0, gt=0)
    """A signed request whose timestamp is further than this from the orchestrator's clock is
    refused (and nonces are remembered this long, so a replay is always caught)."""
    rate_per_s: float = Field(20.0, gt=0)
    """Sustained signed requests per second allowed per worker key (token bucket). An honest
    worker sends a few per lease."""
    rate_burst: int = Field(40, ge=1)
    """Requests a worker key may send in a burst before rate limiting starts (429)."""
    max_open_leases: int = Field(2, ge=1)
    """Open (unsubmitted, unexpired) leases one worker key may hold, so no worker can hoard the
    work that back-pressure allows."""
    registrations_per_min: int = Field(60, ge=1)
    """New worker keys accepted per minute from one source address (a flood of fresh keys from
    one place gets 429 without locking anyone else out)."""
    registrations_per_min_total: int = Field(600, ge=1)
    """New worker keys accepted per minute across all sources."""
    allowed_keys_file: str | None = None
    """For a closed run: a file of worker public keys (64 hex, one per line, # comments) that
    may register; any other key is refused (403 not_invited). Read again when it changes, so
    keys can be added while the run goes on. None: anyone may join (a public run)."""
    trusted_keys_file: str | None = None
    """Trusted fleets (docs/engines.md): a file of worker public keys (64 hex, one per line, #
    comments) whose groups are accepted without TOPLOC proofs, as an OpenAI-compatible server
    (vLLM, SGLang; `swarmrl worker --engine openai`) cannot build them. Every other key must
    still prove its work (`proofs_missing`). Their proofless groups get a logprob check by
    prefill at `validator.trusted_rate`; trusted keys count as proven. Read again when it
    changes (a removed key loses the privilege at once). Must exist and hold only well-formed
    keys when the config is loaded. None: nobody is trusted, every group must carry proofs."""
    requests_per_s_per_source: float = Field(100.0, gt=0)
    """Requests per second from one source address to the signed endpoints, counted before any
    signature is checked or body parsed (bursts of twice this pass)."""
    body_timeout_s: float = Field(30.0, gt=0)
    """A request body that has not fully arrived this long after its first byte is refused (408):
    a slow upload must not hold a connection and a server thread."""
    # Connections (transport/connlimit.py): sockets cost an attacker nothing, so what one address
    # may hold is bounded before any request is read.
    max_connections: int = Field(1000, ge=1)
    """Open connections, all sources together; the last quarter go only to sources holding few,
    so a few sources at their cap leave room for new ones. Each costs a file descriptor."""
    max_connections_per_source: int = Field(64, ge=1)
    """Open connections one source address (an IPv6 /64) may hold; more get 503 at once. A worker
    uses one or two; all local roles of a `swarmrl rl` run share 127.0.0.1. Raise it when workers
    reach the orchestrator through one proxy or NAT address."""
    header_timeout_s: float = Field(10.0, gt=0)
    """A request's line and headers must arrive within this many seconds of the connection opening
    (or of the first byte after the previous response); slower ones get 408 and are closed."""
    keep_alive_s: float = Field(30.0, gt=0)
    """An idle keep-alive connection is closed after this many seconds without a request."""
    # Admission: what a key may hold is earned (docs/security.md). A key is free, so nothing it
    # can do before it has done validated work may cost the run much.
    new_key_slots: int = Field(8, ge=1)
    """Prompts (slots) a key with no accepted work may hold leased at once. It grows by
    `slots_per_accepted` per accepted group up to `max_open_leases` leases' worth, and shrinks by
    every slot the key let expire and every rejection in the last `penalty_window_s`."""
    slots_per_accepted: float = Field(0.5, ge=0)
    """Lease allowance earned per accepted group."""
    penalty_window_s: float = Field(600.0, gt=0)
    """How long an expired slot or a rejection counts against a key's allowance. A key whose
    allowance is used up is refused leases (429, `allowance_exhausted`) until this has passed."""
    proven_after: int = Field(4, ge=0)
    """Groups passed by the validator after which a key is proven (groups that got only the
    cheap checks, with validator.rate < 1, do not count). Keys with fewer (new keys, attackers' keys)
    together may hold at most `unproven_share` of the work leasing allows at once, and their
    submissions are graded one at a time, so a flood of free keys cannot take a run's work or
    its grading capacity."""
    unproven_share: float = Field(0.5, gt=0, le=1)
    """Share of the outstanding work (async.max_pending_groups) unproven keys may hold together."""
    unproven_leases_per_source: int = Field(1, ge=1)
    """Full leases (sampling.worker_batch_prompts) each source address (an IPv6 /64) is sure of
    for its unproven keys once `unproven_share` is full, from `unproven_reserve_leases`: keys from
    one address crowd out only each other. Prompts the address's unproven keys let expire in the
    last `penalty_window_s` count against it, so a hoarder's fresh keys find nothing there."""
    unproven_reserve_leases: int = Field(4, ge=0)
    """Full leases beyond `unproven_share` kept for addresses holding less than their
    `unproven_leases_per_source`: a newcomer gets a lease at once while free keys from up to
    share / lease + reserve / per-source - 1 addresses hoard (5 at the shipped sizes), and within
    one lease time when more do. Unproven slots do not count against proven workers'
    back-pressure."""
    grading_lanes: int = Field(2, ge=1)
    """Submissions graded at once (each lane is a process pool of rewards.verify_workers
    processes); one lane at most serves unproven keys."""
    grading_wait_s: float = Field(2.0, gt=0)
    """A submission that finds no free grading lane for this long is refused with 429
    (`grading_busy`) and its slots stay open, so waiting submissions never pile up on server
    threads. Its lease is kept meanwhile: its deadline moves to at least 15 s after each such
    refusal (never past twice `lease_timeout_s` from its start), so the work of a key that
    submitted in time is never lost to others' grading."""
    unproven_grading_s: float = Field(10.0, gt=0)
    """Seconds of grading an unproven key's submissions may hold the new workers' lane for, and
    the same again for all unproven keys of the address it leased from (a token bucket each,
    refilled at this much per `unproven_grading_window_s`). A submission graded past it stops:
    its answers not graded yet score 0 ("not graded: ..."), and the next waits (429
    `grading_spent`, with Retry-After) until a tenth of it is back. So one key's expensive answers
    slow only that key. An honest new key's lease of 8 prompts x 8 math answers takes ~0.5-2 s
    (docs/security.md, "Grading"); proven keys are not metered."""
    unproven_grading_window_s: float = Field(60.0, gt=0)
    """The window over which `unproven_grading_s` refills: an unproven key (and its address) may
    use at most that much grading per this many seconds in the long run."""
    dashboard: bool = True
    """Serve GET /v1/dashboard (and `swarmrl status`): the run's progress, every worker's record
    by key fingerprint, validation and broadcast figures. Public and read-only: nothing on it is
    secret (orchestrator/dashboard.py). false answers 404."""
    dashboard_cache_s: float = Field(2.0, ge=0)
    """The dashboard document is rebuilt at most this often, however many viewers poll it."""

    @model_validator(mode="after")
    def _connection_caps(self):
        if self.max_connections_per_source > self.max_connections:
            raise ValueError(
                f"orchestrator.max_connections_per_source ({self.max_connections_per_source}) is more than "
                f"orchestrator.max_connections ({self.max_connections}): lower it or raise max_connections"
            )
        return self

    @field_validator("trusted_keys_file")
    @classmethod
    def _trusted_keys(cls, path: str | None) -> str | None:
        if path is not None:
            read_key_file(path)  # a missing file or a malformed line fails here, naming the line
        return path


def read_key_file(path: str | Path) -> set[str]:
    """The worker public keys a keys file lists (64 lowercase hex, one per line, # comments).
    ValueError names the file and line of anything else: a key list is a privilege, and a typo
    must not silently leave a key out."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read the keys file {path}: {e.strerror or e}") from None
    keys = set()
    for number, line in enumerate(lines, 1):
        key = line.split("#")[0].strip().lower()
        if not key:
            continue
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise ValueError(
                f"{path}, line {number}: {key[:80]!r} is not a worker public key (64 hex characters, "
                "as `swarmrl worker` prints at start and /v1/workers/me names it)"
            )
        keys.add(key)
    return keys


class BroadcastConfig(Section):
    shard_size: int = Field(1 << 20, ge=4096)
    """Bytes per shard of a published version. Shards are fetched in parallel, verified one by one
    (sha256 in the signed manifest) and resumed with HTTP Range requests. 1 MiB splits the default
    1M-parameter model (4 MiB) into 4; for a 32B model use 64-256 MiB."""
    relays: int = Field(1, ge=0)
    """Relay processes `swarmrl rl` starts between the trainer (origin) and the workers; workers
    fetch from the relays first and the origin last. 0: workers fetch from the origin."""
    keep: int = Field(3, ge=1)
    """Versions a relay and a worker's cache keep (a version being downloaded is never deleted)."""
    parallel: int = Field(4, ge=1)
    """Shards a client downloads at once, spread over the relays it knows by measured bandwidth."""
    timeout_s: float = Field(10.0, gt=0)
    """A download that receives nothing for this long moves to another source."""
    patches: Literal["auto", "on", "off"] = "auto"
    """Publish each version also as a patch against the one before it (the weights that changed,
    compressed; docs/broadcast.md, "Patches"); relays and workers holding the version before fetch
    that instead of the shards. auto: when versions are published in bfloat16 (`sampling.dtype`),
    where a step changes 0.5-5% of the real model's weights (patches of 1-5% of the version, made
    in 0.2-0.6 s per 260 MB); on: float32 too, where nearly every element changes every step
    (patches of 30-50% of the version that cost the trainer ~10 s per 500 MB on these CPUs); off.
    Every version is still published whole, and any failure falls back to its shards."""
    patch_max_share: float = Field(0.5, gt=0, le=1)
    """A patch larger than this share of its version is not published."""
    tls_cert: str | None = None
    """PEM certificate (chain) of the trainer's weight origin: with `tls_key`, it serves https
    (docs/operating.md). Relays take theirs as `swarmrl relay --tls-cert/--tls-key`."""
    tls_key: str | None = None
    """PEM private key of `tls_cert`."""

    @model_validator(mode="after")
    def _tls_pair(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("broadcast.tls_cert and broadcast.tls_key go together: set both or neither")
        return self


class ValidatorConfig(Section):
    mode: Literal["in-process", "external"] = "in-process"
    """in-process: the orchestrator validates in a thread of its own process (local runs).
    external: it only queues groups; `swarmrl validator` processes (trusted, with the
    validator token) claim and check them over HTTP."""
    rate: float = Field(1.0, ge=0.0, le=1.0)
    """Share of accepted groups that get the full check (prefill: TOPLOC, seeded sampling,
    logprobs) while their key is not on a clean streak (below). The others still get every cheap check.
    A banned worker's unconsumed groups are always fully re-checked."""
    sample_after: int = Field(16, ge=1)
    """Validation by reputation: a key whose last `sample_after` fully checked groups all passed
    (no fraud since) is on a clean streak, and its groups are checked at `sampled_rate` only. Any
    fraud rejection ends the streak (every group fully checked again until it is re-earned)
    and sends the key's groups that got only the cheap checks, not yet trained, back to the
    validator. Bans are unchanged (`ban_after`). docs/security.md derives the default from what
    a cheater gains: at most (1 - sampled_rate) / (sampled_rate * sample_after) unchecked
    groups per honest one, 0.19 here."""
    sampled_rate: float = Field(0.25, ge=0.0, le=1.0)
    """Share of the groups of a key on a clean streak that get the full check (never more than `rate`).
    1: validate everything, as before issue 30."""
    trusted_rate: float = Field(0.1, ge=0.0, le=1.0)
    """Share of trusted keys' groups without proofs (`orchestrator.trusted_keys_file`; an
    OpenAI-compatible server's) whose logprobs the validator checks by prefill: the only check
    such work allows (no proofs, no seeded sampling). Catches a server running other weights,
    another version or another temperature. 0: trust them entirely; 1: check all (a prefill
    costs a fraction of generating, but it runs on the validator's hardware)."""
    trusted_logprob_tol: float | None = Field(None, gt=0.0)
    """Largest |reported - recomputed| logprob of a trusted server's token. None: the tolerance
    of the precision its groups declare (`logprob_tol` for float32, `bf16_logprob_tol` for
    bfloat16 and float16, the looser of that and the run's). Those were calibrated on this
    project's CPU sampler; a GPU server's kernels differ more: measure on a few hundred honest
    groups (the verdicts' logprob_err_max) before lowering it."""
    chunk_size: int = Field(32, ge=1)
    """Tokens per TOPLOC proof (the seed run's decode batching: 32)."""
    topk: int = Field(128, ge=1, le=4096)
    """Hidden-state entries committed per proof (seed run: 128, i.e. 258-byte proofs)."""
    exp_mismatches_max: int = Field(8, ge=0)
    """A chunk fails when more of its top-k points differ in sign or exponent than this. Honest
    CPU fp32 workers, calibrated on 1200 completions: at most 2 on machine Y, 3 seen on machine E
    (docs/validation.md)."""
    mant_err_mean_max: float = Field(0.5, ge=0.0)
    """... or when the mean bf16 mantissa error (in units of the 7-bit mantissa) over the points
    that match exceeds this (honest: at most 0.008) ..."""
    mant_err_median_max: float = Field(0.5, ge=0.0)
    """... or their median does (honest: 0). These three are calibrated for CPU fp32 workers and
    validators (bf16 runs use the bf16_* fields below); recalibrate
    (benchmarks/calibrate_validator.py --dtype) before admitting GPU workers, whose kernels differ
    from a CPU validator's far more (the seed run's limits were much looser)."""
    sampling_margin: float = Field(0.05, ge=0.0)
    """Largest allowed gap, in logits/T + Gumbel units, between the best score under the seed and
    the submitted token's score (honest: 0; a token drawn with another seed: typically 1-15).
    Allows near-ties that rounding differences between decode and prefill could flip."""
    logprob_tol: float = Field(0.005, ge=0.0)
    """Largest allowed |reported - recomputed| logprob of a submitted token (honest CPU fp32: at
    most 2e-5; a policy one version older: up to 0.02)."""
    ban_after: int = Field(3, ge=1)
    """Groups rejected for fraud (a failed check an honest worker cannot fail) before a worker is
    banned: its key is refused and its unconsumed groups are re-checked."""
    batch_groups: int = Field(16, ge=1)
    """Groups a validator claims and prefills together."""
    threads: int = Field(1, ge=1)
    """torch threads of the in-process validator."""
    claim_timeout_s: float = Field(120.0, gt=0)
    """A claimed group without a verdict after this long goes back to the queue (a validator died)."""

    # bfloat16 runs (`sampling.dtype`): honest workers and the validator both compute in bf16,
    # and a worker's decode and the validator's prefill round differently at every layer, so
    # honest statistics are far wider than in float32. These replace the five above in such
    # runs; the honest maxima quoted are from 4800 completions on this project's CPU
    # (docs/validation.md, "bfloat16 runs").
    bf16_exp_mismatches_max: int = Field(16, ge=0)
    """exp_mismatches_max in bf16 runs (honest: at most 8)."""
    bf16_mant_err_mean_max: float = Field(3.0, ge=0.0)
    """mant_err_mean_max in bf16 runs (honest: at most 1.53)."""
    bf16_mant_err_median_max: float = Field(2.0, ge=0.0)
    """mant_err_median_max in bf16 runs (honest: at most 1)."""
    bf16_group_mant_err_max: float = Field(0.6, ge=0.0)
    """bf16 runs only: a group fails TOPLOC when the median, over all its chunks, of their
    mantissa error means exceeds this. One honest chunk can be as far off as a cheat's, a whole
    group's typical chunk cannot: honest at most 0.44 on the Xeon kind; int4-quantised weights at
    least 2.8 (every group fails); int8-quantised weights 0.4-0.94. The same limit for every
    engine a worker declares (no declaration buys a looser one). Measured on the built-in 4-layer
    model only, and not safe on every CPU kind: on an AMD EPYC with AVX-512 (Zen 4) honest groups
    of the built-in engine reach 0.86-0.93 (docs/validation.md, "Calibrating a run"). A run with
    `limits_file` replaces all the bf16_* fields by the limits measured for its model there."""
    bf16_sampling_margin: float = Field(0.25, ge=0.0)
    """sampling_margin in bf16 runs: logits are rounded to bf16, so decode and prefill can flip
    near-ties by a few of their ulps (honest: at most 0.08)."""
    bf16_logprob_tol: float = Field(0.25, ge=0.0)
    """logprob_tol in bf16 runs (honest: at most 0.12). A policy one version older stays within
    this (and within TOPLOC's limits): in bf16 runs a worker can pass off work of the previous
    version as the current one."""

    limits_file: str | None = None
    """A limits file written by `swarmrl calibrate` for this run's model and `sampling.dtype`:
    hard limits per engine, the evidence model that bans a key by a sequential test over all its
    groups (proofs/evidence.py) and the engines the calibration refuses. Replaces the
    thresholds above for the engines it names; a group declaring another engine is refused (not
    as fraud). Required for a bfloat16 run on a model other than the built-in one: the run refuses
    to start without it, and with a file made for another model or dtype."""

    def trusted_logprob_limit(self, run_dtype: str, declared: str | None) -> float:
        """The logprob tolerance for a trusted server's group: `trusted_logprob_tol`, else the
        looser of the run's precision and the one the group declares (float16 as bfloat16)."""
        if self.trusted_logprob_tol is not None:
            return self.trusted_logprob_tol
        wide = "bfloat16" in (run_dtype, declared) or declared == "float16"
        return self.limits("bfloat16" if wide else "float32")["logprob_tol"]

    def limits(self, dtype: str) -> dict:
        """The thresholds a validator applies to the work of a run sampling in `dtype` without a
        limits file, by the names of the float32 fields (and `group_mant_err_max`). The same for
        every engine: what a worker declares selects nothing."""
        if dtype == "bfloat16":
            return {
                "exp_mismatches_max": self.bf16_exp_mismatches_max,
                "mant_err_mean_max": self.bf16_mant_err_mean_max,
                "mant_err_median_max": self.bf16_mant_err_median_max,
                "group_mant_err_max": self.bf16_group_mant_err_max,
                "sampling_margin": self.bf16_sampling_margin,
                "logprob_tol": self.bf16_logprob_tol,
            }
        # In float32 the group check is implied by the per-chunk one (a median of chunk means
        # that each pass cannot exceed their limit).
        return {
            "exp_mismatches_max": self.exp_mismatches_max,
            "mant_err_mean_max": self.mant_err_mean_max,
            "mant_err_median_max": self.mant_err_median_max,
            "group_mant_err_max": self.mant_err_mean_max,
            "sampling_margin": self.sampling_margin,
            "logprob_tol": self.logprob_tol,
        }


class LoggingConfig(Section):
    wandb_project: str | None = None
    """Log to Weights & Biases under this project when wandb is installed; never required."""
    tensorboard: bool = False
    """Write every metric of metrics.jsonl as TensorBoard scalars to <run-dir>/tensorboard/ while
    `swarmrl rl` runs (`tensorboard --logdir RUN_DIR/tensorboard`); needs the tensorboard package
    (`pip install tensorboard`, or swarmrl[tensorboard]): a run that asks for it without it does
    not start. A resumed run rewrites the folder's scalars from metrics.jsonl."""
    plots: bool = True
    """Write PNG plots to <run-dir>/plots at the end."""
    progress: bool = True
    """Rich live progress in the terminal."""
