"""What every config section shares, and names a config must know without importing the roles."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# The scripted cheats `swarmrl worker --adversary` and `async.adversaries` can run (implemented in
# swarmrl/adversary/workers.py; named here so that validating a config imports nothing above it).
ADVERSARY_KINDS = {
    "other_model": "samples with another model of the same architecture (re-initialised weights)",
    "old_version": "keeps sampling with the first policy version it loaded, claiming each newer one",
    "int8_weights": "samples with each version's weights quantised to int8 (a scale per 32 inputs), claiming it",
    "int4_weights": "samples with each version's weights quantised to int4 (a scale per 32 inputs), claiming it",
    "int8_declaring_vllm": "int8_weights, declaring the vLLM engine on its groups (to be judged by vLLM's limits)",
    "edit_tokens": "changes one token of every completion; proofs and logprobs rebuilt for the edit",
    "edit_logprobs": "reports every logprob as more confident than it was",
    "cherry_pick": "best of 4 samples with its own seeds (by total logprob), proofs and logprobs honest",
    "claim_reward": "attaches a reward of 1.0 to every completion",
    "replay": "answers each lease with the completions (and proofs) of its previous lease",
    "garbage_proofs": "sends well-formed proofs of random polynomials",
    "truncated_proofs": "sends its proofs cut short",
    "missing_proofs": "sends no proofs",
    "wrong_group_size": "drops one completion from every group",
    # Multi-turn episodes (runs whose tasks name an environment); on single-turn tasks they are honest.
    "edit_observation": "changes one token of the first observation of every episode (a forged tool answer)",
    "truncate_episode": "drops every episode's last observation and the turn that answered it",
    "self_observation": "lets the model write the observations too: each episode submitted as one model turn, "
    "proofs and logprobs rebuilt for it",
    "reuse_turn_seed": "samples every turn of an episode with the lease's seed instead of each turn's own",
}


class Section(BaseModel):
    """What every config section shares: unknown keys are errors, each field's docstring is its
    documentation, and an assignment is validated like a loaded value."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
