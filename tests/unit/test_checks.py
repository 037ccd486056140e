"""The validator's pure checks, with hand-computed values."""

from __future__ import annotations

import math
import sqlite3

import pytest
import torch

from swarmrl.config import ValidatorConfig
from swarmrl.inference.seeded import gumbel_noise, seeded_choice
from swarmrl.orchestrator.store import Store
from swarmrl.protocol.reasons import FRAUD_REASONS
from swarmrl.protocol.rules import termination_problem
from swarmrl.validator.checks import sampling_margins, token_logprobs
from swarmrl.validator.core import bf16_limits_warning

STOP = [0]


def test_termination_rules():
    assert termination_problem([5, 6, 0], "stop", STOP, 8) is None
    assert termination_problem([5, 6, 7], "length", STOP, 3) is None  # ran to the limit
    assert termination_problem([5, 6, 0], "stop", STOP, 3) is None  # stop exactly at the limit
    assert "1 tokens follow the stop token" in termination_problem([5, 0, 6], "stop", STOP, 8)
    assert "runs to the limit (8)" in termination_problem([5, 6], "length", STOP, 8)  # cut short, no stop
    assert "finish_reason is 'length'" in termination_problem([5, 0], "length", STOP, 8)
    assert "finish_reason is 'stop'" in termination_problem([5, 6, 7], "stop", STOP, 3)


def test_sampling_margin_is_zero_for_the_seeded_choice_and_positive_otherwise():
    torch.manual_seed(0)
    logits = torch.randn(6, 11) * 3
    seeds = torch.full((6,), 1234, dtype=torch.int64)
    steps = torch.arange(6, dtype=torch.int64)
    temp = torch.full((6, 1), 0.7)
    chosen = seeded_choice(logits, seeds, steps, 0.7)
    assert torch.all(sampling_margins(logits, chosen, seeds, steps, temp) == 0)
    other = (chosen + 1) % 11
    gaps = sampling_margins(logits, other, seeds, steps, temp)
    # By hand: the gap is the best score minus the other token's score.
    scores = logits / 0.7 + gumbel_noise(seeds, steps, 11)
    expected = scores.max(-1).values - scores.gather(-1, other[:, None])[:, 0]
    assert torch.allclose(gaps, expected) and torch.all(gaps > 0)
    # Another seed picks other tokens somewhere: that is what catches cherry-picking.
    assert torch.any(sampling_margins(logits, chosen, seeds + 1, steps, temp) > 0)


def test_greedy_rows_use_plain_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    one = torch.ones(1, dtype=torch.int64)
    assert sampling_margins(logits, torch.tensor([2]), one, one - 1, torch.zeros(1, 1)).item() == 1.0
    assert sampling_margins(logits, torch.tensor([1]), one, one - 1, torch.zeros(1, 1)).item() == 0.0


def test_token_logprobs_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0)], [2.0, 2.0]])
    # T = 1: p = [1/4, 3/4]; T = 2 on equal logits: 1/2.
    lp = token_logprobs(logits, torch.tensor([1, 0]), torch.tensor([[1.0], [2.0]]))
    assert torch.allclose(lp, torch.tensor([math.log(0.75), math.log(0.5)]))


def test_reasons_an_honest_worker_can_get_never_count_as_fraud():
    # foreign_lease too: a lease id can be fed to an honest worker (docs/security.md).
    for honest in ("duplicate", "in_progress", "slot_closed", "stale", "lease_expired", "foreign_lease"):
        assert honest not in FRAUD_REASONS
    for cheat in ("toploc", "sampling", "logprobs", "claimed_reward", "proofs_malformed"):
        assert cheat in FRAUD_REASONS


def test_a_run_directory_from_before_validation_opens_and_gains_the_new_columns(tmp_path):
    db = sqlite3.connect(tmp_path / "orchestrator.sqlite")
    db.executescript("""
        CREATE TABLE workers (key TEXT PRIMARY KEY, name TEXT NOT NULL, registered REAL NOT NULL,
            last_seen REAL NOT NULL, accepted INTEGER NOT NULL DEFAULT 0, rejected INTEGER NOT NULL DEFAULT 0,
            banned INTEGER NOT NULL DEFAULT 0);
        CREATE TABLE groups (id INTEGER PRIMARY KEY AUTOINCREMENT, lease_id TEXT NOT NULL, slot INTEGER NOT NULL,
            worker TEXT NOT NULL, policy_version INTEGER NOT NULL, accepted REAL NOT NULL, payload TEXT NOT NULL,
            informative INTEGER NOT NULL, state TEXT NOT NULL, step INTEGER, resolved_step INTEGER,
            UNIQUE (lease_id, slot));
        INSERT INTO workers (key, name, registered, last_seen) VALUES ('k', 'old', 0, 0);
        INSERT INTO groups (lease_id, slot, worker, policy_version, accepted, payload, informative, state)
            VALUES ('l', 0, 'k', 0, 0, '{}', 1, 'queued');
    """)
    db.close()
    store = Store(tmp_path / "orchestrator.sqlite")
    try:
        assert store.worker("k")["fraud"] == 0
        row = store.query("SELECT state, proofs, verdict FROM groups")[0]
        assert (row["state"], row["proofs"], row["verdict"]) == ("queued", None, None)
    finally:
        store.close()


def test_a_read_only_store_reads_beside_its_owner_and_changes_nothing(tmp_path):
    owner = Store(tmp_path / "orchestrator.sqlite")
    try:
        owner.register("k", "w")
        with owner.tx() as db:
            owner.set_meta(db, "step", 3)
        reader = Store.read_only(tmp_path / "orchestrator.sqlite")
        try:
            with reader.read() as db:
                assert reader.worker_count(db) == 1 and reader.get_meta(db, "step") == 3
            with pytest.raises(sqlite3.OperationalError, match="readonly"):
                reader.register("k2", "x")
        finally:
            reader.close()
    finally:
        owner.close()
    with pytest.raises(FileNotFoundError, match="has the orchestrator of this run started"):
        Store.read_only(tmp_path / "nothing.sqlite")


def test_large_vocabularies_hash_only_the_contenders_and_agree_with_the_dense_computation():
    torch.manual_seed(1)
    n, vocab = 5, 50_000
    logits = torch.randn(n, vocab) - 60.0
    logits[:, :4] = torch.tensor([5.0, 4.0, 0.5, -3.0])  # a real model: a few tokens carry the mass
    seeds = torch.arange(n, dtype=torch.int64) * 7919
    steps = torch.arange(n, dtype=torch.int64)
    temp = torch.full((n, 1), 1.0)
    tokens = torch.tensor([0, 1, 2, 3, 0])
    sparse = sampling_margins(logits, tokens, seeds, steps, temp)
    scores = logits + gumbel_noise(seeds, steps, vocab)
    dense = scores.max(-1).values - scores.gather(-1, tokens[:, None])[:, 0]
    assert torch.allclose(sparse, dense, atol=1e-5) and torch.all(sparse >= 0)
    assert torch.equal(seeded_choice(logits, seeds, steps, 1.0) == tokens, sparse == 0)


def test_a_bf16_policy_deeper_than_the_calibrated_model_is_flagged_until_its_limit_is_set():
    cfg = ValidatorConfig()
    assert bf16_limits_warning(4, cfg) is None  # the built-in model the limits came from
    said = bf16_limits_warning(30, cfg)
    assert said is not None and "30 layers" in said and "swarmrl calibrate" in said
    assert bf16_limits_warning(30, ValidatorConfig(bf16_group_mant_err_max=2.5)) is None  # measured and set
