"""The protocol package is the one place the wire contract lives: the reason table covers every
code the orchestrator and validator emit, the lease model is what the orchestrator sends, and
docs/protocol.md documents all of it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from swarmrl.protocol import PROTOCOL_VERSION
from swarmrl.protocol.messages import (
    BodyError,
    ClaimIn,
    Lease,
    LeaseIn,
    LeaseReply,
    MetricsIn,
    PublishIn,
    RegisterIn,
    SubmitIn,
    VerdictsIn,
    parse_body,
)
from swarmrl.protocol.reasons import FRAUD_REASONS, REASONS

ROOT = Path(__file__).resolve().parents[2]


def _emitted_reasons() -> set[str]:
    service = "\n".join(f.read_text() for f in sorted((ROOT / "swarmrl/orchestrator").glob("*.py")))
    validator = (ROOT / "swarmrl/validator/core.py").read_text()
    # Whitespace-tolerant: the formatter splits a long call over lines.
    found = set(re.findall(r'reason="([a-z_]+)"', service))
    found |= set(re.findall(r'ApiError\(\s*4(?:03|10),\s*"((?:foreign|lease)_[a-z_]+)"', service))
    found |= set(re.findall(r'Verdict\(\s*item\.id,\s*False,\s*"([a-z_]+)"', validator))
    return found


def test_every_emitted_reason_is_in_the_table():
    emitted = _emitted_reasons()
    assert {"bad_slot", "foreign_lease", "lease_expired", "toploc", "sampling", "logprobs"} <= emitted  # the scan works
    assert emitted <= set(REASONS), f"reasons with no entry in protocol.reasons: {sorted(emitted - set(REASONS))}"


def test_fraud_is_exactly_what_an_honest_worker_cannot_get():
    assert FRAUD_REASONS == {code for code, (fraud, _) in REASONS.items() if fraud}
    for honest in ("duplicate", "in_progress", "slot_closed", "stale", "lease_expired"):
        assert honest not in FRAUD_REASONS


def test_protocol_doc_covers_the_reasons_and_version():
    doc = (ROOT / "docs/protocol.md").read_text()
    missing = [code for code in REASONS if f"`{code}`" not in doc]
    assert not missing, f"docs/protocol.md does not list {missing}"
    assert f"Protocol version: {PROTOCOL_VERSION}" in doc


def _lease(**over) -> dict:
    lease = {
        "lease_id": "ab" * 16,
        "expires_at": 1e9,
        "expires_in_s": 120.0,
        "min_version": 0,
        "max_version": 2,
        "group_size": 2,
        "temperature": 1.0,
        "max_new_tokens": 8,
        "proof": {"kind": "toploc", "chunk_size": 32, "topk": 128},
        "prompts": [
            {
                "slot": 0,
                "problem_id": "p",
                "task_type": "verifiable_math",
                "prompt": "1+1",
                "prompt_ids": [1, 2],
                "target_length": None,
                "seeds": [5, 6],
            }
        ],
    }
    lease.update(over)
    return lease


def test_lease_model_reads_what_it_describes_and_refuses_garbage():
    lease = Lease.model_validate(_lease(future_field="ignored"))  # newer orchestrators may add fields
    assert lease.prompts[0].seeds == [5, 6] and lease.proof.topk == 128
    assert LeaseReply.model_validate({"lease": None, "retry_after_s": 0.2, "reason": "wait"}).lease is None
    for bad in ({"lease_id": "not-hex"}, {"group_size": 0}, {"proof": {"kind": "other", "chunk_size": 1, "topk": 1}}):
        with pytest.raises(ValidationError):
            Lease.model_validate(_lease(**bad))


def test_submission_model_keeps_claims_for_the_service_to_refuse():
    body = {
        "lease_id": "ab" * 16,
        "groups": [
            {
                "slot": 0,
                "policy_version": 1,
                "reward": 1.0,
                "samples": [{"token_ids": [3], "logprobs": [-0.1], "finish_reason": "stop", "proofs": ["AA"]}],
            }
        ],
    }
    sub = SubmitIn.model_validate(body)
    assert sub.groups[0].model_extra == {"reward": 1.0}  # refused later as claimed_reward, counted as fraud
    with pytest.raises(ValidationError):
        SubmitIn.model_validate({**body, "lease_id": "x"})


def _submission(**group) -> dict:
    sample = {"token_ids": [3, 4], "logprobs": [-0.1, -2], "finish_reason": "stop", "proofs": ["AA"]}
    return {"lease_id": "ab" * 16, "groups": [{"slot": 0, "policy_version": 1, "samples": [sample], **group}]}


def _sample(**fields) -> dict:
    return _submission(samples=[{**_submission()["groups"][0]["samples"][0], **fields}])


# Each request field sent in another JSON type than its own: refused, naming the field.
COERCED = [
    (LeaseIn, {"policy_version": "3"}, "policy_version"),  # a number as a string
    (LeaseIn, {"policy_version": True}, "policy_version"),  # a boolean as a number
    (LeaseIn, {"policy_version": 3.0}, "policy_version"),  # an integer written as a float
    (RegisterIn, {"name": 7}, "name"),  # a number as a string
    (SubmitIn, _submission(slot=True), "groups.0.slot"),
    (SubmitIn, _submission(slot="0"), "groups.0.slot"),
    (SubmitIn, _submission(policy_version="1"), "groups.0.policy_version"),
    (SubmitIn, _sample(token_ids=["3", 4]), "groups.0.samples.0.token_ids.0"),
    (SubmitIn, _sample(token_ids=[3, True]), "groups.0.samples.0.token_ids.1"),
    (SubmitIn, _sample(logprobs=["-0.1", -2]), "groups.0.samples.0.logprobs.0"),
    (SubmitIn, _sample(logprobs=[False, -2]), "groups.0.samples.0.logprobs.0"),
    (ClaimIn, {"max_groups": "16"}, "max_groups"),
    (VerdictsIn, {"verdicts": [{"id": 1, "ok": 1}]}, "verdicts.0.ok"),  # a number as a boolean
    (VerdictsIn, {"verdicts": [{"id": 1, "ok": "true"}]}, "verdicts.0.ok"),
    (VerdictsIn, {"verdicts": [{"id": "1", "ok": True}]}, "verdicts.0.id"),
    (VerdictsIn, {"retry": [True]}, "retry.0"),
    (VerdictsIn, {"verdicts": [{"id": 1, "ok": True, "stats": {"chunks": "3"}}]}, "verdicts.0.stats.chunks"),
    (PublishIn, {"version": "1", "url": "http://x", "manifest": {}}, "version"),
    (MetricsIn, {"step": 1, "metrics": {"eval/accuracy": "0.5"}}, "metrics.eval/accuracy"),
]


@pytest.mark.parametrize("model, body, field", COERCED, ids=[f"{m.__name__}:{f}" for m, _, f in COERCED])
def test_a_field_in_another_json_type_is_refused_naming_it(model, body, field):
    with pytest.raises(ValidationError) as e:
        parse_body(model, json.dumps(body))
    assert [".".join(str(x) for x in err["loc"]) for err in e.value.errors()] == [field]


def test_the_strict_types_take_what_the_clients_send():
    sub = parse_body(SubmitIn, json.dumps(_submission()))
    assert sub.groups[0].samples[0].logprobs == [-0.1, -2.0]  # a float field takes a JSON integer
    verdicts = parse_body(VerdictsIn, '{"verdicts": [{"id": 1, "ok": true, "stats": {"chunks": 3}}], "retry": [2]}')
    assert verdicts.verdicts[0].stats == {"chunks": 3.0} and verdicts.retry == [2]
    assert parse_body(ClaimIn, b"{}").max_groups == 16


@pytest.mark.parametrize(
    "raw, key",
    [
        ('{"policy_version": 1, "policy_version": 2}', "policy_version"),
        ('{"lease_id": "x", "groups": [{"slot": 0, "slot": 1}]}', "slot"),  # anywhere in the body
        ('{"verdicts": [], "extra": {"a": 1, "a": 1}}', "a"),  # in a field nobody reads, too
    ],
)
def test_a_key_sent_twice_is_refused_naming_it(raw, key):
    with pytest.raises(BodyError, match=f"the key '{key}' appears twice in one object"):
        parse_body(LeaseIn, raw)


@pytest.mark.parametrize("raw", [b"{", b"\xff", b"[" * 100_000, b'{"policy_version": 1' + b"0" * 5000 + b"}"])
def test_what_is_not_json_is_a_body_error(raw):
    with pytest.raises(BodyError):
        parse_body(LeaseIn, raw)


def test_every_orchestrator_reply_has_a_protocol_model():
    """Each JSON route answers through a protocol model (FastAPI validates the reply against it),
    so the server cannot drift from what clients check."""
    from swarmrl.orchestrator.app import create_app

    class _Orch:  # create_app only reads the config and registers routes
        from swarmrl.config import Config

        cfg = Config()
        trainer_token, validator_token = "t", "v"

    app = create_app(_Orch()).fastapi
    routes = {r.path: r for r in app.routes if getattr(r, "path", "").startswith("/v1/")}
    assert len(routes) >= 10
    missing = sorted(p for p, r in routes.items() if getattr(r, "response_model", None) is None)
    assert not missing, f"routes without a response_model: {missing}"


def test_client_refuses_a_reply_of_the_wrong_shape():
    from swarmrl.protocol.client import ProtocolMismatch, _checked
    from swarmrl.protocol.messages import Status, SubmitReply

    ok = {"accepted": [{"slot": 0, "rewards": [1.0, 0.0], "informative": True}], "rejected": []}
    assert _checked(SubmitReply, ok, "submit") is ok
    with pytest.raises(ProtocolMismatch, match=r"status.*next_step.*same swarmrl version"):
        _checked(Status, {"next_step": "soon"}, "status")


def test_retrying_signs_again_after_a_clock_skew_refusal_and_gives_up_on_a_wrong_clock():
    from swarmrl.protocol.client import SKEW_RETRIES, Refused, retrying

    calls = []

    def late_twice():
        calls.append(1)
        if len(calls) <= 2:  # queued behind a stalled server: too old by the time it was read
            raise Refused(401, "clock_skew", "timestamp is more than 60 s from the orchestrator's clock")
        return "leased"

    notes = []
    assert retrying(late_twice, what="lease", give_up_s=60, log=notes.append, base_s=0.0) == "leased"
    assert len(calls) == 3 and all("signing again" in n for n in notes)

    def always_wrong():
        calls.append(1)
        raise Refused(401, "clock_skew", "check the worker's clock")

    calls.clear()
    with pytest.raises(Refused, match="check the worker's clock"):
        retrying(always_wrong, what="lease", give_up_s=60, log=lambda _: None, base_s=0.0)
    assert len(calls) == SKEW_RETRIES + 1

    def banned():
        raise Refused(403, "banned", "this key is banned")

    with pytest.raises(Refused, match="banned"):  # any other refusal is raised at once
        retrying(banned, what="lease", give_up_s=60, log=lambda _: None, base_s=0.0)


def _message_models() -> dict:
    import inspect

    from pydantic import BaseModel

    from swarmrl.protocol import messages

    return {
        name: cls
        for name, cls in vars(messages).items()
        if inspect.isclass(cls) and issubclass(cls, BaseModel) and cls.__module__ == messages.__name__
    }


def test_every_field_of_every_message_is_in_protocol_md():
    doc = (ROOT / "docs/protocol.md").read_text()
    missing = [
        f"{name}.{field}"
        for name, cls in sorted(_message_models().items())
        for field in cls.model_fields
        if f"`{field}`" not in doc and f'"{field}"' not in doc
    ]
    assert not missing, f"docs/protocol.md does not name these message fields: {missing}"


def test_the_messages_shape_is_pinned_to_the_protocol_version(monkeypatch):
    from pydantic import BaseModel

    from swarmrl.protocol import SCHEMA_DIGESTS, messages

    assert messages.schema_digest() == SCHEMA_DIGESTS[PROTOCOL_VERSION], (
        "a message in protocol/messages.py changed shape: if an existing worker would misread it, bump "
        "PROTOCOL_VERSION and enter the new digest under it in protocol.SCHEMA_DIGESTS; if it is compatible "
        "(a reply grew a field), enter it as this version's digest and say why in the commit"
    )
    # The digest sees a field's type and bounds, and not its prose.
    pinned = messages.schema_digest()
    monkeypatch.setattr(messages.SampleIn.model_fields["finish_reason"], "description", "other words", raising=False)
    assert messages.schema_digest() == pinned

    class Extra(BaseModel):
        slot: int

    Extra.__module__ = messages.__name__
    monkeypatch.setattr(messages, "Extra", Extra, raising=False)
    assert messages.schema_digest() != pinned
