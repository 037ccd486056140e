"""Random ragged GRPO groups on a real tiny Qwen2, for the packing tests and their FSDP2 run."""

from __future__ import annotations

import torch

from swarmrl.config import load_config
from swarmrl.protocol.rollouts import Group, Sample
from swarmrl.trainer.batch import build_train_batch

from tiny_trainer import synthetic_group

# 16 sequences, 2 optimizer steps of 8, 4 per rank. With a 48-token budget rank 0's first share
# (prompt 6 + completions 38, 38, 38, 4) needs 4 packs and rank 1's (6 + 4, 3, 5, 2) needs 1, so
# rank 1 must run 3 zero-loss passes to keep FSDP2's collectives paired.
FSDP_COMPLETIONS = [[38, 38, 38, 4], [4, 3, 5, 2], [20, 2, 30, 3], [1, 40, 3, 36]]
FSDP_BUDGET = 48


def random_groups(
    model,
    *,
    prompts: int,
    group_size: int,
    prompt_lens: tuple[int, int],
    completion_lens: tuple[int, int] | list[list[int]],
    seed: int = 0,
    temperature: float = 1.0,
    noise: float = 0.3,
) -> list[Group]:
    """Groups of random tokens with varied lengths; inference logprobs are the model's own,
    each perturbed by N(0, noise), so ratios move off 1 and clipping and TIS have work to do.
    `completion_lens`: a (lo, hi) range, or explicit lengths per group."""
    gen = torch.Generator().manual_seed(seed)
    model.eval()
    groups = []
    for gi in range(prompts):
        p_len = int(torch.randint(prompt_lens[0], prompt_lens[1] + 1, (), generator=gen))
        prompt = torch.randint(5, 261, (p_len,), generator=gen).tolist()  # ids 0-4 are special
        samples = []
        for si in range(group_size):
            if isinstance(completion_lens, tuple):
                c_len = int(torch.randint(completion_lens[0], completion_lens[1] + 1, (), generator=gen))
            else:
                c_len = completion_lens[gi][si]
            completion = torch.randint(5, 261, (c_len,), generator=gen).tolist()
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + completion])).logits[0] / temperature  # [L, V]
            logp = logits.log_softmax(-1)
            lps = [
                float(logp[p_len + j - 1, tok]) + float(torch.randn((), generator=gen)) * noise
                for j, tok in enumerate(completion)
            ]
            samples.append(Sample(token_ids=completion, logprobs=lps, finish_reason="stop", seed=si))
        rewards = [float(r) for r in torch.randint(0, 2, (group_size,), generator=gen)]
        rewards[0], rewards[1] = 1.0, 0.0  # every group informative
        groups.append(synthetic_group(gi, prompt, samples, rewards, temperature, policy_version=0))
    model.train()
    return groups


def make_cfg(*overrides: str):
    return load_config(
        None,
        [
            "--sampling.prompts_per_step",
            "4",
            "--sampling.group_size",
            "4",
            "--sampling.max_new_tokens",
            "40",
            "--trainer.micro_batch_size",
            "3",
            "--trainer.warmup_steps",
            "0",
            "--trainer.schedule",
            "constant",
            "--trainer.lr",
            "1e-3",
            *overrides,
        ],
    )


def make_batch(groups, cfg):
    return build_train_batch(
        groups, pad_token_id=0, normalize_std=cfg.algorithm.normalize_std, adv_eps=cfg.algorithm.adv_eps
    )
