"""The GRPO update: one rollout step = old logprobs once, then several optimizer steps.

The trainer is algorithm-blind beyond calling `grpo_loss`: advantages arrive with the batch.
It runs as one process, or under torchrun with FSDP2 (`fully_shard`) when the world size is > 1:
every rank holds the whole batch, trains on its 1/world share of each mini-batch, and the loss
normaliser is the whole mini-batch's, so sharded and single-process runs compute the same update.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from swarmrl.algorithm.loss import LossInputs, grpo_loss, loss_normalizer, token_entropy, token_logprobs
from swarmrl.algorithm.offpolicy import behaviour_weights
from swarmrl.config import Config
from swarmrl.trainer.batch import TrainBatch


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistInfo:
    """Join the torchrun process group if launched by torchrun (gloo on CPU, nccl on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and os.environ.get("SWARMRL_BACKEND") != "gloo" else "gloo"
        dist.init_process_group(backend)
    return DistInfo(dist.get_rank(), dist.get_world_size())


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2: shard each decoder layer, then the root (embeddings, norm, head)."""
    from torch.distributed.fsdp import fully_shard

    units = [fully_shard(layer) for layer in model.base_model.layers] + [fully_shard(model)]
    for unit in units:
        # Each rank's loss is already divided by the whole mini-batch's normaliser, so rank
        # gradients must be summed; FSDP2's default averages them (1/world the true gradient,
        # which grad clipping and the grad_norm metric would see). Plain SUM: gloo has no PREMUL_SUM.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return model


def lr_lambda(cfg: Config):
    t = cfg.trainer
    total = max(1, t.steps * t.optimizer_steps)

    def f(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - t.warmup_steps) / max(1, total - t.warmup_steps))
        return 0.5 * (1 + math.cos(math.pi * progress)) if t.schedule == "cosine" else 1.0 - progress

    return f


class GRPOTrainer:
    def __init__(self, model: torch.nn.Module, cfg: Config, dist_info: DistInfo | None = None):
        self.cfg = cfg
        self.dist = dist_info or DistInfo()
        self.device = next(model.parameters()).device
        self.reference = None
        if cfg.algorithm.kl_coef > 0:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.model = shard_model(model) if self.dist.world_size > 1 else model
        t = cfg.trainer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=t.betas,
                                           weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))

    # ---- forward passes --------------------------------------------------------------------
    def _logits(self, model, mb: TrainBatch) -> torch.Tensor:
        out = model(input_ids=mb.input_ids.to(self.device), attention_mask=mb.attention_mask.to(self.device))
        return out.logits[:, :-1].float()  # [n, L-1, V]: position t predicts token t+1

    @torch.no_grad()
    def _logprobs(self, model, batch: TrainBatch) -> torch.Tensor:
        """No-grad logprobs of every batch position under `model` [N, L-1]."""
        out = torch.zeros_like(batch.inference_logprobs)
        mbs = self.cfg.trainer.micro_batch_size
        for i in range(0, len(batch), mbs):
            mb = batch.slice(slice(i, i + mbs)).trimmed()
            lp = token_logprobs(self._logits(model, mb), mb.input_ids[:, 1:].to(self.device),
                                self.cfg.sampling.temperature)
            out[i : i + len(mb), : lp.shape[1]] = lp.cpu()
        return out

    def _my_share(self, n: int) -> slice:
        if n % self.dist.world_size:
            raise ValueError(f"a mini-batch of {n} sequences does not split over {self.dist.world_size} ranks: "
                             "make sampling.prompts_per_step x sampling.group_size / trainer.optimizer_steps "
                             "a multiple of the world size")
        per = n // self.dist.world_size
        return slice(self.dist.rank * per, (self.dist.rank + 1) * per)

    # ---- one rollout step ------------------------------------------------------------------
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        cfg, alg = self.cfg, self.cfg.algorithm
        self.model.train()
        metrics: dict[str, float] = {}
        inf_lp = batch.inference_logprobs
        mask = batch.loss_mask
        if alg.old_logprobs == "recompute":
            # Every rank computes the full batch's old logprobs: cheap next to the update, and
            # it keeps ranks free of another collective.
            old_lp = self._logprobs(self.model, batch)  # [N, L-1]
            gap = (old_lp - inf_lp).abs()[mask]
            metrics["off_policy/logprob_abs_diff"] = float(gap.mean()) if gap.numel() else 0.0
            metrics["off_policy/logprob_abs_diff_max"] = float(gap.max()) if gap.numel() else 0.0
        else:
            old_lp = inf_lp
        tis = None
        if alg.tis_cap != "off":  # the config turns it off with old_logprobs = "inference"
            # Decoupled PPO: the clip anchors on the proximal (recomputed) policy, and each token
            # is re-weighted from the stale policy that sampled it to that proximal one.
            tis, is_metrics = behaviour_weights(old_lp, inf_lp, mask, cap=alg.tis_cap, level=alg.tis_level,
                                                mask_band=alg.tis_mask_band)  # [N, L-1]
            metrics.update(is_metrics)
        ref_lp = self._logprobs(self.reference, batch) if self.reference is not None else None

        n_opt = cfg.trainer.optimizer_steps
        per_opt = len(batch) // n_opt
        sums: dict[str, float] = {}
        for k in range(n_opt):
            lo = k * per_opt
            mini = slice(lo, lo + per_opt)
            mini_mask = mask[mini]
            normalizer = loss_normalizer(alg.normalization, num_tokens=int(mini_mask.sum()),
                                         num_sequences=per_opt, max_tokens=cfg.sampling.max_new_tokens)
            share = self._my_share(per_opt)
            idx = torch.arange(lo, lo + per_opt)[share]
            self.optimizer.zero_grad(set_to_none=True)
            step_metrics: dict[str, float] = {}
            mbs = cfg.trainer.micro_batch_size
            for j in range(0, len(idx), mbs):
                rows = idx[j : j + mbs]
                mb = batch.slice(rows).trimmed()
                width = mb.loss_mask.shape[1]
                logits = self._logits(self.model, mb)  # [n, w, V]
                targets = mb.input_ids[:, 1:].to(self.device)
                lp = token_logprobs(logits, targets, cfg.sampling.temperature)  # [n, w]
                want_entropy = alg.entropy_coef > 0
                ent = token_entropy(logits, cfg.sampling.temperature) if want_entropy else None
                inputs = LossInputs(
                    logprobs=lp,
                    old_logprobs=old_lp[rows, :width].to(self.device),
                    advantages=mb.advantages.to(self.device),
                    loss_mask=mb.loss_mask.to(self.device),
                    importance_weights=None if tis is None else tis[rows, :width].to(self.device),
                    entropy=ent,
                    ref_logprobs=None if ref_lp is None else ref_lp[rows, :width].to(self.device),
                )
                loss, m = grpo_loss(inputs, normalizer=normalizer, delta=alg.delta, eps_low=alg.eps_low,
                                    eps_high=alg.eps_high, entropy_coef=alg.entropy_coef, kl_coef=alg.kl_coef)
                loss.backward()
                if want_entropy:
                    m["entropy/mean"] = m["loss/entropy"]  # same masked mean; one key either way
                else:
                    with torch.no_grad():
                        e = token_entropy(logits.detach(), cfg.sampling.temperature)
                        m["entropy/mean"] = float(e[mb.loss_mask.to(self.device)].mean()) if mb.loss_mask.any() else 0.0
                weight = float(mb.loss_mask.sum())
                for key, v in m.items():
                    step_metrics[key] = step_metrics.get(key, 0.0) + v * weight
                step_metrics["_w"] = step_metrics.get("_w", 0.0) + weight
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.trainer.grad_clip)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            self.optimizer.step()
            self.scheduler.step()
            if self.dist.world_size > 1:
                # Each rank saw only its share: sum the token-weighted metrics so rank 0 logs
                # the whole mini-batch's (same keys, same order on every rank).
                keys = list(step_metrics)
                t = torch.tensor([step_metrics[k] for k in keys], dtype=torch.float64, device=self.device)
                dist.all_reduce(t)
                step_metrics = dict(zip(keys, t.tolist()))
            w = max(step_metrics.pop("_w", 0.0), 1.0)
            for key, v in step_metrics.items():
                if key != "tokens":
                    sums[key] = sums.get(key, 0.0) + v / w / n_opt
            sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(grad_norm) / n_opt
        metrics.update(sums)
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        metrics["train/tokens"] = float(mask.sum())
        return metrics

    # ---- weights out -----------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full, unsharded weights on CPU (on rank 0 only when distributed)."""
        if self.dist.world_size == 1:
            return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if self.dist.is_main else None
