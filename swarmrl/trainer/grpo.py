"""The GRPO update: one rollout step = old logprobs once, then several optimizer steps.

The trainer is algorithm-blind beyond calling `grpo_loss`: advantages arrive with the batch.
It runs as one process, or under torchrun with FSDP2 (`fully_shard`) when the world size is > 1:
every rank holds the whole batch, trains on its 1/world share of each mini-batch, and the loss
normaliser is the whole mini-batch's, so sharded and single-process runs compute the same update.
`trainer.precision` picks float32, mixed precision (float32 master weights and optimizer state,
bf16 compute: FSDP2's MixedPrecisionPolicy, or `MasterWeights` in one process) or pure bf16;
`trainer.activation_checkpointing` and `trainer.cpu_offload` trade compute for memory.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from swarmrl.algorithm.loss import LossInputs, grpo_loss, loss_normalizer, token_entropy, token_logprobs
from swarmrl.algorithm.offpolicy import behaviour_weights
from swarmrl.config import Config
from swarmrl.model.lora import AdaptersOff, apply_lora
from swarmrl.trainer.batch import TrainBatch
from swarmrl.trainer.packing import Pack, pack_sequences
from swarmrl.trainer.prompts import SharedPrompts, prompt_sets


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # rank within its node: its GPU there

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, configured: str) -> str:
        """This rank's torch device: "cuda" means cuda:<local rank> under torchrun."""
        return f"cuda:{self.local_rank}" if configured == "cuda" and self.world_size > 1 else configured


def init_distributed(device: str | None = None, timeout_s: float | None = None) -> DistInfo:
    """Join the torchrun process group if launched by torchrun: nccl when the trainer runs on
    CUDA (each rank on its node's GPU number LOCAL_RANK), gloo on CPU; SWARMRL_BACKEND=gloo forces
    gloo. `device` None: CUDA if available. `timeout_s` bounds every collective's wait."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and (device is None or device.startswith("cuda"))
    if not dist.is_initialized():
        backend = "nccl" if cuda and os.environ.get("SWARMRL_BACKEND") != "gloo" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local)  # before the group: nccl binds each rank to the current device
        timeout = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        dist.init_process_group(backend, **timeout)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local)


def weights_dtype(cfg: Config) -> torch.dtype:
    """The dtype the optimizer's weights (and checkpoints) are kept in: float32, except under
    pure bf16 (`trainer.precision`); load a model in it, so masters start from the exact weights."""
    return torch.bfloat16 if cfg.trainer.precision == "bf16" else torch.float32


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers: the unit of FSDP2 sharding and of activation checkpointing."""
    if hasattr(model, "get_base_model"):  # a peft model (trainer.lora): the HF model inside it
        model = model.get_base_model()
    return model.base_model.layers


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast floating-point parameters (not buffers) in place. Buffers keep their dtype, as under
    FSDP2's mixed precision: Qwen2's rotary `inv_freq` stays float32 (HF computes the rotary
    angles in float32 from it; a bf16 copy would shift every position's angle)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def checkpoint_layers(model: torch.nn.Module) -> None:
    """Activation checkpointing per decoder layer (`trainer.activation_checkpointing`): a layer
    keeps only its input from the forward and recomputes its intermediates in backward (about one
    more forward of compute; activation memory of one layer's intermediates instead of all).

    One mechanism for one process and FSDP2: torch's non-reentrant `checkpoint_wrapper`, applied
    before `fully_shard` so each sharded unit is the wrapper and the all-gathers stay outside the
    recomputed region (the order torchtitan uses). The wrapper strips its own name from state-dict
    keys (and DCP's helpers from optimizer keys), so checkpoints and published versions keep the
    plain HF names, and it forwards attribute lookups (the sampler reads `layer.self_attn`...).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def _accumulate_into(master: torch.Tensor, param: torch.Tensor) -> None:
    grad = param.grad.to(master.dtype)  # this backward's bf16 gradient, widened before it is summed
    if master.grad is None:
        master.grad = grad
    else:
        master.grad.add_(grad)
    param.grad = None  # the bf16 gradient is not kept past its backward


class MasterWeights:
    """Mixed precision in one process (`trainer.precision = "mixed"`, world size 1).

    The recipe FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` runs under
    torchrun, by hand: the trainer's model holds float32 master weights (the optimizer, its state,
    checkpoints, published versions and held-out evaluation use them); `model` here is a copy of
    it with bf16 parameters that runs every training forward and backward; each backward's bf16
    gradient is widened and accumulated into the masters' float32 `.grad` (over micro-batches
    too, as FSDP2 accumulates its float32 sharded gradients), and `sync` rounds the stepped
    masters back into the copy, as FSDP2's next all-gather does.

    Why not FSDP2 on a one-process group: every single-process trainer, test and tool would need
    a process group, and DTensor weights send held-out evaluation through the HF sampler in bf16
    (the project's decoder reads plain tensors), ~100x slower on CPU. Why not torch.autocast: it
    is another recipe. It casts per op (matmuls in bf16; norms, softmax and the residual stream in
    float32) where FSDP2 casts parameters per module, so everything runs in bf16; the numbers
    would differ between one and several ranks. tests/integration/test_fsdp.py checks one process
    against two FSDP2 ranks.
    """

    def __init__(self, masters: torch.nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.model = cast_parameters(copy.deepcopy(masters), dtype)  # deepcopy keeps tied weights tied
        # Only trainable weights change after the copy (a LoRA run's frozen base never does).
        self._pairs = [
            (low, master) for low, master in zip(self.model.parameters(), masters.parameters()) if master.requires_grad
        ]
        for low, master in self._pairs:
            low.register_post_accumulate_grad_hook(partial(_accumulate_into, master))

    @torch.no_grad()
    def sync(self) -> None:
        """Round the trainable masters into the compute copy (after an optimizer step or a
        checkpoint load)."""
        for low, master in self._pairs:
            low.copy_(master)


def shard_model(
    model: torch.nn.Module, *, param_dtype: torch.dtype | None = None, cpu_offload: bool = False
) -> torch.nn.Module:
    """FSDP2: shard each decoder layer, then the root (embeddings, norm, head).

    `param_dtype` (mixed precision): each unit all-gathers its float32 shards cast to it, so
    forward and backward run in it, and reduce-scatters gradients in float32 into the float32
    shards the optimizer steps: float32 master weights, optimizer state and gradient reduction.
    `cpu_offload`: the shards, their gradients and the optimizer state live in CPU memory and the
    optimizer step runs there (`CPUOffloadPolicy`); parameters are copied to the device per unit.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    # Pinned host memory needs an accelerator; on a CPU device offloading only changes the code path.
    on_accelerator = next(model.parameters()).device.type != "cpu"
    offload = CPUOffloadPolicy(pin_memory=on_accelerator) if cpu_offload else OffloadPolicy()
    units = [fully_shard(layer, mp_policy=mp, offload_policy=offload) for layer in decoder_layers(model)]
    units.append(fully_shard(model, mp_policy=mp, offload_policy=offload))
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
        # The first mini-batch's proximal logprobs come from its own training forward (train_step).
        # One rank only: with several, each sees a share of it and the metrics need every row.
        self.proximal_in_forward = self.dist.world_size == 1
        t = cfg.trainer
        # trainer.precision (config/training.py): the optimizer steps float32 weights unless pure bf16. The
        # model's parameters are cast in place to that (widening a bf16-loaded model is exact).
        precision = t.precision or "fp32"  # None only in a Config built without its validator
        compute_dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        cast_parameters(model, weights_dtype(cfg))
        if t.cpu_offload and self.dist.world_size == 1 and self.device.type != "cpu":
            raise ValueError(
                "trainer.cpu_offload offloads FSDP2's sharded state, and one trainer rank runs "
                "without FSDP2: run several ranks, or set trainer.cpu_offload = false"
            )
        # trainer.lora: peft adapters on a frozen base (model/lora.py); the optimizer sees only them.
        self.lora = t.lora.rank > 0
        if self.lora:
            if self.dist.world_size > 1:  # the config refuses nproc > 1 with LoRA; this is a manual torchrun
                raise ValueError(
                    "trainer.lora.rank > 0 needs a single trainer rank: start the trainer without "
                    "torchrun, or set trainer.lora.rank = 0"
                )
            model = apply_lora(model, t.lora)
        self.reference = None
        if cfg.algorithm.kl_coef > 0 and self.lora:
            # The reference is the base: the same module with its adapters switched off, no copy.
            self.reference = AdaptersOff(model)
        elif cfg.algorithm.kl_coef > 0:
            # Frozen, in the policy's compute dtype: the KL term starts at exactly 0.
            self.reference = cast_parameters(copy.deepcopy(model).eval().requires_grad_(False), compute_dtype)
        if t.activation_checkpointing:
            checkpoint_layers(model)
        # `model` holds the weights the optimizer steps (float32 masters under "mixed");
        # `compute_model` runs the training forwards: the same module, except for mixed precision
        # in one process, where it is MasterWeights' bf16 copy (FSDP2 casts inside its units).
        self._masters: MasterWeights | None = None
        if self.dist.world_size > 1:
            self.model = shard_model(
                model, param_dtype=torch.bfloat16 if precision == "mixed" else None, cpu_offload=t.cpu_offload
            )
            self.compute_model = self.model
        else:
            self.model = self.compute_model = model
            if precision == "mixed":
                self._masters = MasterWeights(model, torch.bfloat16)
                self.compute_model = self._masters.model
        # Trainable parameters only: all of them, or the adapters under trainer.lora.
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=t.lr, betas=t.betas, weight_decay=t.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))

    # ---- forward passes --------------------------------------------------------------------
    def _micro_batches(
        self, batch: TrainBatch, rows: torch.Tensor
    ) -> list[tuple[torch.Tensor, TrainBatch, Pack | None]]:
        """`rows` of the batch as micro-batches: (their rows, the trimmed slice, its pack or None).

        Padded: `trainer.micro_batch_size` sequences each. Packed (`trainer.max_tokens_per_micro_batch`
        set): whole sequences laid end to end, at most that many tokens per pass (trainer/packing.py).
        """
        budget = self.cfg.trainer.max_tokens_per_micro_batch
        if budget is None and self._shares_prompts(batch):
            return self._prompt_set_micro_batches(batch, rows)
        if budget is None:
            # Shortest first, so that each micro-batch is trimmed to lengths near its own: the loss
            # is a sum over sequences with the mini-batch's normaliser, so the order changes no
            # gradient, only the padding computed (a 1.4-1.6x faster step, docs/benchmarks.md).
            if self.cfg.trainer.sort_micro_batches:
                rows = rows[torch.argsort(batch.attention_mask[rows].sum(1), stable=True)]
            return [(r, batch.slice(r).trimmed(), None) for r in rows.split(self.cfg.trainer.micro_batch_size)]
        packs = pack_sequences(batch.input_ids[rows], batch.attention_mask[rows].sum(1), budget)
        return [(rows[p.rows], batch.slice(rows[p.rows]).trimmed(), p) for p in packs]

    def _shares_prompts(self, batch: TrainBatch) -> bool:
        t = self.cfg.trainer
        return (
            t.shared_prompts
            and batch.prompt_lens is not None
            and self.dist.world_size == 1  # ranks would run different numbers of passes
            and not t.activation_checkpointing  # its recompute turns the KV cache off
        )

    def _prompt_set_micro_batches(
        self, batch: TrainBatch, rows: torch.Tensor
    ) -> list[tuple[torch.Tensor, TrainBatch, SharedPrompts]]:
        """Micro-batches of up to `micro_batch_size` rows made of whole prompt sets (a set larger
        than that is split), longest set last when sorting; each laid out by SharedPrompts."""
        t = self.cfg.trainer
        lens = batch.attention_mask.sum(1)
        sets = prompt_sets(batch, rows)
        if t.sort_micro_batches:
            sets = [sorted(s, key=lambda r: int(lens[r])) for s in sets]
            sets.sort(key=lambda s: int(lens[s[-1]]))
        chunks = [s[i : i + t.micro_batch_size] for s in sets for i in range(0, len(s), t.micro_batch_size)]
        micro, current = [], []
        for chunk in chunks:
            if current and len(current) + len(chunk) > t.micro_batch_size:
                micro.append(current)
                current = []
            current = current + chunk
        if current:
            micro.append(current)
        out = []
        for m in micro:
            r = torch.tensor(m, dtype=torch.long)
            mb = batch.slice(r).trimmed()
            out.append((r, mb, SharedPrompts.of(mb)))
        return out

    def _logits(
        self, model, mb: TrainBatch, pack: Pack | SharedPrompts | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, target ids) in the forward's own layout, position t predicting token t+1:
        [n, w, V] and [n, w] padded, [1, T-1, V] and [1, T-1] packed, [n, C, V] and [n, C] with
        shared prompts (completion positions only); `_unpacked` maps each to [n, w]."""
        if isinstance(pack, SharedPrompts):
            return pack.logits(model, self.device)
        if pack is None:
            # No KV cache either: a training forward never reads one back, it costs every layer's
            # keys and values, and under activation checkpointing a layer's recompute would append
            # to it a second time (then attend over twice the keys the mask covers).
            out = model(
                input_ids=mb.input_ids.to(self.device),
                attention_mask=mb.attention_mask.to(self.device),
                use_cache=False,
            )
            ids = mb.input_ids
        else:
            # No attention mask and no KV cache: only then does transformers read position ids that
            # restart at 0 as sequence boundaries and keep attention within each sequence (with a
            # cache, which use_cache's default creates, it silently attends across sequences).
            out = model(
                input_ids=pack.input_ids.to(self.device),
                position_ids=pack.position_ids.to(self.device),
                use_cache=False,
            )
            ids = pack.input_ids
        return out.logits[:, :-1].float(), ids[:, 1:].to(self.device)

    @staticmethod
    def _unpacked(pack: Pack | SharedPrompts | None, values: torch.Tensor) -> torch.Tensor:
        """Per-position values of `_logits`' layout -> [n, w], batch.py's layout."""
        return values if pack is None else pack.unpack(values)

    def _missing_passes(self, mine: int) -> int:
        """FSDP2 all-gathers in every forward and reduce-scatters in every backward, so all ranks
        must run as many micro-batches. Packs per rank vary with the lengths in each share: this
        many zero-loss passes make up a rank's shortfall. Call before the first pass (a collective)."""
        if self.dist.world_size == 1 or self.cfg.trainer.max_tokens_per_micro_batch is None:
            return 0
        most = torch.tensor([mine], device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most) - mine

    def _zero_loss_passes(self, n: int) -> None:
        """One-token forward + backward of 0 x logits: the collectives of a pass, exact zero gradient."""
        for _ in range(n):
            out = self.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device), use_cache=False)
            (out.logits.sum() * 0.0).backward()

    @torch.no_grad()
    def _logprobs(self, model, batch: TrainBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """No-grad logprobs of every batch position under `model` [N, L-1] (`rows`: of those rows
        only, the others 0)."""
        out = torch.zeros_like(batch.inference_logprobs)
        wanted = torch.arange(len(batch)) if rows is None else rows
        for rows, mb, pack in self._micro_batches(batch, wanted):  # noqa: B020 (each micro-batch's own rows)
            logits, targets = self._logits(model, mb, pack)
            lp = self._unpacked(pack, token_logprobs(logits, targets, self.cfg.sampling.temperature))  # [n, w]
            out[rows, : lp.shape[1]] = lp.cpu()
        return out

    def _my_share(self, n: int) -> slice:
        if n % self.dist.world_size:
            raise ValueError(
                f"a mini-batch of {n} sequences does not split over {self.dist.world_size} ranks: "
                "make sampling.prompts_per_step x sampling.group_size / trainer.optimizer_steps "
                "a multiple of the world size"
            )
        per = n // self.dist.world_size
        return slice(self.dist.rank * per, (self.dist.rank + 1) * per)

    # ---- one rollout step ------------------------------------------------------------------
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        cfg, alg = self.cfg, self.cfg.algorithm
        self._sync_compute()  # a checkpoint load or a caller may have changed the masters
        self.compute_model.train()
        metrics: dict[str, float] = {}
        inf_lp = batch.inference_logprobs
        mask = batch.loss_mask
        n_opt = cfg.trainer.optimizer_steps
        per_opt = len(batch) // n_opt
        recompute = alg.old_logprobs == "recompute"
        # The proximal policy is the policy at the start of the step. Until the first optimizer
        # step moves it, the training forward's own logprobs (detached) are that policy's, so
        # the first mini-batch needs no pass of its own (a quarter of the trainer's time on the
        # default run with one optimizer step, an eighth with two; profiled).
        in_forward = recompute and self.proximal_in_forward
        if recompute:
            # Every rank computes the old logprobs it needs before any step: cheap next to the
            # update, and it keeps ranks free of another collective.
            rest = torch.arange(per_opt if in_forward else 0, len(batch))
            old_lp = self._logprobs(self.compute_model, batch, rest) if len(rest) else torch.zeros_like(inf_lp)
        else:
            old_lp = inf_lp
        # Decoupled PPO (the config turns it off with old_logprobs = "inference"): the clip anchors
        # on the proximal (recomputed) policy, and each token is re-weighted from the stale policy
        # that sampled it to that proximal one: behaviour_weights, row by row, per micro-batch.
        weigh = alg.tis_cap != "off"
        ref_lp = self._logprobs(self.reference, batch) if self.reference is not None else None

        sums: dict[str, float] = {}
        for k in range(n_opt):
            lo = k * per_opt
            mini = slice(lo, lo + per_opt)
            mini_mask = mask[mini]
            normalizer = loss_normalizer(
                alg.normalization,
                num_tokens=int(mini_mask.sum()),
                num_sequences=per_opt,
                max_tokens=cfg.sampling.max_new_tokens,
            )
            share = self._my_share(per_opt)
            idx = torch.arange(lo, lo + per_opt)[share]
            self.optimizer.zero_grad(set_to_none=True)
            step_metrics: dict[str, float] = {}
            micro = self._micro_batches(batch, idx)
            missing = self._missing_passes(len(micro))
            for rows, mb, pack in micro:
                width = mb.loss_mask.shape[1]
                logits, targets = self._logits(self.compute_model, mb, pack)  # [n, w, V] (packed: [1, T-1, V])
                lp = self._unpacked(pack, token_logprobs(logits, targets, cfg.sampling.temperature))  # [n, w]
                if in_forward and k == 0:
                    old_lp[rows, :width] = lp.detach().to(old_lp.device)
                old_mb = old_lp[rows, :width]
                tis = None
                if weigh:
                    tis, _ = behaviour_weights(
                        old_mb,
                        inf_lp[rows, :width],
                        mb.loss_mask,
                        cap=alg.tis_cap,
                        level=alg.tis_level,
                        mask_band=alg.tis_mask_band,
                    )  # [n, w]
                want_entropy = alg.entropy_coef > 0
                ent = self._unpacked(pack, token_entropy(logits, cfg.sampling.temperature)) if want_entropy else None
                inputs = LossInputs(
                    logprobs=lp,
                    old_logprobs=old_mb.to(self.device),
                    advantages=mb.advantages.to(self.device),
                    loss_mask=mb.loss_mask.to(self.device),
                    importance_weights=None if tis is None else tis.to(self.device),
                    entropy=ent,
                    ref_logprobs=None if ref_lp is None else ref_lp[rows, :width].to(self.device),
                )
                loss, m = grpo_loss(
                    inputs,
                    normalizer=normalizer,
                    delta=alg.delta,
                    eps_low=alg.eps_low,
                    eps_high=alg.eps_high,
                    entropy_coef=alg.entropy_coef,
                    kl_coef=alg.kl_coef,
                    per_sequence=alg.normalization == "sequence",
                )
                loss.backward()
                if want_entropy:
                    m["entropy/mean"] = m["loss/entropy"]  # same masked mean; one key either way
                else:
                    with torch.no_grad():
                        e = self._unpacked(pack, token_entropy(logits.detach(), cfg.sampling.temperature))
                        m["entropy/mean"] = float(e[mb.loss_mask.to(self.device)].mean()) if mb.loss_mask.any() else 0.0
                weight = float(mb.loss_mask.sum())
                for key, v in m.items():
                    step_metrics[key] = step_metrics.get(key, 0.0) + v * weight
                step_metrics["_w"] = step_metrics.get("_w", 0.0) + weight
            self._zero_loss_passes(missing)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.trainer.grad_clip)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            self.optimizer.step()
            self.scheduler.step()
            self._sync_compute()
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
        if recompute:  # old_lp is whole now: the step's off-policy figures over every row
            gap = (old_lp - inf_lp).abs()[mask]
            metrics["off_policy/logprob_abs_diff"] = float(gap.mean()) if gap.numel() else 0.0
            metrics["off_policy/logprob_abs_diff_max"] = float(gap.max()) if gap.numel() else 0.0
        if weigh:
            _, is_metrics = behaviour_weights(
                old_lp, inf_lp, mask, cap=alg.tis_cap, level=alg.tis_level, mask_band=alg.tis_mask_band
            )
            metrics.update(is_metrics)
        metrics.update(sums)
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        metrics["train/tokens"] = float(mask.sum())
        return metrics

    def _sync_compute(self) -> None:
        if self._masters is not None:
            self._masters.sync()

    # ---- weights out -----------------------------------------------------------------------
    def full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
        """Full, unsharded weights on CPU (on rank 0 only when distributed): the optimizer's own
        (float32 masters under mixed precision), or their floating-point tensors cast to `dtype`,
        the run's inference precision, for a published version (trainer/loop.py)."""
        if self.dist.world_size == 1:
            sd = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if not self.dist.is_main:
                return None
        if dtype is not None:
            sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
        return sd
