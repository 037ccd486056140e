"""The messages of the worker protocol, as pydantic models shared by the orchestrator (which
validates every request body with them) and its clients (which validate what they receive).

docs/protocol.md is the prose version: endpoints, signing, the order of calls, and what each
field means. `PROTOCOL_VERSION` (swarmrl/protocol/__init__.py) changes when a message changes
in a way an existing worker would misread.

Requests are parsed strictly (`parse_body`): a key repeated in any JSON object is refused, and
the request models take each field in its JSON type only: no number sent as a string, no boolean
as a number, no integer written as 2.0 (a float field does take a JSON integer).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import sys
import types
import typing
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_serializer
from pydantic.fields import FieldInfo

from swarmrl.protocol.rollouts import Group

# Hard ceilings on request shapes, whatever the config says; the config's own limits (group
# size, token limit) are checked by the service with a message that names them.
MAX_TOKENS = 1 << 17
MAX_SAMPLES = 1024
MAX_GROUPS = 1024
MAX_PROOF_CHARS = 4 * (2 + 2 * 4096) // 3 + 4  # base64 of a top-4096 proof, the largest topk allowed

_LEASE_ID = r"^[0-9a-f]{32}$"


class _In(BaseModel):
    # Unknown fields are ignored, not refused: a worker may send a claimed reward, and it is
    # simply never read. Strict: a field in another JSON type than its own is refused, not coerced.
    model_config = ConfigDict(extra="ignore", strict=True)


class RegisterIn(_In):
    name: str = Field("worker", pattern=r"^[A-Za-z0-9_.\-]{1,64}$", description="display name, not an identity")


class LeaseIn(_In):
    policy_version: int = Field(ge=0, le=10**9, description="the policy version this worker has loaded")
    protocol_version: int = Field(
        2,
        ge=1,
        le=10**6,
        description="the protocol version this worker speaks (absent: 2, a worker from before episodes)",
    )


class _Claims(BaseModel):
    # Extra fields are kept (not refused at parse time) so that a claimed reward is rejected by
    # the service with its own reason and counted against the worker.
    model_config = ConfigDict(extra="allow", strict=True)


class SampleIn(_Claims):
    token_ids: list[Annotated[int, Field(ge=0, lt=1 << 31)]] = Field(max_length=MAX_TOKENS)
    logprobs: list[Annotated[float, Field(allow_inf_nan=False)]] = Field(max_length=MAX_TOKENS)
    finish_reason: Literal["stop", "length"]
    proofs: list[Annotated[str, Field(max_length=MAX_PROOF_CHARS)]] = Field(
        default_factory=list,
        max_length=MAX_TOKENS,
        description="TOPLOC proofs, base64, one per chunk of validator.chunk_size tokens (the lease says); "
        "in an episode, each model turn's chunks in turn order",
    )
    model_mask: list[bool] | None = Field(
        None,
        max_length=MAX_TOKENS,
        description="episodes only (a prompt with an environment): one per token, true where the model "
        "produced it, false for the environment's observations (whose logprobs are 0)",
    )


class GroupIn(_Claims):
    # In the order a worker sends them (samples last): request_body() writes fields in this order.
    slot: int = Field(ge=0, le=MAX_GROUPS)
    policy_version: int = Field(ge=0, le=10**9)
    engine: Literal["builtin", "vllm", "openai"] = Field(
        "builtin",
        description="what generated the group: the built-in seeded sampler or vLLM in the worker's process "
        "(both with proofs), or an OpenAI-compatible server (no proofs: accepted from trusted keys only)",
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="the precision the engine computed in, when it is not the run's (an endpoint's server); "
        "the validator's logprob tolerance follows it",
    )
    samples: list[SampleIn] = Field(min_length=1, max_length=MAX_SAMPLES)


class SubmitIn(_In):
    lease_id: str = Field(pattern=_LEASE_ID)
    groups: list[GroupIn] = Field(min_length=1, max_length=MAX_GROUPS)


class UploadIn(_In):
    """POST /v1/rollouts/upload: a piece of one group's JSON (orchestrator/uploads.py)."""

    lease_id: str = Field(pattern=_LEASE_ID)
    slot: int = Field(ge=0, le=MAX_GROUPS)
    offset: int = Field(ge=0, le=1 << 40, description="where this piece starts in the group's JSON (bytes)")
    total: int = Field(ge=1, le=1 << 40, description="the group's JSON, in bytes")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="of the group's whole JSON")
    data: str = Field(min_length=1, description="the piece: ASCII JSON text (json.dumps' default)")


def request_body(message: BaseModel) -> dict:
    """What a client sends of a request it built as `message`: the fields it set, in the model's
    order, and any extra field it added (a scripted cheat's claimed reward); a field it left
    out stays out, a None it set is sent as null. Built with `model_construct` or changed by
    assignment, a message is sent as it is: the orchestrator is the one that checks it."""
    return message.model_dump(mode="json", exclude_unset=True)


class PublishIn(_In):
    version: int = Field(ge=0, le=10**9)
    url: str = Field(max_length=2048, pattern=r"^https?://[^\s]+$")
    manifest: dict = Field(description="the version's signed broadcast manifest (publish_version())")


class MetricsIn(_In):
    """POST /v1/trainer/metrics: figures only the trainer has (held-out accuracy), for the dashboard."""

    step: int = Field(ge=0, le=10**9, description="rollout steps completed (the policy version evaluated)")
    metrics: dict[Annotated[str, Field(max_length=64)], float] = Field(max_length=32)


class ClaimIn(_In):
    max_groups: int = Field(16, ge=1, le=1024)


class VerdictIn(_In):
    id: int = Field(ge=0, le=1 << 62)
    ok: bool
    reason: str | None = Field(None, pattern=r"^[a-z_]{1,40}$")
    detail: str = Field("", max_length=2000)
    stats: dict[str, float] = Field(default_factory=dict, max_length=32)


class VerdictsIn(_In):
    verdicts: list[VerdictIn] = Field(default_factory=list, max_length=4096)
    retry: list[Annotated[int, Field(ge=0, le=1 << 62)]] = Field(default_factory=list, max_length=4096)


Request = TypeVar("Request", bound=BaseModel)


class BodyError(ValueError):
    """A request body that is not JSON as docs/protocol.md states it (before its fields are read)."""


def _one_each(pairs: list[tuple[str, object]]) -> dict:
    obj: dict[str, object] = {}
    for key, value in pairs:
        if key in obj:
            raise BodyError(f"the key {key[:64]!r} appears twice in one object: send each key once")
        obj[key] = value
    return obj


def loads(raw: bytes | str) -> object:
    """JSON with each key at most once per object (json.loads lets the last one win, and two
    parsers reading the same bytes differently is how a signed body gets misread). BodyError
    says what is wrong."""
    try:
        return json.loads(raw, object_pairs_hook=_one_each)
    except BodyError:
        raise
    except RecursionError:
        raise BodyError("not JSON this server reads: nested too deeply") from None
    except ValueError as e:  # bad JSON, bad UTF-8, integers of thousands of digits
        raise BodyError(f"not valid JSON: {str(e)[:200]}") from None


def parse_body(model: type[Request], raw: bytes | str) -> Request:
    """A request body as `model`, strictly: BodyError for a body that is not JSON or repeats a
    key, pydantic's ValidationError (naming the field) for a field of another type or out of
    its bounds."""
    return model.model_validate(loads(raw))


class ErrorOut(BaseModel):
    error: str
    detail: str


# ---- replies a worker reads ------------------------------------------------------------------
class _Out(BaseModel):
    # Replies may grow fields in a compatible version; an older client ignores them. "allow",
    # not "ignore": the orchestrator answers through these models, and a field the service adds
    # must reach the client even before the model lists it.
    model_config = ConfigDict(extra="allow")


class ProofSpec(_Out):
    kind: Literal["toploc"] = "toploc"
    chunk_size: int = Field(ge=1, description="tokens per TOPLOC proof (the last chunk may be shorter)")
    topk: int = Field(ge=1, description="hidden-state entries each proof commits to")


class EpisodeSpec(_Out):
    """A leased prompt that is an episode of an environment (docs/environments.md)."""

    name: str = Field(description="the environment (swarmrl.envs.registry); the worker needs its code")
    task: dict = Field(description="what the environment's respond() reads of the task")
    seed: int = Field(ge=0, description="the environment's seed (the same for every episode of the group)")
    max_turns: int = Field(ge=1, description="model turns at most")
    max_tokens: int = Field(ge=1, description="episode tokens after the prompt at most (turns and observations)")


class LeasedPrompt(_Out):
    slot: int = Field(ge=0, description="this prompt's index in the lease; the submitted group names it")
    problem_id: str
    task_type: str
    prompt: str = Field(description="the task prompt as the model sees it (length instruction included)")
    prompt_ids: list[int] = Field(description="the chat-templated prompt's token ids: sample after exactly these")
    target_length: int | None = Field(None, description="N of 'Think for N tokens', when length control is on")
    seeds: list[int] = Field(description="one Gumbel-max seed per completion of the group, in order")
    environment: EpisodeSpec | None = Field(
        None, description="an episode: play it turn by turn (protocol v3); None: one completion"
    )


class Lease(_Out):
    """Work for one worker: sample `group_size` completions of each prompt with its seeds."""

    lease_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    expires_at: float = Field(description="orchestrator clock; a worker should use its own receipt time + expires_in_s")
    expires_in_s: float
    min_version: int = Field(ge=0, description="the oldest policy version the groups may be sampled with")
    max_version: int = Field(ge=0, description="the newest (the one published when the lease was issued)")
    group_size: int = Field(ge=1)
    temperature: float = Field(ge=0)
    max_new_tokens: int = Field(ge=1)
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="the run's inference precision: sample in exactly this (the validator prefills in it)"
    )
    proof: ProofSpec
    prompts: list[LeasedPrompt]


class LeaseReply(_Out):
    """POST /v1/leases: a lease, or none with how long to wait and why."""

    lease: Lease | None = None
    retry_after_s: float | None = None
    reason: str | None = None


class Registered(_Out):
    """POST /v1/workers/register."""

    worker: str = Field(description="the worker's public key (hex), its identity")
    name: str
    accepted: int = Field(description="groups of this key that passed every check they were given")
    rejected: int


class WorkerRecord(Registered):
    """POST /v1/workers/me: what the orchestrator holds against (and for) this key."""

    fraud: int = Field(
        description="rejections no honest worker can get (protocol/reasons.py); bans at validator.ban_after"
    )
    banned: bool
    awaiting_validation: int = Field(description="accepted groups the validator has not checked yet")
    rejections: dict[str, int] = Field(description="rejections by reason code")
    expired_slots: int = Field(0, description="leased prompts this key let expire unsubmitted")
    proven: bool = Field(False, description="whether the key has orchestrator.proven_after accepted groups")
    trusted: bool = Field(
        False, description="whether the key is in orchestrator.trusted_keys_file (may submit groups without proofs)"
    )
    lease_allowance: int = Field(0, description="prompts this key may hold leased now (docs/security.md)")


class SlotAccepted(_Out):
    slot: int
    rewards: list[float] = Field(description="the orchestrator's rewards for the group's completions")
    informative: bool = Field(description="whether the rewards differ (a group with equal rewards teaches nothing)")
    validation: str | None = Field(None, description='"pending" (the validator will check it) or "cheap checks only"')
    already_accepted: bool = Field(False, description="a resubmission of a stored group (a lost reply)")


class SlotRejected(_Out):
    slot: int
    reason: str = Field(description="a code of protocol/reasons.py")
    detail: str


def submission_parts(submission: dict, budget: int) -> list[dict]:
    """A submission's body split into bodies of the same lease whose groups, in order, take at
    most `budget` bytes of JSON each (a group larger than that alone is a part by itself): the
    orchestrator accepts a lease's slots over several requests."""
    parts: list[dict] = []
    head = len(json.dumps({**submission, "groups": []}))
    size = 0
    for group in submission["groups"]:
        n = len(json.dumps(group))
        if parts and size + 2 + n <= budget:  # json.dumps puts ", " between list items
            parts[-1]["groups"].append(group)
            size += 2 + n
        else:
            parts.append({**submission, "groups": [group]})
            size = head + n
    return parts


class SubmitReply(_Out):
    """POST /v1/rollouts: a verdict per submitted slot."""

    accepted: list[SlotAccepted]
    rejected: list[SlotRejected]


class UploadReply(_Out):
    """POST /v1/rollouts/upload: how far the group has arrived; the verdict once it is whole."""

    received: int = Field(description="bytes of the group received so far: the next piece starts here")
    total: int
    result: SubmitReply | None = Field(None, description="once the last piece arrived: as POST /v1/rollouts answers")


# ---- what trusted roles read -----------------------------------------------------------------
class PolicyRef(_Out):
    version: int | None = Field(None, description="the version (in GET /v1/status; claims key policies by it)")
    url: str = Field(description="where the version's manifest and shards are served")
    manifest: dict = Field(description="the signed broadcast manifest (protocol/manifest.py)")


class Status(_Out):
    """GET /v1/status (public)."""

    next_step: int
    latest_version: int | None
    async_bound: int
    min_version: int = Field(description="the oldest policy version a lease may be sampled with now")
    finished: bool
    policy: PolicyRef | None = Field(None, description="the newest version, once the trainer published one")
    total_steps: int
    protocol_version: int
    run_id: str = Field(pattern=r"^[0-9a-f]{32}$", description="what every signed request of this run is bound to")
    plugins: list[str] = Field(
        default_factory=list,
        description="modules the run's roles import (its own environments, task sources; docs/plugins.md)",
    )


class ClaimedSample(_Out):
    token_ids: list[int]
    logprobs: list[float]
    seed: int
    proofs: list[str]
    model_mask: list[bool] | None = Field(None, description="an episode's model tokens (checked turn by turn)")


class ClaimedGroup(_Out):
    id: int
    worker: str
    policy_version: int
    temperature: float
    prompt_ids: list[int]
    samples: list[ClaimedSample]
    checks: Literal["full", "logprobs"] = Field(
        "full",
        description="full: proofs, seeded sampling, logprobs; logprobs: a trusted key's group without "
        "proofs, whose logprobs alone can be checked",
    )
    engine_dtype: str | None = Field(None, description="the precision its engine declared (logprobs checks)")
    engine: str = Field(
        "builtin",
        description="what the worker declared generated it (builtin, vllm, openai): it selects the engine's "
        "calibrated limits (Claim.calibrated) only where the run's limits file accepts that engine",
    )

    @classmethod
    def of(cls, id: int, group: Group, proofs: list[list[str]]) -> ClaimedGroup:
        """What a validator is sent of an accepted `group` (stored as `id`, with each completion's
        proofs): the projection of the rollout record the checks read, nothing a worker could not
        have seen. Only a trusted key's group comes without proofs (submissions.py): its logprobs
        are all that can be checked."""
        return cls(
            id=id,
            worker=group.worker,
            policy_version=group.policy_version,
            temperature=group.temperature,
            prompt_ids=group.prompt_ids,
            samples=[
                ClaimedSample(
                    token_ids=s.token_ids,
                    logprobs=s.logprobs,
                    seed=s.seed,
                    proofs=proofs[i] if i < len(proofs) else [],
                    model_mask=s.model_mask,
                )
                for i, s in enumerate(group.samples)
            ],
            checks="full" if any(proofs) else "logprobs",
            engine_dtype=group.engine_dtype,
            engine=group.engine or "builtin",
        )


class Claim(_Out):
    """POST /v1/validator/claim: groups to check, the policies they claim, the validator settings."""

    items: list[ClaimedGroup]
    policies: dict[str, PolicyRef] = Field(description="by version (as a string)")
    min_version: int
    config: dict = Field(description="the run's validator section (thresholds, chunk size, ...)")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="the run's inference precision: prefill in it")
    calibrated: dict[str, dict] | None = Field(
        None,
        description="the run's limits file's hard limits by engine (the names of ValidatorConfig.limits()); "
        "null: the run has no limits file and `config`'s thresholds apply",
    )
    calibrated_cpu: str | None = Field(None, description="the CPU kind the limits file was measured on")


class Recorded(_Out):
    recorded: int = Field(description="verdicts applied (verdicts for already settled groups are ignored)")


class Batch(_Out):
    """POST /v1/trainer/batches/{step}: the frozen batch, or what is still missing."""

    ready: bool
    step: int
    group_ids: list[int] = Field(default_factory=list)
    groups: list[Group] = Field(
        default_factory=list,
        description="the rollout records (protocol/rollouts.py Group), each as its stored Group.to_json() payload",
    )
    metrics: dict[str, float | None] = Field(default_factory=dict, description="NaN is sent as null")
    queued: int | None = Field(None, description="when not ready: informative groups waiting")
    needed: int | None = Field(None, description="when not ready: groups the batch needs")
    groups_seen: int | None = Field(None, description="when not ready: groups that passed their checks so far")
    groups_all_equal: int | None = Field(None, description="when not ready: of those, groups with all-equal rewards")
    all_equal_streak: int | None = Field(None, description="when not ready: all-equal groups in a row, newest last")
    all_equal_limit: int | None = Field(
        None, description="when not ready: the streak at which the run stops with no_signal (409)"
    )

    @field_serializer("groups")
    def _records(self, groups: list[Group]) -> list[dict]:
        # Each group as the record it was read from, nulls included: the reply itself is sent
        # without its None fields (response_model_exclude_none), a record is not.
        return [g.model_dump(mode="json", exclude_unset=True) for g in groups]


class Published(_Out):
    latest_version: int


class Finished(_Out):
    finished: bool


# ---- GET /v1/dashboard (public, read-only; orchestrator/dashboard.py) ------------------------


class DashboardRun(_Out):
    run_id: str
    next_step: int
    total_steps: int
    latest_version: int | None
    finished: bool
    async_bound: int
    group_size: int
    prompts_per_step: int
    protocol_version: int
    time: float = Field(description="the orchestrator's clock (Unix seconds) when the document was built")


class DashboardWorker(_Out):
    fingerprint: str = Field(description="the first 16 hex digits of the worker's public key")
    name: str = Field(description="the name the worker chose (shown as text, never as markup)")
    accepted: int = Field(description="groups accepted (taken back if a later check fails)")
    validated: int = Field(description="of those, groups the validator checked in full")
    rejected: int
    fraud: int = Field(description="rejections no honest worker can get")
    banned: bool
    trusted: bool
    rejections: dict[str, int] = Field(description="rejections by reason (docs/protocol.md)")
    last_seen_s: float = Field(description="seconds since its last signed request")
    registered: float
    evidence: list[dict] = Field(
        default_factory=list,
        description="calibrated runs: the sequential test per engine and statistic (engine, test, groups, score, "
        "peak, bound; docs/validation.md, 'Evidence per key')",
    )


class DashboardVersion(_Out):
    version: int
    published: float
    bytes: int | None
    adapter: bool = Field(description="a LoRA adapter applied to its base (trainer.lora), not a full model")


class DashboardValidation(_Out):
    groups: dict[str, int] = Field(description="groups by state: pending, validating, queued, consumed, ...")
    rejections: dict[str, int] = Field(description="all rejections by reason")
    mode: str


class DashboardBroadcast(_Out):
    versions: list[DashboardVersion] = Field(description="the newest 20 policy versions")


class DashboardStore(_Out):
    """What the orchestrator's store holds (orchestrator.keep_payload_steps bounds it)."""

    bytes: int = Field(description="the SQLite file's size (pages in use and free)")
    wal_bytes: int = Field(description="its write-ahead log's size")
    free_bytes: int = Field(description="free pages, reused before the file grows")
    groups_with_payload: int = Field(description="groups whose tokens and proofs are still held")
    payload_bytes: int = Field(description="the bytes of those tokens and proofs")
    groups_pruned: int = Field(description="groups trained on whose tokens left (an audit summary stays)")


class Dashboard(_Out):
    """GET /v1/dashboard: everything public about the run, rebuilt at most every
    orchestrator.dashboard_cache_s."""

    run: DashboardRun
    progress: list[dict[str, float]] = Field(
        description="per step: batch metrics (reward/mean, length/mean, "
        "off_policy/max, ...) and held-out eval/accuracy when known"
    )
    workers: list[DashboardWorker] = Field(description="the leaderboard: most accepted groups first (500 at most)")
    workers_total: int
    validation: DashboardValidation
    broadcast: DashboardBroadcast
    store: DashboardStore | None = Field(None, description="the store's size and what it holds")


def _shape(t) -> object:
    """A type annotation as plain data (its kind, arguments and constraints), spelled by this code
    rather than by a library's repr or JSON schema, so that only a change of the messages changes it.
    A model of another module (the rollout record, protocol/rollouts.py, in `Batch.groups`) is the
    JSON object it is sent as, spelled `dict` as it was before the record was typed: the digest
    pins the messages declared here, and the record is read by the trusted roles only."""
    if isinstance(t, type) and issubclass(t, BaseModel) and t.__module__ != __name__:
        return "dict"
    origin = typing.get_origin(t)
    if origin is Annotated:
        base, *meta = typing.get_args(t)
        return {"type": _shape(base), "meta": [_constraint(m) for m in meta]}
    if origin is Literal:
        return {"literal": [repr(a) for a in typing.get_args(t)]}
    if origin is not None:
        name = "union" if origin in (typing.Union, types.UnionType) else getattr(origin, "__name__", repr(origin))
        return {name: [_shape(a) for a in typing.get_args(t)]}
    return getattr(t, "__name__", repr(t))


def _constraint(m) -> object:
    if isinstance(m, FieldInfo):
        return [_constraint(x) for x in m.metadata]
    if dataclasses.is_dataclass(m) and not isinstance(m, type):
        return {type(m).__name__: {k: repr(v) for k, v in dataclasses.asdict(m).items()}}
    if hasattr(m, "__dict__"):
        return {type(m).__name__: {k: repr(v) for k, v in sorted(vars(m).items()) if not k.startswith("_")}}
    return repr(m)


def schema_digest() -> str:
    """sha256 of the shape of every message here: each model's fields with their types, bounds and
    whether they are required, without any prose. `PROTOCOL_VERSION`'s entry in
    `protocol.SCHEMA_DIGESTS` pins it, so a field changed without a version bump fails a test
    (tests/unit/test_protocol.py) rather than a worker in the field."""
    module = sys.modules[__name__]
    models = {
        name: cls
        for name, cls in vars(module).items()
        if inspect.isclass(cls) and issubclass(cls, BaseModel) and cls.__module__ == __name__
    }
    shapes = {
        name: {
            field: {"type": _shape(info.annotation), "required": info.is_required(), "meta": _constraint(info)}
            for field, info in cls.model_fields.items()
        }
        for name, cls in sorted(models.items())
    }
    return hashlib.sha256(json.dumps(shapes, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
