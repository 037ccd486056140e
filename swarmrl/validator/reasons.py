"""Rejection reasons, sorted by what they say about a worker (no heavy imports: the launcher uses it)."""

# Rejections that an honest worker running swarmrl cannot get, whatever its network or speed:
# they count towards a ban. Not in the list (and never counted as fraud): duplicate,
# in_progress, slot_closed, stale, lease_expired; a slow or restarted honest worker gets those.
FRAUD_REASONS = frozenset({
    "bad_slot", "version_not_in_lease", "group_size", "length", "logprobs_length", "token_out_of_range",
    "bad_logprob", "termination", "claimed_reward", "proofs_missing", "proofs_malformed", "foreign_lease",
    "toploc", "sampling", "logprobs",
})
