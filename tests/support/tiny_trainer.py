"""A tiny random Qwen2 and a synthetic but real GRPO batch for trainer tests: made-up token ids,
logprobs from an actual forward pass (so inference and recomputed logprobs agree), hand-set
rewards. Shared by tests/unit/test_trainer.py, test_precision_train.py and the FSDP2 runs."""

from __future__ import annotations

import subprocess

import torch

from swarmrl.config import load_config
from swarmrl.model.checkpoint import build_tiny_policy
from swarmrl.protocol.rollouts import Group, Sample
from swarmrl.trainer.batch import TrainBatch, build_train_batch

SHAPE = dict(hidden_size=64, num_layers=2, intermediate_size=128)
# One row per group, one column per sample. Group 1 is deliberately unbalanced (mean 0.25).
REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]]
PROMPT_LENS = [5, 7]
COMPLETION_LENS = [[3, 6, 4, 8], [5, 2, 7, 4]]  # ragged, so padding and trimming are exercised
# 8 sequences, 2 optimizer steps of 4, micro-batches of 2: one process runs 2 micro-batches per
# optimizer step, each of 2 FSDP ranks runs 1 (its half), so accumulation is exercised too.
BASE_OVERRIDES = [
    "--sampling.prompts_per_step",
    "2",
    "--sampling.group_size",
    "4",
    "--sampling.max_new_tokens",
    "16",
    "--trainer.optimizer_steps",
    "2",
    "--trainer.micro_batch_size",
    "2",
    "--trainer.warmup_steps",
    "0",
    "--trainer.lr",
    "1e-3",
    "--trainer.schedule",
    "constant",
]
EXPECTED_KEYS = {
    "loss/policy",
    "grad_norm",
    "lr",
    "clip/low_frac",
    "clip/high_frac",
    "clip/delta_frac",
    "ratio/mean",
    "ratio/max",
    "entropy/mean",
    "train/tokens",
}


def make_cfg(*overrides: str):
    return load_config(None, [*BASE_OVERRIDES, *overrides])


def make_model(seed: int = 0):
    model, tokenizer = build_tiny_policy(seed, **SHAPE)
    return model, tokenizer


@torch.no_grad()
def sequence_token_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> list[float]:
    """Logprob of each completion token, from one unpadded forward (independent of batch.py)."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0].float() / temperature  # [L, V]
    logp = logits.log_softmax(-1)
    p = len(prompt)
    # Completion token j sits at position p + j and is predicted from position p + j - 1.
    return [float(logp[p + j - 1, tok]) for j, tok in enumerate(completion)]


def make_groups(model, seed: int = 1, rewards=REWARDS, temperature: float = 1.0) -> list[Group]:
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    groups = []
    for gi, (p_len, c_lens) in enumerate(zip(PROMPT_LENS, COMPLETION_LENS)):
        prompt = torch.randint(5, 261, (p_len,), generator=gen).tolist()  # ids 0-4 are special
        samples = []
        for si, c_len in enumerate(c_lens):
            completion = torch.randint(5, 261, (c_len,), generator=gen).tolist()
            samples.append(
                Sample(
                    token_ids=completion,
                    logprobs=sequence_token_logprobs(model, prompt, completion, temperature),
                    finish_reason="stop",
                    seed=100 * gi + si,
                )
            )
        groups.append(synthetic_group(gi, prompt, samples, list(rewards[gi]), temperature, policy_version=gi))
    model.train(was_training)
    return groups


def synthetic_group(
    gi: int, prompt: list[int], samples: list[Sample], rewards: list[float], temperature: float, policy_version: int
) -> Group:
    """Group `gi` of a made-up task: the trainer sees only its tokens, logprobs and rewards."""
    return Group(
        problem_id=f"p{gi}",
        task_type="synthetic",
        prompt=f"prompt {gi}",
        verification_info="{}",
        prompt_ids=prompt,
        samples=samples,
        policy_version=policy_version,
        worker="test",
        temperature=temperature,
        rewards=rewards,
        task_rewards=list(rewards),
    )


def make_batch(groups, cfg, tokenizer) -> TrainBatch:
    return build_train_batch(
        groups,
        pad_token_id=tokenizer.pad_token_id,
        normalize_std=cfg.algorithm.normalize_std,
        adv_eps=cfg.algorithm.adv_eps,
    )


def prepare(*overrides: str, seed: int = 0):
    cfg = make_cfg(*overrides)
    model, tokenizer = make_model(seed)
    groups = make_groups(model, temperature=cfg.sampling.temperature)
    return cfg, model, tokenizer, groups, make_batch(groups, cfg, tokenizer)


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def seq_logprobs(model, groups) -> torch.Tensor:
    """Summed completion logprob of every sample, in groups x samples order [N]."""
    model.eval()
    out = [sum(sequence_token_logprobs(model, g.prompt_ids, s.token_ids)) for g in groups for s in g.samples]
    model.train()
    return torch.tensor(out)


def run_checked(cmd: list[str], env: dict) -> None:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
