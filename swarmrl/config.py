"""Every knob of a run, documented where it is defined.

Defaults are the embedded default (a ~1M-parameter model learning arithmetic on a 2-core CPU).
Where a value comes from the INTELLECT-2 seed run (PrimeIntellect, "INTELLECT-2: A Reasoning
Model Trained Through Globally Decentralized Reinforcement Learning", 2025) or another paper,
the field says so; `configs/intellect2-qwq32b.toml` holds the seed run's values.

Config files are TOML; any field can be overridden on the command line with its dotted name
(`--trainer.lr 3e-7`). Unknown keys and bad values fail at start with the field's name and what
is allowed.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator



# The scripted cheats `swarmrl worker --adversary` and `async.adversaries` can run (implemented in
# swarmrl/adversary/workers.py; named here so that validating a config imports nothing above it).
ADVERSARY_KINDS = {
    "other_model": "samples with another model of the same architecture (re-initialised weights)",
    "old_version": "keeps sampling with the first policy version it loaded, claiming each newer one",
    "edit_tokens": "changes one token of every completion; proofs and logprobs rebuilt for the edit",
    "edit_logprobs": "reports every logprob as more confident than it was",
    "cherry_pick": "best of 4 samples with its own seeds (by total logprob), proofs and logprobs honest",
    "claim_reward": "attaches a reward of 1.0 to every completion",
    "replay": "answers each lease with the completions (and proofs) of its previous lease",
    "garbage_proofs": "sends well-formed proofs of random polynomials",
    "truncated_proofs": "sends its proofs cut short",
    "missing_proofs": "sends no proofs",
    "wrong_group_size": "drops one completion from every group",
}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ModelConfig(_Section):
    path: str | None = None
    """HF model folder to start from (any local causal LM). None: the project's tiny Qwen2 warm
    started by `swarmrl sft`, built on first use and cached under `base_cache_dir`."""
    base_cache_dir: str = ".cache/swarmrl/base"
    """Where the built-in base model is cached (relative to the working directory)."""
    device: str = "cpu"
    """Torch device for trainer and workers: "cpu", "cuda", "cuda:1"..."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype. float32 on CPU (bf16 matmuls are ~100x slower on these CPUs); bfloat16
    on GPUs, as in the seed run."""


class TasksConfig(_Section):
    source: str = "arithmetic"
    """"arithmetic" for the built-in procedural task, or a path to tasks in the INTELLECT-2 RL
    dataset schema: a .jsonl/.parquet file or a local Hugging Face dataset folder."""
    types: list[str] = Field(default_factory=list)
    """Task types beyond the built-in ones (verifiable_math, prime_rl_code, multiple_choice), as
    "module:ATTRIBUTE" naming a swarmrl.rewards.registry.TaskType in a module on the Python path;
    every process of the run registers them (docs/architecture.md, "Adding a task type")."""
    eval_source: str | None = None
    """Held-out tasks for a file `source` (same formats). None with "arithmetic": its held-out split."""
    digits: int = Field(2, ge=1, le=9)
    """Arithmetic difficulty: digits per operand."""
    ops: str = Field("+-", pattern=r"^[+-]+$")
    """Arithmetic operators to draw from."""
    train_size: int = Field(5000, ge=1)
    """Number of distinct arithmetic training problems."""
    eval_size: int = Field(200, ge=1)
    """Number of held-out problems used for `eval/accuracy`."""
    solve_rate_column: str | None = None
    """Column used for offline difficulty filtering (the seed used a 7B model's solve rate)."""
    solve_rate_range: tuple[float, float] | None = None
    """Keep rows whose solve rate lies in [lo, hi]. Seed run: [0.1, 0.8] (INTELLECT-2 report)."""
    seed: int = 0
    """Seed for task generation and shuffling."""


class SamplingConfig(_Section):
    group_size: int = Field(8, ge=2)
    """Completions per prompt (G in GRPO). Seed run: 16."""
    prompts_per_step: int = Field(16, ge=1)
    """Informative groups in one training batch; samples per step = this x group_size.
    Seed run: 32 prompts x 16 = 512 samples."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature; logprobs are taken under the same temperature. Seed run: 0.6
    (later raised to 1.0 in their ablations)."""
    max_new_tokens: int = Field(64, ge=1)
    """Token limit per completion; hitting it gives finish reason "length"."""
    worker_batch_prompts: int = Field(8, ge=1)
    """Prompts (groups) in one lease: what a worker samples in one batched generate call.
    Smaller leases let the orchestrator stop handing out work with a version closer to exactly
    what the next batch needs (less dropped as stale); larger ones batch the sampler better."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The run's inference precision: leases carry it, workers sample in it (a worker set to
    another refuses the lease with a message) and validators prefill in it, so honest work is
    judged against its own numerics (docs/validation.md calibrates both). float32 on CPU;
    bfloat16 for GPU fleets, as in the seed run."""
    uninformative_limit: int = Field(2000, ge=1)
    """Stop the run with an error after this many consecutive groups with all-equal rewards
    (no GRPO signal at all), rather than wait forever for an informative one."""


class LengthConfig(_Section):
    enabled: bool = False
    """Length-controlled reasoning: append " Think for {N} tokens before giving a response."
    to each prompt and shape the reward by how well the completion meets N."""
    targets: list[int] = Field(default_factory=lambda: [48, 64, 96])
    """Target lengths sampled uniformly per prompt. Seed run: 2000-10000 in steps of 2000."""
    mode: Literal["exact", "max", "clip"] = "max"
    """exact: task - coef*|len - N|; max: task * clip(coef*(N - len) + 0.5, 0, 1);
    clip: task if len <= N else 0 (the three modes of the INTELLECT-2 report)."""
    coef: float = Field(0.01, ge=0.0)
    """Penalty slope per token. Seed run: 0.001 for 2000-10000 token targets."""


class RewardsConfig(_Section):
    verify_workers: int = Field(1, ge=1)
    """Processes grading answers with math-verify."""
    verify_timeout_s: float = Field(5.0, gt=0)
    """Hard per-completion grading timeout; a completion that exceeds it scores 0."""
    verify_memory_mb: int = Field(1024, ge=64)
    """Address-space limit (RLIMIT_AS) of each grading process; an answer needing more scores 0
    and the process is replaced."""


class SandboxConfig(_Section):
    """How code rewards (`prime_rl_code` rows) run untrusted programs: each test in a fresh
    bubblewrap sandbox (see docs/sandbox.md)."""

    workers: int | None = Field(None, ge=1)
    """Sandboxes running at once (completions graded in parallel). None: one per CPU core."""
    test_timeout_s: float = Field(5.0, gt=0)
    """Wall-clock limit of one test; RLIMIT_CPU is this rounded up plus 1 s. Sandbox startup
    (about 40 ms here) gets `startup_grace_s` on top."""
    total_timeout_s: float = Field(30.0, gt=0)
    """Wall-clock limit for all tests of one completion; tests that no longer fit fail."""
    partial_credit: bool = False
    """False: reward 1 only if every test passes, stopping at the first failure (the seed run).
    True: the fraction of tests passed, running them all."""
    memory_mb: int = Field(512, ge=32)
    """Address-space limit (RLIMIT_AS) of each process in the sandbox; the slot's cgroup gets
    this plus `tmp_mb` plus 64 MB for the whole sandbox."""
    max_procs: int = Field(32, ge=1)
    """Processes and threads a program may have (RLIMIT_NPROC, and the cgroup's pids.max)."""
    max_output_kb: int = Field(1024, ge=1)
    """Stdout and stderr each read up to this; a program writing more is killed and fails."""
    max_file_mb: int = Field(16, ge=1)
    """Largest file a program may write (RLIMIT_FSIZE)."""
    max_open_files: int = Field(64, ge=8)
    """Open file descriptors (RLIMIT_NOFILE)."""
    tmp_mb: int = Field(64, ge=1)
    """Size of the sandbox's private /tmp (a tmpfs, the only writable place)."""
    startup_grace_s: float = Field(1.0, ge=0)
    """Added to each test's wall-clock limit for starting the sandbox and the interpreter."""
    uid_base: int = Field(61000, ge=1000)
    """Run as root, each sandbox pool claims `workers` consecutive uids from uid_base up that no
    other pool on the machine holds (lock files under /run/swarmrl/sandbox-uids), and slot i's
    programs run as the i-th (no account needed): never root, and one uid per slot, in no other
    pool, so each slot's process limit is its own."""
    cgroups: Literal["auto", "required", "off"] = "auto"
    """Per-slot pids+memory cgroup (v2 if delegated, else v1). "auto": use one where the
    cgroup filesystem is writable (root), else rely on rlimits and namespaces; "required":
    refuse to start without; "off": never."""
    bwrap: str = "bwrap"
    """The bubblewrap executable (Debian package `bubblewrap`)."""
    python: str | None = None
    """Interpreter run inside the sandbox (standard library only). None: this Python's base
    interpreter."""
    unsafe_no_sandbox: bool = False
    """DANGEROUS: run programs with no sandbox (as this user, with network and files), for code
    you trust on machines where bubblewrap cannot run. Prints a warning at every start."""


class AlgorithmConfig(_Section):
    delta: float = Field(4.0, gt=1.0)
    """Upper bound on the ratio for negative advantages (two-sided clipping). Seed run: 4."""
    eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    """Lower PPO clip: ratios below 1 - eps_low stop getting gradient. Seed run: 0.2."""
    eps_high: float = Field(0.2, ge=0.0)
    """Upper PPO clip (DAPO's clip-higher raises it, e.g. 0.28). Seed run: 0.2."""
    normalize_std: bool = True
    """Divide group advantages by the group's std. False is the Dr.GRPO variant (Liu et al. 2025)."""
    adv_eps: float = Field(1e-6, gt=0)
    """Added to the std before dividing."""
    normalization: Literal["token", "constant"] = "token"
    """Loss normaliser: "token" divides by the step's total completion tokens; "constant" by
    samples x max_new_tokens, a constant budget (Dr.GRPO)."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus weight (0: off)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the k3 KL estimate to the reference (starting) policy (0: off, as in the seed run)."""
    old_logprobs: Literal["recompute", "inference"] = "recompute"
    """Where logp_old comes from. "recompute": a no-grad forward of the trainer's current policy
    at the start of each rollout step (the seed run). "inference": the worker's logprobs, saving a
    forward pass; the two-sided clip then also bounds the off-policy ratio."""
    tis_cap: float | Literal["off"] = 2.0
    """With "recompute": weight each token's loss by min(p_old / p_inference, tis_cap). p_old is
    the proximal policy (the trainer's weights at the start of the step) and p_inference the
    policy that sampled the token, so this is decoupled PPO (Fu et al. 2025, AReaL) for stale
    async rollouts, and the truncated importance-sampling fix for inference/trainer mismatch
    (Yao et al. 2025) on fresh ones. The default since the async study (docs/learning.md): at
    k = 4 it kept held-out accuracy within 1.8-3.6 points of k = 0 where the seed run's objective
    lost 7-9.
    "off": no weights (the seed run's objective). Ignored (off) with old_logprobs = "inference",
    where the ratio is 1 by construction; setting it explicitly there is an error."""

    @field_validator("tis_cap", mode="before")
    @classmethod
    def _cap_off(cls, v: Any) -> Any:
        if v is None or (isinstance(v, str) and v.strip().lower() in ("off", "none")):
            return "off"
        return v

    @field_validator("tis_cap")
    @classmethod
    def _cap_positive(cls, v: float | str) -> float | str:
        if v != "off" and not v > 0:
            raise ValueError(f'must be greater than 0 (the largest importance weight), or "off"; got {v}')
        return v

    tis_level: Literal["token", "sequence"] = "token"
    """With tis_cap: "token" weighs each token by its own ratio; "sequence" by the geometric
    mean of its sequence's token ratios (lower variance; see algorithm/offpolicy.py)."""
    tis_mask_band: float | None = Field(None, gt=1.0)
    """With tis_cap: tokens (or, at sequence level, sequences) whose ratio p_old / p_inference is
    outside [1/band, band] get weight 0: too off-policy to learn from. None: no masking."""


class TrainerConfig(_Section):
    steps: int = Field(60, ge=1)
    """Rollout steps (policy versions) to train. 60 took the default bases from 0.23-0.31 to
    0.74-0.83 held-out over 3 seeds (docs/learning.md); 120 reached 0.91 in one run, at twice the
    time."""
    optimizer_steps: int = Field(2, ge=1)
    """Optimizer steps per rollout step: the batch is split into this many mini-batches.
    Seed run: 8 (512 samples, 64 per optimizer step)."""
    micro_batch_size: int = Field(64, ge=1)
    """Sequences per forward/backward; gradients accumulate over micro-batches."""
    lr: float = Field(1e-4, gt=0)
    """Peak learning rate. Seed run: 3e-7 (32B model). The tiny default tolerates 1e-4; at 5e-4
    and above it collapsed in our runs (Adam turns noisy RL gradients into full-size steps)."""
    warmup_steps: int = Field(5, ge=0)
    """Linear warmup in optimizer steps. Seed run: 25."""
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    """LR after warmup: constant (the seed run), or decayed to 0 by the last step, which on the
    tiny default keeps the final policy from swinging by several points between steps."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas. Seed run: (0.9, 0.99)."""
    weight_decay: float = Field(0.01, ge=0.0)
    """AdamW weight decay. Seed run: 0.01."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global grad norm. Seed run: 0.1 (one of its stability fixes)."""
    checkpoint_every: int = Field(20, ge=1)
    """Write a resumable checkpoint every N rollout steps (and at the end)."""
    keep_versions: int = Field(4, ge=1)
    """Policy version folders to keep on disk; older ones are deleted once no bound allows them."""
    weights_host: str = "127.0.0.1"
    """Address the trainer's broadcast origin binds (HTTP, read-only: signed, sharded versions).
    0.0.0.0 for relays or workers on other machines."""
    weights_port: int = Field(0, ge=0, le=65535)
    """Port of the broadcast origin; 0 picks a free one."""
    weights_url: str | None = None
    """The URL relays and workers fetch versions from, if not http://weights_host:port (e.g.
    behind NAT or when weights_host is 0.0.0.0)."""


class AsyncConfig(_Section):
    bound: int = Field(2, ge=0)
    """Async bound k: data used at step n comes from policy version >= n - k. 0 is synchronous.
    Seed run: 2, as here since the async study (docs/learning.md): with decoupled PPO (the
    default `algorithm.tis_cap`), k = 2 stayed within 1.4 points of k = 0 at every evaluated
    step and k = 4 within 3.6. With the seed run's objective (`tis_cap = "off"`) k = 4 lost 7-9
    points, and k = 2 learned markedly slower on the old base (docs/default-run.md)."""
    workers: int = Field(2, ge=1)
    """Inference worker processes started by `swarmrl rl`, each with its own key (the default
    exercises several untrusted workers; on 2 cores they share a core with each other)."""
    worker_threads: int = Field(1, ge=1)
    """torch threads per worker process."""
    trainer_threads: int = Field(1, ge=1)
    """torch threads in the trainer process."""
    worker_nice: int = Field(10, ge=0, le=19)
    """Scheduling niceness of the workers `swarmrl rl` starts. The trainer is the critical path
    (workers sample the next batch while it trains), so on a machine where they share cores
    the trainer goes first and workers take what is left."""
    endpoint_workers: int = Field(0, ge=0)
    """Trusted workers `swarmrl rl` starts that generate through an OpenAI-compatible server
    instead of the built-in sampler (`swarmrl worker --engine openai`), each with its own
    `swarmrl serve` process that it reloads with every policy version. Their keys are made
    trusted (written to <run-dir>/trusted_keys.txt with those of `orchestrator.trusted_keys_file`),
    so their groups go without proofs; the `async.workers` still prove theirs (docs/engines.md)."""
    adversaries: list[str] = Field(default_factory=list)
    """FOR TESTING THE VALIDATOR: extra workers `swarmrl rl` starts that cheat, one per entry,
    each in the named way (`swarmrl worker --help` lists them: other_model, old_version,
    edit_tokens, edit_logprobs, cherry_pick, claim_reward, replay, garbage_proofs,
    truncated_proofs, missing_proofs, wrong_group_size). They are banned and leave; the run goes on."""
    max_pending_groups: int | None = None
    """Back-pressure: the orchestrator stops issuing leases while this many groups are leased or
    wait unconsumed. None: prompts_per_step x min(bound + 1, 2): one batch in flight while the
    trainer trains. A deeper queue only makes data staler (on the default run, staleness 2
    learned far slower than staleness 0-1)."""

    @field_validator("adversaries", mode="before")
    @classmethod
    def _split(cls, value):
        # `--async.adversaries cherry_pick,other_model` as well as a TOML list.
        return [k.strip() for k in value.split(",") if k.strip()] if isinstance(value, str) else value


class OrchestratorConfig(_Section):
    host: str = "127.0.0.1"
    """Address the orchestrator binds. Keep loopback unless workers on other machines must reach it."""
    port: int = Field(0, ge=0, le=65535)
    """TCP port; 0 picks a free one (written to <run-dir>/orchestrator.json for the other roles)."""
    lease_timeout_s: float = Field(120.0, gt=0)
    """A lease not submitted within this many seconds expires; its problems go to other workers
    and a late submission is refused."""
    max_request_bytes: int = Field(8 << 20, ge=1024)
    """Largest request body accepted; bigger ones get 413 before being parsed."""
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
    grading_lanes: int = Field(2, ge=1)
    """Submissions graded at once (each lane is a process pool of rewards.verify_workers
    processes); one lane at most serves unproven keys."""
    grading_wait_s: float = Field(2.0, gt=0)
    """A submission that finds no free grading lane for this long is refused with 429 and its
    slots stay open, so waiting submissions never pile up on server threads."""


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
            raise ValueError(f"{path}, line {number}: {key[:80]!r} is not a worker public key (64 hex characters, "
                             "as `swarmrl worker` prints at start and /v1/workers/me names it)")
        keys.add(key)
    return keys


class BroadcastConfig(_Section):
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


class ValidatorConfig(_Section):
    mode: Literal["in-process", "external"] = "in-process"
    """in-process: the orchestrator validates in a thread of its own process (local runs).
    external: it only queues groups; `swarmrl validator` processes (trusted, with the
    validator token) claim and check them over HTTP."""
    rate: float = Field(1.0, ge=0.0, le=1.0)
    """Share of accepted groups that get the full check (prefill: TOPLOC, seeded sampling,
    logprobs). The others still get every cheap check. A banned worker's unconsumed groups are
    always fully re-checked."""
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
    CPU fp32 workers, calibrated on 1200 completions: at most 2 (docs/validation.md)."""
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
    group's typical chunk cannot: honest at most 0.44; int4-quantised weights at least 2.8 (every
    group fails); int8-quantised weights 0.4-0.94 (about half fail, so such a worker is banned
    within its first lease or two). float32 runs need no such check: each chunk is held to
    mant_err_mean_max, far below this."""
    bf16_sampling_margin: float = Field(0.25, ge=0.0)
    """sampling_margin in bf16 runs: logits are rounded to bf16, so decode and prefill can flip
    near-ties by a few of their ulps (honest: at most 0.08)."""
    bf16_logprob_tol: float = Field(0.25, ge=0.0)
    """logprob_tol in bf16 runs (honest: at most 0.12). A policy one version older stays within
    this (and within TOPLOC's limits): in bf16 runs a worker can pass off work of the previous
    version as the current one."""

    def trusted_logprob_limit(self, run_dtype: str, declared: str | None) -> float:
        """The logprob tolerance for a trusted server's group: `trusted_logprob_tol`, else the
        looser of the run's precision and the one the group declares (float16 as bfloat16)."""
        if self.trusted_logprob_tol is not None:
            return self.trusted_logprob_tol
        wide = "bfloat16" in (run_dtype, declared) or declared == "float16"
        return self.limits("bfloat16" if wide else "float32")["logprob_tol"]

    def limits(self, dtype: str) -> dict:
        """The thresholds a validator applies to the work of a run sampling in `dtype`, by the
        names of the float32 fields (and `group_mant_err_max`)."""
        if dtype == "bfloat16":
            return {"exp_mismatches_max": self.bf16_exp_mismatches_max,
                    "mant_err_mean_max": self.bf16_mant_err_mean_max,
                    "mant_err_median_max": self.bf16_mant_err_median_max,
                    "group_mant_err_max": self.bf16_group_mant_err_max,
                    "sampling_margin": self.bf16_sampling_margin, "logprob_tol": self.bf16_logprob_tol}
        # In float32 the group check is implied by the per-chunk one (a median of chunk means
        # that each pass cannot exceed their limit).
        return {"exp_mismatches_max": self.exp_mismatches_max, "mant_err_mean_max": self.mant_err_mean_max,
                "mant_err_median_max": self.mant_err_median_max, "group_mant_err_max": self.mant_err_mean_max,
                "sampling_margin": self.sampling_margin, "logprob_tol": self.logprob_tol}


class EvalConfig(_Section):
    every: int = Field(20, ge=0)
    """Evaluate held-out accuracy every N steps during training (0: only before and after)."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature for held-out evaluation (0: greedy). Default: the rollout
    temperature, so the figure is the accuracy of the policy that is being trained."""
    samples: int = Field(4, ge=1)
    """Samples per held-out problem (accuracy is their mean: avg@k)."""


class SFTConfig(_Section):
    steps: int = Field(600, ge=1)
    """Optimizer steps of supervised warm start on worked traces. 600 takes the model past
    learning column arithmetic itself, so its accuracy is set by the slips in the data rather
    than by how far a noise-sensitive transition got: at 400 steps the same seed gave 0.166 or
    0.274 depending on the CPU's vector kernels, at 600 (slip rate 0.7) 0.309 and 0.310
    (docs/learning.md)."""
    batch_size: int = Field(64, ge=1)
    """Traces per step."""
    lr: float = Field(3e-3, gt=0)
    """Peak learning rate (cosine decay to 10%)."""
    examples: int = Field(5000, ge=1)
    """Distinct training traces generated."""
    slip_rate: float = Field(0.7, ge=0.0, le=1.0)
    """Share of traces (among problems where it changes the answer) that show a slip: a dropped
    carry, or the answer digits read off in reverse, with the wrong answer it leads to. The base policy then slips about as often, which puts it in the seed
    run's difficulty band, and gives RL a consistent, verifiable behaviour to unlearn."""
    seed: int = 0
    """Initialisation and shuffling seed."""
    dtype: Literal["float32", "float64"] = "float32"
    """Precision of the warm start's arithmetic (the saved base is float32 either way). The
    float32 base depends on the CPU: the same seed gave 0.166 held-out with AVX-512 kernels and
    0.274 with AVX2 ones on one machine (docs/learning.md). float64 shrinks that rounding noise by
    ~1e9 at about twice the cost, but the training is chaotic: it only delays the divergence
    (same loss at step 51, different by step 101), so the default recipe is made robust instead."""
    threads: int | None = Field(None, ge=1)
    """torch threads for the warm start. None: torch's default (the core count). Reduction order
    can depend on the thread count, so a base meant to match across machines pins it."""
    verbosity: list[int] = Field(default_factory=lambda: [0])
    """Verbosity levels of the worked traces, one drawn uniformly per trace: 0 one terse line per
    column (`6+7=13`, ~34 tokens for 2 digits), 1 with the digit written (`6+7=13, write 3`,
    ~52), 2 each column named with its carry (`ones: 6+7=13, write 3, carry 1`, ~80). Several
    levels give a base that can think at different lengths. With `length.enabled`, each trace's
    prompt carries a target drawn independently of its level, so the base does not follow
    targets and RL has to learn it (configs/length-control.toml)."""

    target_match: float = Field(0.0, ge=0.0, le=1.0)
    """With `length.enabled`: share of traces whose prompt names the target nearest the trace's
    own length; the rest draw a target uniformly. 0 keeps target and length independent (the
    base never reads N); a small share gives the base a weak habit of reading N, as a pretrained
    LLM has, for RL to turn into control. docs/learning.md, part 3, measures both."""

    @field_validator("verbosity")
    @classmethod
    def _levels(cls, v: list[int]) -> list[int]:
        if not v or any(level not in (0, 1, 2) for level in v) or len(set(v)) != len(v):
            raise ValueError(f"must be distinct levels from 0, 1, 2 (e.g. [0, 1, 2]), got {v}")
        return v


class LoggingConfig(_Section):
    wandb_project: str | None = None
    """Log to Weights & Biases under this project when wandb is installed; never required."""
    plots: bool = True
    """Write PNG plots to <run-dir>/plots at the end."""
    progress: bool = True
    """Rich live progress in the terminal."""


class Config(_Section):
    run_dir: str | None = None
    """Run directory; None: a new folder under runs/."""
    seed: int = 0
    """Global seed (sampling seeds, trainer RNG)."""
    model: ModelConfig = ModelConfig()
    tasks: TasksConfig = TasksConfig()
    sampling: SamplingConfig = SamplingConfig()
    length: LengthConfig = LengthConfig()
    rewards: RewardsConfig = RewardsConfig()
    sandbox: SandboxConfig = SandboxConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    async_: AsyncConfig = Field(AsyncConfig(), alias="async")
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    validator: ValidatorConfig = ValidatorConfig()
    broadcast: BroadcastConfig = BroadcastConfig()
    eval: EvalConfig = EvalConfig()
    sft: SFTConfig = SFTConfig()
    logging: LoggingConfig = LoggingConfig()

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, populate_by_name=True)

    @model_validator(mode="after")
    def _check(self) -> "Config":
        for kind in self.async_.adversaries:
            if kind not in ADVERSARY_KINDS:
                raise ValueError(f"async.adversaries: unknown kind {kind!r}; one of: {', '.join(ADVERSARY_KINDS)}")
        samples = self.sampling.prompts_per_step * self.sampling.group_size
        if samples % self.trainer.optimizer_steps:
            raise ValueError(
                f"trainer.optimizer_steps={self.trainer.optimizer_steps} must divide the "
                f"{samples} samples per step (sampling.prompts_per_step x sampling.group_size)")
        alg = self.algorithm
        if alg.old_logprobs == "inference":
            explicit_cap = "tis_cap" in alg.model_fields_set and alg.tis_cap != "off"
            if explicit_cap or alg.tis_mask_band is not None:
                raise ValueError("algorithm.tis_cap and algorithm.tis_mask_band weigh tokens by p_old / p_inference, "
                                 "which is 1 when old_logprobs = \"inference\": set algorithm.old_logprobs = "
                                 "\"recompute\" (decoupled PPO) or drop them")
            alg.tis_cap = "off"  # the default cap does not apply: written out as off, so a reload agrees
        if alg.tis_mask_band is not None and alg.tis_cap == "off":
            raise ValueError("algorithm.tis_mask_band needs algorithm.tis_cap (the importance weights it masks); "
                             "set e.g. --algorithm.tis_cap 2.0")
        if self.tasks.solve_rate_range is not None:
            lo, hi = self.tasks.solve_rate_range
            if not 0.0 <= lo <= hi <= 1.0:
                raise ValueError(f"tasks.solve_rate_range must satisfy 0 <= lo <= hi <= 1, got {lo, hi}")
        return self

    def to_toml(self) -> str:
        data = self.model_dump(by_alias=True, exclude_none=True, mode="json")
        return tomli_w.dumps(data)


class ConfigError(ValueError):
    """A config problem, phrased for the person who wrote the config."""


def _parse_value(text: str) -> Any:
    """Command-line values are read as TOML values when they parse (numbers, true, [1, 2]),
    otherwise as plain strings, so `--tasks.source data.jsonl` needs no quotes."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _takes_str(annotation: Any) -> bool:
    return annotation is str or (get_origin(annotation) in (Union, UnionType) and str in get_args(annotation))


def _set_dotted(data: dict, dotted: str, text: str) -> None:
    """Set the field named `dotted` from its command-line text. A string field keeps the text
    as written when it reads as another TOML type (`--run_dir 2024` is the string "2024")."""
    keys = dotted.split(".")
    node: Any = data
    cls: type[BaseModel] | None = Config
    for i, key in enumerate(keys):
        fields = {**cls.model_fields, **{f.alias: f for f in cls.model_fields.values() if f.alias}}
        if key not in fields:
            where = ".".join(keys[:i]) or "the top level"
            allowed = sorted(f.alias or n for n, f in cls.model_fields.items())
            raise ConfigError(f"unknown config key '{dotted}': '{key}' is not a field of {where}; "
                              f"allowed there: {', '.join(allowed)}")
        field = fields[key]
        name = field.alias or key
        if i == len(keys) - 1:
            value = _parse_value(text)
            node[name] = text if _takes_str(field.annotation) and not isinstance(value, str) else value
            return
        ann = field.annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            raise ConfigError(f"unknown config key '{dotted}': '{'.'.join(keys[:i + 1])}' is a value, not a section")
        node = node.setdefault(name, {})
        cls = ann


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """`--a.b value` and `--a.b=value` pairs; anything else is an error that says so."""
    return [(key, _parse_value(text)) for key, text in _split_overrides(args)]


def _split_overrides(args: list[str]) -> list[tuple[str, str]]:
    """`(dotted key, value text)` for each override, before the value is parsed."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --trainer.lr 3e-7")
        key = arg[2:]
        if "=" in key:
            key, text = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} has no value: write {arg} VALUE")
            text = args[i + 1]
            i += 2
        out.append((key, text))
    return out


def _allowed_at(loc: tuple) -> str:
    """The field names allowed in the section at `loc` (for unknown-key messages)."""
    cls: Any = Config
    for key in loc:
        fields = {**cls.model_fields, **{f.alias: f for f in cls.model_fields.values() if f.alias}}
        cls = fields[key].annotation if key in fields else None
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            return ""
    return ", ".join(sorted(f.alias or n for n, f in cls.model_fields.items()))


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "config"
        if e["type"] == "extra_forbidden" and (allowed := _allowed_at(e["loc"][:-1])):
            lines.append(f"  {loc}: unknown key; allowed there: {allowed}")
            continue
        lines.append(f"  {loc}: {e['msg']} (got {e.get('input')!r})" if "input" in e and not isinstance(e.get("input"), dict)
                     else f"  {loc}: {e['msg']}")
    return "invalid config:\n" + "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the TOML file, then dotted overrides; validated once at the end."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
    for key, text in _split_overrides(overrides or []):
        _set_dotted(data, key, text)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        # Unknown keys inside a file land here too ("Extra inputs are not permitted").
        raise ConfigError(_format_validation_error(e)) from None
