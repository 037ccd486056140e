"""Why a submitted group is refused, and which refusals say the worker cheated.

Every refusal a worker can receive for a group (in the submission's reply, or later from the
validator, visible in POST /v1/workers/me) has a reason code from this table. Fraud reasons are
the ones an honest worker running swarmrl cannot get, whatever its network or speed: they count
towards a ban (`validator.ban_after`). The others happen to slow or restarted honest workers
and never count.
"""

# code: (fraud?, what it means)
REASONS: dict[str, tuple[bool, str]] = {
    # Honest workers get these: late, repeated or racing submissions.
    "duplicate": (False, "the slot was already submitted (a resend after a lost reply gets the stored result)"),
    "in_progress": (False, "the slot is being scored from another request right now"),
    "slot_closed": (False, "the slot was closed (refused earlier, or its lease expired)"),
    "stale": (False, "the group's policy version fell outside the async bound before it arrived"),
    "lease_expired": (False, "the lease expired before the submission; its problems went to other workers"),
    # Proves nothing about the key (a lease id can be fed to an honest worker); never counted.
    "foreign_lease": (False, "the submission uses another worker's lease"),
    # A run with a limits file accepts proofs only from the engines its calibration measured.
    "engine_refused": (False, "the group declares an engine this run's calibration does not accept"),
    # An episode the grading lane could not replay: the environment raised on the worker's text, or
    # ran past its per-call timeout (an environment's bug as often as a worker's doing: not fraud,
    # but refused, counted for the key, and its problem goes to another lease), or an unproven
    # key's grading seconds ran out before the replay finished.
    "environment_error": (False, "the environment failed on an episode's turns (raised, or ran out of its time)"),
    "not_graded": (False, "the key's grading seconds ran out before the episode could be replayed"),
    # Cheap checks at submission: an honest sampler never produces these.
    "bad_slot": (True, "the group names a slot its lease does not have"),
    "version_not_in_lease": (True, "the group claims a policy version outside the lease's [min_version, max_version]"),
    "group_size": (True, "the group does not have the lease's group_size completions"),
    "length": (True, "a completion is empty or longer than the lease's max_new_tokens"),
    "logprobs_length": (True, "a completion's logprobs do not match its tokens one to one"),
    "token_out_of_range": (True, "a token id is not in the model's vocabulary"),
    "bad_logprob": (True, "a logprob is outside [-1e4, 0]"),
    "termination": (True, "a completion does not end the way the sampler ends one (protocol.rules)"),
    "claimed_reward": (True, "the worker sent a reward: rewards are computed by the orchestrator only"),
    "proofs_missing": (True, "a completion has no TOPLOC proofs"),
    "proofs_malformed": (True, "a completion's proofs have the wrong number, size or encoding"),
    # Multi-turn episodes, replayed by the orchestrator (swarmrl/envs/episode.py `replay`).
    "malformed_episode": (True, "an episode's model_mask is missing, misplaced or does not match its tokens"),
    "observation_mismatch": (True, "an observation is not what the environment returns for the turns before it"),
    "stopped_early": (True, "the episode stops before the environment or the budget ended it"),
    "continued_after_end": (True, "the episode goes on after the environment or the budget ended it"),
    "turn_not_stopped": (True, "a model turn is cut before its stop token, or goes on after one"),
    "over_budget": (True, "the episode is longer than the lease's max_new_tokens"),
    # The validator's re-run of the prefill.
    "toploc": (True, "the proofs do not match the hidden states of the claimed policy"),
    "sampling": (True, "a token is not the seeded Gumbel-max choice for its seed under the claimed policy"),
    "logprobs": (True, "the reported logprobs are not the claimed policy's"),
    # The sequential test over all of a key's groups (proofs/evidence.py).
    "evidence": (True, "the key's groups together are further from honest work than rounding explains: banned"),
}

FRAUD_REASONS = frozenset(code for code, (fraud, _) in REASONS.items() if fraud)
