"""Scripted malicious workers, for testing the validator and for the adversarial demo.

`swarmrl worker --adversary KIND` (and `async.adversaries` in `swarmrl rl`) runs a worker that
cheats in one specific way. Each cheat is as careful as it can be about everything else: where a
cheat changes tokens it rebuilds proofs and logprobs honestly for what it submits, so the check
that catches it is the one aimed at that cheat, not an accident. Never point one at a run you
care about; the orchestrator will ban its key.
"""

from __future__ import annotations

import copy
import secrets

import torch

from swarmrl.config import ADVERSARY_KINDS as KINDS
from swarmrl.inference.worker import Worker
from swarmrl.proofs.toploc import PRIME, build_proofs_many, decode, encode, to_bytes
from swarmrl.protocol.manifest import manifest_digest
from swarmrl.protocol.messages import Lease
from swarmrl.validator.checks import token_logprobs


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
        self.previous: dict | None = None  # replay: the last submission

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
        elif self.kind == "other_model" and fresh:
            model = copy.deepcopy(self.sampler.model)
            torch.manual_seed(12345)
            for module in model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
            self.sampler.model = model.eval()
        return True

    def generate(self, lease: Lease | dict) -> dict:
        lease = Lease.model_validate(lease)
        if self.kind == "cherry_pick":
            return self._cherry_pick(lease)
        if self.kind == "replay" and self.previous is not None:
            # Old completions under the new prompts, with proofs and logprobs made for them.
            sub = {"lease_id": lease.lease_id, "groups": []}
            for p, g in zip(lease.prompts, self.previous["groups"]):
                sub["groups"].append({**g, "slot": p.slot, "policy_version": self.version})
            self._rebuild(lease, sub)
            return sub
        sub = super().generate(lease)
        if self.kind == "replay":
            self.previous = sub
        elif self.kind == "edit_tokens":
            self._edit_tokens(lease, sub)
        for g in sub["groups"]:
            if self.kind == "wrong_group_size":
                g["samples"] = g["samples"][:-1]
            for s in g["samples"]:
                if self.kind == "edit_logprobs":
                    s["logprobs"] = [lp * 0.5 for lp in s["logprobs"]]
                elif self.kind == "claim_reward":
                    s["reward"] = 1.0
                elif self.kind == "garbage_proofs":
                    s["proofs"] = encode([_garbage(len(b)) for b in decode(s["proofs"])])
                elif self.kind == "truncated_proofs":
                    s["proofs"] = encode([b[: len(b) // 2] for b in decode(s["proofs"])])
                elif self.kind == "missing_proofs":
                    s["proofs"] = []
        return sub

    def _edit_tokens(self, lease: Lease, sub: dict) -> None:
        """Change the middle token of each completion to another non-stop token, then make the
        proofs and logprobs those of the edited text (what a careful cheater would do)."""
        stop = set(self.sampler.stop_token_ids)
        vocab = self.sampler.model.config.vocab_size
        for g in sub["groups"]:
            for s in g["samples"]:
                ids = list(s["token_ids"])
                if len(ids) < 2:
                    continue
                t = (len(ids) - 1) // 2
                new = (ids[t] + 1) % vocab
                while new in stop:
                    new = (new + 1) % vocab
                ids[t] = new
                s["token_ids"] = ids
        self._rebuild(lease, sub)

    def _rebuild(self, lease: Lease, sub: dict) -> None:
        """Honest proofs and logprobs for whatever tokens the submission now holds."""
        for p, g in zip(lease.prompts, sub["groups"]):
            outs = _prefill(self.sampler.model, p.prompt_ids, [s["token_ids"] for s in g["samples"]])
            proofs = build_proofs_many([h for h, _ in outs], chunk_size=lease.proof.chunk_size, topk=lease.proof.topk)
            for s, (_, logits), pr in zip(g["samples"], outs, proofs):
                tokens = torch.tensor(s["token_ids"])
                s["logprobs"] = token_logprobs(logits, tokens, torch.full((len(tokens), 1), lease.temperature)).tolist()
                s["proofs"] = encode(pr)

    def _cherry_pick(self, lease: Lease, n: int = 4) -> dict:
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
                {
                    "slot": p.slot,
                    "policy_version": self.version,
                    "samples": [
                        {
                            "token_ids": o.token_ids,
                            "logprobs": o.logprobs,
                            "finish_reason": o.finish_reason,
                            "proofs": encode(pr),
                        }
                        for o, pr in zip(picked, proofs)
                    ],
                }
            )
        return {"lease_id": lease.lease_id, "groups": groups}


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
