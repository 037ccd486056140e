"""Scripted malicious workers, for testing the validator and for the adversarial demo.

`swarmrl worker --adversary KIND` (and `async.adversaries` in `swarmrl rl`) runs a worker that
cheats in one specific way. Each cheat is as careful as it can be about everything else: where a
cheat changes tokens it rebuilds proofs and logprobs honestly for what it submits, so the check
that catches it is the one aimed at that cheat, not an accident. Never point one at a run you
care about; the orchestrator will ban its key.

Every cheat runs on the built-in engine and on the proving vLLM engine (`--engine vllm`): there,
cheats on the weights (other_model, int8/int4_weights) load altered weights into vLLM in place,
old_version stops loading, best-of-n samples through vLLM with seeds of its own, and the careful
rebuilds (edit_tokens, replay) prefill the claimed version with the project's own model code,
the strongest prefill a cheat has (the validator's).
"""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

import torch

from swarmrl.config import ADVERSARY_KINDS as KINDS
from swarmrl.envs.episode import runs
from swarmrl.inference.worker import Worker
from swarmrl.model.altered import quantised, reinitialised
from swarmrl.model.checkpoint import load_policy, save_policy
from swarmrl.proofs.toploc import PRIME, build_proofs_many, decode, encode, to_bytes
from swarmrl.protocol.manifest import manifest_digest
from swarmrl.protocol.messages import GroupIn, Lease, SampleIn, SubmitIn
from swarmrl.validator.checks import token_logprobs

# sample with altered weights
WEIGHT_CHEATS = ("other_model", "int8_weights", "int4_weights", "int8_declaring_vllm")
EPISODE_CHEATS = ("edit_observation", "truncate_episode", "self_observation")  # edit finished episodes


def _altered(kind: str, model):
    if kind == "other_model":
        return reinitialised(model)
    return quantised(model, 4 if kind == "int4_weights" else 8)


def _prefill(model, prompt: list[int], completions: list[list[int]]):
    """Hidden states and logits of completions under `model` (the validator's own prefill)."""
    from swarmrl.validator.core import prefill

    return prefill(model, [(prompt, completions)])[0]


class AdversarialWorker(Worker):
    def __init__(self, *args, kind: str, **kwargs):
        if kind not in KINDS:
            raise ValueError(f"unknown adversary {kind!r}; one of: {', '.join(KINDS)}")
        super().__init__(*args, **kwargs)
        self.kind, self.kind_help = kind, KINDS[kind]
        self.frozen = None  # old_version: the sampler it keeps
        self.previous: SubmitIn | None = None  # replay: the last submission
        self.folder: Path | None = None  # vLLM: the claimed version's folder (for _rebuild's prefill)
        self._prefill_model: tuple[Path, str, object] | None = None

    def _ensure_policy(self, policy: dict) -> bool:
        if self.kind == "old_version" and self.frozen is not None:
            # Claim whatever is current, keep sampling with the old weights.
            self.version, self.digest = policy["version"], manifest_digest(policy["manifest"])
            self.sampler = self.frozen
            return True
        fresh = (policy["version"], manifest_digest(policy["manifest"])) != (self.version, self.digest)
        if not super()._ensure_policy(policy):
            return False
        if self.kind == "old_version":
            self.frozen = self.sampler
        elif self.kind in WEIGHT_CHEATS and fresh and self.session.in_process_model:
            self.sampler.model = _altered(self.kind, self.sampler.model)
        return True

    def _declared(self, lease: Lease) -> dict:
        # int8_declaring_vllm: whatever it runs, it claims vLLM (whose bf16 limit was once looser).
        return {"engine": "vllm"} if self.kind == "int8_declaring_vllm" else super()._declared(lease)

    def _load(self, folder: Path, base: Path | None, version: int):
        """An engine that loads folders (vLLM): the weight cheats write the altered version beside
        the real one and load that."""
        self.folder = folder
        if self.kind in WEIGHT_CHEATS and not self.session.in_process_model:
            model, tok = load_policy(folder, dtype=getattr(torch, self.dtype), base=base)
            folder = save_policy(_altered(self.kind, model), tok, self.cache / "altered" / folder.name)
            base = None
            for old in sorted(folder.parent.iterdir())[:-2]:  # a full model per version: keep two
                shutil.rmtree(old, ignore_errors=True)
        return super()._load(folder, base, version)

    def _policy_model(self):
        """The claimed version's model, for a careful cheat's own prefill: the sampler's on the
        built-in engine, loaded from the version's folder for vLLM (which has no prefill to offer)."""
        if self.sampler.model is not None:
            return self.sampler.model
        key = (self.folder, self.dtype)
        if self._prefill_model is None or self._prefill_model[:2] != key:
            model, _ = load_policy(self.folder, dtype=getattr(torch, self.dtype))
            self._prefill_model = (*key, model.eval())
        return self._prefill_model[2]

    def submission(self, lease: Lease | dict) -> SubmitIn:
        """The honest submission, then this kind's cheat on it. The messages are changed by
        assignment, which pydantic does not check: what a cheat sets is what is sent."""
        lease = Lease.model_validate(lease)
        if self.kind == "cherry_pick":
            return self._cherry_pick(lease)
        if self.kind == "replay" and self.previous is not None:
            # Old completions under the new prompts, with proofs and logprobs made for them.
            groups = [
                g.model_copy(update={"slot": p.slot, "policy_version": self.version})
                for p, g in zip(lease.prompts, self.previous.groups)
            ]
            sub = SubmitIn.model_construct(lease_id=lease.lease_id, groups=groups)
            self._rebuild(lease, sub)
            return sub
        sub = super().submission(lease)
        if self.kind == "replay":
            self.previous = sub
        elif self.kind == "edit_tokens":
            self._edit_tokens(lease, sub)
        elif self.kind in EPISODE_CHEATS:
            self._cheat_episodes(lease, sub)
        for g in sub.groups:
            if self.kind == "wrong_group_size":
                g.samples = g.samples[:-1]
            for s in g.samples:
                if self.kind == "edit_logprobs":
                    s.logprobs = [lp * 0.5 for lp in s.logprobs]
                elif self.kind == "claim_reward":
                    s.reward = 1.0  # an extra field (SampleIn keeps them): the orchestrator refuses it
                elif self.kind == "garbage_proofs":
                    s.proofs = encode([_garbage(len(b)) for b in decode(s.proofs)])
                elif self.kind == "truncated_proofs":
                    s.proofs = encode([b[: len(b) // 2] for b in decode(s.proofs)])
                elif self.kind == "missing_proofs":
                    s.proofs = []
        return sub

    def _turn_seed(self, seed: int, turn: int) -> int:
        return seed if self.kind == "reuse_turn_seed" else super()._turn_seed(seed, turn)

    def _cheat_episodes(self, lease: Lease, sub: SubmitIn) -> None:
        """The multi-turn cheats, on every episode that has an observation to cheat with."""
        stop = set(self.sampler.stop_token_ids)
        for p, g in zip(lease.prompts, sub.groups):
            for s in g.samples:
                mask = s.model_mask
                spans = runs(mask) if mask else []
                if len(spans) < 3:  # one turn: nothing to forge
                    continue
                if self.kind == "edit_observation":
                    a, b, _ = spans[1]
                    ids = list(s.token_ids)
                    j = next((j for j in range(a, b) if ids[j] not in stop), a)
                    new = ids[j] + 1
                    while new in stop:
                        new += 1
                    ids[j] = new
                    s.token_ids = ids
                elif self.kind == "truncate_episode":
                    cut = spans[-2][0]  # the last observation's start
                    s.token_ids, s.logprobs, s.model_mask = s.token_ids[:cut], s.logprobs[:cut], mask[:cut]
                    s.finish_reason = "stop" if s.token_ids[-1] in stop else "length"
                    per = [-(-(b - a) // lease.proof.chunk_size) for a, b, m in spans[:-2] if m]
                    s.proofs = s.proofs[: sum(per)]
                elif self.kind == "self_observation":
                    s.model_mask = [True] * len(s.token_ids)
                    outs = _prefill(self._policy_model(), p.prompt_ids, [s.token_ids])
                    (h, logits), temps = outs[0], torch.full((len(s.token_ids), 1), lease.temperature)
                    s.logprobs = token_logprobs(logits, torch.tensor(s.token_ids), temps).tolist()
                    s.proofs = encode(
                        build_proofs_many([h], chunk_size=lease.proof.chunk_size, topk=lease.proof.topk)[0]
                    )

    def _edit_tokens(self, lease: Lease, sub: SubmitIn) -> None:
        """Change the middle token of each completion to another non-stop token, then make the
        proofs and logprobs those of the edited text (what a careful cheater would do)."""
        stop = set(self.sampler.stop_token_ids)
        vocab = self._policy_model().config.vocab_size
        for g in sub.groups:
            for s in g.samples:
                ids = list(s.token_ids)
                if len(ids) < 2 and getattr(s, "model_mask", None) is None and ids and ids[-1] in stop:
                    # Only the stop token (the model ended at once): nothing in the middle to
                    # change, so the cheat claims a token before it. Left alone, such a group was
                    # an honest one and passed (seen once in CI on the tiny policy through vLLM).
                    ids.insert(0, ids[0])
                elif len(ids) < 2:
                    continue
                t = (len(ids) - 1) // 2
                new = (ids[t] + 1) % vocab
                while new in stop:
                    new = (new + 1) % vocab
                ids[t] = new
                s.token_ids = ids
        self._rebuild(lease, sub)

    def _rebuild(self, lease: Lease, sub: SubmitIn) -> None:
        """Honest proofs and logprobs for whatever tokens the submission now holds."""
        for p, g in zip(lease.prompts, sub.groups):
            outs = _prefill(self._policy_model(), p.prompt_ids, [s.token_ids for s in g.samples])
            proofs = build_proofs_many([h for h, _ in outs], chunk_size=lease.proof.chunk_size, topk=lease.proof.topk)
            for s, (_, logits), pr in zip(g.samples, outs, proofs):
                tokens = torch.tensor(s.token_ids)
                s.logprobs = token_logprobs(logits, tokens, torch.full((len(tokens), 1), lease.temperature)).tolist()
                s.proofs = encode(pr)

    def _cherry_pick(self, lease: Lease, n: int = 4) -> SubmitIn:
        """Sample n candidates per completion with seeds of its own; submit the most likely."""
        g = lease.group_size
        prompts = [p.prompt_ids for p in lease.prompts for _ in range(g * n)]
        seeds = [secrets.randbits(63) for _ in prompts]
        outs = self.sampler.generate(
            prompts, seeds, max_new_tokens=lease.max_new_tokens, temperature=lease.temperature, return_hidden=True
        )
        groups = []
        for i, p in enumerate(lease.prompts):
            picked = []
            for j in range(g):
                cands = outs[(i * g + j) * n : (i * g + j + 1) * n]
                picked.append(max(cands, key=lambda o: sum(o.logprobs)))
            proofs = build_proofs_many(
                [o.hidden for o in picked], chunk_size=lease.proof.chunk_size, topk=lease.proof.topk
            )
            groups.append(
                GroupIn.model_construct(
                    slot=p.slot,
                    policy_version=self.version,
                    **self._declared(lease),
                    samples=[
                        SampleIn.model_construct(
                            token_ids=o.token_ids, logprobs=o.logprobs, finish_reason=o.finish_reason, proofs=encode(pr)
                        )
                        for o, pr in zip(picked, proofs)
                    ],
                )
            )
        return SubmitIn.model_construct(lease_id=lease.lease_id, groups=groups)


def _garbage(size: int) -> bytes:
    """A well-formed proof (valid modulus, coefficients in the field) committing to nothing."""
    rng = secrets.SystemRandom()
    return to_bytes(rng.randrange(2**15, PRIME + 1), [rng.randrange(PRIME) for _ in range((size - 2) // 2)])


def adversary_class(kind: str):
    """A `Worker`-compatible class that cheats as `kind` does (for `run_worker(worker_class=...)`)."""
    if kind not in KINDS:
        raise ValueError(f"unknown adversary {kind!r}; one of: {', '.join(KINDS)}")

    class Adversary(AdversarialWorker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, kind=kind, **kwargs)
            self.log(f"ADVERSARIAL worker ({kind}: {self.kind_help}); for testing the validator")

    return Adversary
