"""Learning: the objective, the trainer (ranks, precision, packing, LoRA), asynchrony, the warm start and evaluation."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from swarmrl.config.base import Section


class AlgorithmConfig(Section):
    delta: float = Field(4.0, gt=1.0)
    """Upper bound on the ratio for negative advantages (two-sided clipping). Seed run: 4."""
    eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    """Lower PPO clip: ratios below 1 - eps_low stop getting gradient. Seed run: 0.2."""
    eps_high: float = Field(0.2, ge=0.0)
    """Upper PPO clip (DAPO's clip-higher raises it, e.g. 0.28). Seed run: 0.2."""
    normalize_std: bool = True
    """Divide group advantages by the group's std. False is the Dr.GRPO variant (Liu et al. 2025)."""
    adv_eps: float = Field(1e-6, gt=0)
    """Added to the std before dividing."""
    normalization: Literal["token", "constant", "sequence"] = "token"
    """Loss normaliser: "token" divides by the step's total completion tokens; "constant" by
    samples x max_new_tokens, a constant budget (Dr.GRPO); "sequence" averages each completion's
    tokens, then the completions (the original GRPO), so every completion weighs the same
    whatever its length: with tasks of very different answer lengths mixed in one batch, "token"
    gives the short-answer task a small share of each step (docs/instructions.md)."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus weight (0: off)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the k3 KL estimate to the reference (starting) policy (0: off, as in the seed run)."""
    old_logprobs: Literal["recompute", "inference"] = "recompute"
    """Where logp_old comes from. "recompute": a no-grad forward of the trainer's current policy
    at the start of each rollout step (the seed run). "inference": the worker's logprobs, saving a
    forward pass; the two-sided clip then also bounds the off-policy ratio."""
    tis_cap: float | Literal["off"] = 2.0
    """With "recompute": weight each token's loss by min(p_old / p_inference, tis_cap). p_old is
    the proximal policy (the trainer's weights at the start of the step) and p_inference the
    policy that sampled the token, so this is decoupled PPO (Fu et al. 2025, AReaL) for stale
    async rollouts, and the truncated importance-sampling fix for inference/trainer mismatch
    (Yao et al. 2025) on fresh ones. The default since the async study, where it kept accuracy on
    stale data close to k = 0's and the seed run's objective did not (measured:
    docs/learning.md#2-asynchrony-decoupled-ppo-keeps-k--2-and-k--4-within-3-points-of-k--0-it-and-k--2-are-now-the-defaults).
    "off": no weights (the seed run's objective). Ignored (off) with old_logprobs = "inference",
    where the ratio is 1 by construction; setting it explicitly there is an error."""

    @field_validator("tis_cap", mode="before")
    @classmethod
    def _cap_off(cls, v: Any) -> Any:
        if v is None or (isinstance(v, str) and v.strip().lower() in ("off", "none")):
            return "off"
        return v

    @field_validator("tis_cap")
    @classmethod
    def _cap_positive(cls, v: float | Literal["off"]) -> float | Literal["off"]:
        if not isinstance(v, str) and not v > 0:
            raise ValueError(f'must be greater than 0 (the largest importance weight), or "off"; got {v}')
        return v

    tis_level: Literal["token", "sequence"] = "token"
    """With tis_cap: "token" weighs each token by its own ratio; "sequence" by the geometric
    mean of its sequence's token ratios (lower variance; see algorithm/offpolicy.py)."""
    tis_mask_band: float | None = Field(None, gt=1.0)
    """With tis_cap: tokens (or, at sequence level, sequences) whose ratio p_old / p_inference is
    outside [1/band, band] get weight 0: too off-policy to learn from. None: no masking."""


# Qwen2 / Llama / Mistral names for every attention and MLP projection.
LORA_TARGETS_DEFAULT = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoRAConfig(Section):
    """`trainer.lora`: train low-rank adapters through peft instead of every weight (Hu et al.
    2021, "LoRA: Low-Rank Adaptation of Large Language Models"). The base model (policy version 0)
    stays frozen; every later version publishes the adapter alone (peft's adapter_config.json +
    adapter_model.safetensors, signed and hashed like a full version, its manifest naming the base
    by content digest), and workers and validators merge it into the base they already hold, so
    sampling, TOPLOC proofs and validation run on plain weights (docs/broadcast.md)."""

    rank: int = Field(0, ge=0)
    """Adapter rank r. 0: LoRA off, every weight trains and every version is the whole model.
    8 is a common choice; an adapter version is then a small fraction of a full one. Raise
    `trainer.lr` with it: the run measured at rank 8 used lr 1e-3 (sizes and that run:
    docs/broadcast.md#lora-adapter-only-versions-trainerlora). One trainer
    rank only (trainer.nproc = trainer.nnodes = 1): FSDP2 over a frozen base is not wired up."""
    alpha: float = Field(16.0, gt=0)
    """Scaling: the weight update is (alpha / rank) x B A. 16 at rank 8 (a scale of 2) is the
    usual choice; keep alpha / rank fixed when changing the rank to keep the same step size."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input while training. 0 recommended in RL: with dropout the
    recomputed old logprobs and the clipped ratio become noisy."""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS_DEFAULT), min_length=1)
    """Linear layers that get adapters, by the last part of their module name (as peft matches
    them). Default: every attention and MLP projection of Qwen2 / Llama. A name the model does
    not have fails at start (`swarmrl rl` checks the configured model before starting anything)."""

    @field_validator("target_modules", mode="before")
    @classmethod
    def _split_names(cls, value):
        # `--trainer.lora.target_modules q_proj,v_proj` as well as a TOML list.
        return [n.strip() for n in value.split(",") if n.strip()] if isinstance(value, str) else value


class TrainerConfig(Section):
    steps: int = Field(40, ge=1)
    """Rollout steps (policy versions) to train. Default 40: where the default run's gains level
    off, each later step spending most of its generation on groups already solved (measured:
    docs/learning.md#a-cheaper-default-make-demo-from-8-min-30-s-to-7-min-24-s-on-y-2026-12-02)."""
    optimizer_steps: int = Field(2, ge=1)
    """Optimizer steps per rollout step: the batch is split into this many mini-batches.
    Seed run: 8 (512 samples, 64 per optimizer step)."""
    micro_batch_size: int = Field(16, ge=1)
    """Sequences per forward/backward; gradients accumulate over micro-batches. Each optimizer
    step's sequences go into micro-batches shortest first (`sort_micro_batches`), each trimmed to
    its own longest: on
    the default run 16 computed 1.5x fewer padded positions than one micro-batch of 64 and its
    step took 0.6x the time (docs/benchmarks.md, issue 30)."""
    shared_prompts: bool = True
    """Padded micro-batches of whole prompt sets (a group's completions), each prompt run once and
    its keys and values shared by its completions (trainer/prompts.py): the same logprobs and
    gradients, computing ~40% fewer positions on the default run. Used with one trainer rank,
    without packing or activation checkpointing (else the plain padded path runs)."""
    sort_micro_batches: bool = True
    """Padded micro-batches: shortest sequences first (above). False: in batch order, as before
    issue 30 (what a test comparing two partitions exactly needs)."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=2)
    """Sequence packing: build micro-batches by token budget instead of by `micro_batch_size`.
    Whole sequences (prompt + completion) are laid end to end, first-fit decreasing, in one row
    of at most this many tokens per forward/backward, with position ids restarting per sequence
    so attention stays within each (swarmrl/trainer/packing.py); no padding is computed, and
    memory per pass is bounded by the budget (`micro_batch_size` is then unused). The loss, its
    normaliser and the gradients are those of the padded path. Must hold the longest prompt +
    `sampling.max_new_tokens` (`swarmrl rl` checks before starting anything). Sizing: with sdpa
    or eager attention (CPU) a pack's attention costs budget^2 (cross-sequence scores are masked,
    not skipped), so keep it a few times the longest sequence; flash attention (GPU) computes
    each sequence's own block only. None (default): padded micro-batches of `micro_batch_size`
    sequences: packing pays on mixed lengths, not on the default run's near-uniform ones
    (measured on CPU: docs/benchmarks.md#sequence-packing-vs-padded-micro-batches-benchmarksbench_packingpy-issue-17)."""  # noqa: E501
    lr: float = Field(1e-4, gt=0)
    """Peak learning rate. Seed run: 3e-7 (32B model). Default 1e-4, for the tiny default model;
    higher rates collapsed it (Adam turns noisy RL gradients into full-size steps; measured:
    docs/default-run.md#how-this-recipe-was-found-what-failed-first)."""
    warmup_steps: int = Field(5, ge=0)
    """Linear warmup in optimizer steps. Seed run: 25."""
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    """LR after warmup: constant (the seed run), or decayed to 0 by the last step (the default,
    cosine), which on the tiny default keeps the final policy from swinging between steps
    (measured: docs/default-run.md#how-this-recipe-was-found-what-failed-first)."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas. Seed run: (0.9, 0.99)."""
    weight_decay: float = Field(0.01, ge=0.0)
    """AdamW weight decay. Seed run: 0.01."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global grad norm. Seed run: 0.1 (one of its stability fixes)."""

    # ---- precision and memory (swarmrl/trainer/grpo.py; figures in benchmarks/bench_memory.py)
    precision: Literal["fp32", "mixed", "bf16"] | None = None
    """How the trainer keeps and computes its weights. "fp32": parameters, gradients and AdamW
    state in float32. "mixed": float32 master weights and AdamW state, bf16 parameters for every
    training forward and backward, gradients reduced and accumulated in float32: FSDP2's
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over several ranks, the same
    recipe by hand in one process (no autocast; trainer/grpo.py `MasterWeights`); the standard
    recipe for bf16. "bf16": pure bf16 parameters and AdamW state (half the optimizer memory, but
    an update below bf16's resolution, ~0.4% of a weight, is lost; the seed config's old behaviour).
    None: "mixed" when model.dtype is "bfloat16", else "fp32". `model.dtype` is the compute dtype
    and must agree (fp32 with float32; mixed and bf16 with bfloat16); setting only this field
    sets it. Checkpoints keep the optimizer's weights (float32 masters under mixed); published
    versions are cast to the run's inference precision, `sampling.dtype`, what workers load."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them from the
    forward (torch's non-reentrant checkpoint_wrapper per layer, applied before FSDP2 sharding):
    activation memory of the layers' inputs only, for about one extra forward of compute.
    Gradients are unchanged (tests/unit/test_precision_train.py)."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and AdamW state in CPU memory and run the optimizer
    step there (FSDP2's CPUOffloadPolicy), for accelerator memory at the cost of host-device copies
    every step. Needs FSDP2, i.e. several trainer ranks: with one rank on an accelerator the
    trainer refuses to start; on a CPU device everything already lives in CPU memory, so it is a
    no-op in effect (it runs FSDP2's offload code path, tested only under 2 gloo ranks on CPU;
    untested on CUDA)."""
    checkpoint_every: int = Field(20, ge=1)
    """Write a resumable checkpoint every N rollout steps (and at the end)."""
    keep_versions: int = Field(4, ge=1)
    """Policy version folders to keep on disk; older ones are deleted once no bound allows them."""
    weights_host: str = "127.0.0.1"
    """Address the trainer's broadcast origin binds (HTTP, read-only: signed, sharded versions).
    0.0.0.0 for relays or workers on other machines."""
    weights_port: int = Field(0, ge=0, le=65535)
    """Port of the broadcast origin; 0 picks a free one."""
    weights_url: str | None = None
    """The URL relays and workers fetch versions from, if not http://weights_host:port (e.g.
    behind NAT or when weights_host is 0.0.0.0)."""
    lora: LoRAConfig = LoRAConfig()
    """LoRA adapters instead of full fine-tuning, and adapter-only policy versions (see LoRAConfig)."""

    # ---- several trainer ranks: torchrun + FSDP2 (swarmrl/launch/torchrun.py, docs/deploy.md)
    nproc: int = Field(1, ge=1)
    """Trainer ranks per node. Above 1 (or with nnodes above 1), `swarmrl rl` and `swarmrl trainer`
    start the trainer under torchrun (`python -m torch.distributed.run`), and the model is sharded
    over all ranks with FSDP2: gloo on CPU, nccl on CUDA with one GPU per rank (rank i of a node
    on cuda:i; pick the GPUs with CUDA_VISIBLE_DEVICES). Each rank gets `async.trainer_threads`
    torch threads and its own log, <run-dir>/logs/trainer-rank<RANK>.log. The world size
    (nproc x nnodes) must divide each optimizer step's mini-batch, prompts_per_step x group_size
    / optimizer_steps sequences: every rank trains on an equal share of it."""
    nnodes: int = Field(1, ge=1)
    """Nodes (machines) the trainer's ranks span. Node 0 is where `swarmrl rl` (or `swarmrl
    trainer --node-rank 0`) runs: it holds global rank 0, which talks to the orchestrator, serves
    the weights and writes the run's files. Every other node runs `swarmrl trainer --run-dir DIR
    --node-rank N` with a copy of the run's config.toml and policies/v000000 (docs/deploy.md)."""
    rdzv_endpoint: str | None = None
    """HOST:PORT where the trainer's nodes meet (torchrun's static rendezvous, a TCP store on node
    0): HOST is node 0's address as the other nodes reach it, PORT a free TCP port there (29500 is
    torchrun's usual). Required with nnodes above 1. Collective traffic (gloo or nccl) then flows
    between the nodes on further ports: keep all of it on a private network (docs/deploy.md).
    None on one node: 127.0.0.1 at a free port."""
    dist_timeout_s: float = Field(1800.0, gt=0)
    """How long trainer ranks wait for each other before the run fails: for every node to join
    at start, and in each collective, including the other ranks' wait while rank 0 waits for the
    orchestrator's next batch (torch's own default for nccl, 10 minutes, is shorter than a batch
    may take when workers are few)."""

    @field_validator("rdzv_endpoint")
    @classmethod
    def _host_port(cls, v: str | None) -> str | None:
        if v is None:
            return v
        host, sep, port = v.rpartition(":")
        if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f'must be "HOST:PORT" (e.g. "10.0.0.1:29500"; IPv6 as "[::1]:29500"), got {v!r}')
        return v


class AsyncConfig(Section):
    bound: int = Field(2, ge=0)
    """Async bound k: data used at step n comes from policy version >= n - k. 0 is synchronous.
    Seed run: 2, as here since the async study, which measured it with decoupled PPO (the default
    `algorithm.tis_cap`); with the seed run's objective (`tis_cap = "off"`) larger bounds cost
    accuracy (measured: docs/learning.md, section 2 (asynchrony);
    on the old base: docs/default-run.md#how-this-recipe-was-found-what-failed-first)."""
    workers: int = Field(2, ge=1)
    """Inference worker processes started by `swarmrl rl`, each with its own key (the default
    exercises several untrusted workers; on 2 cores they share a core with each other)."""
    worker_threads: int = Field(1, ge=1)
    """torch threads per worker process."""
    trainer_threads: int = Field(1, ge=1)
    """torch threads in the trainer process (in each rank, with trainer.nproc above 1)."""
    pin_trainer: bool = True
    """CPU runs (model.device "cpu", one trainer rank): the trainer gets the first
    `trainer_threads` CPUs of `swarmrl rl`'s CPU set to itself and every other process it starts
    (orchestrator and validator, relays, workers) the rest, when any are left. The trainer is
    the critical path; left to the scheduler, the trainer got 86% of a core on the default run
    with 19% of the machine idle (docs/benchmarks.md, issue 30)."""
    worker_engine: str = "builtin"
    """The engine backend of the `workers` (`swarmrl worker --engine`): "builtin", or one a plug-in
    registers (docs/plugins.md) that proves its work. vLLM and endpoint workers have their own
    counts below."""
    worker_engine_options: dict = Field(default_factory=dict)
    """That engine's options by field name (e.g. `{max_model_len = 4096}`), passed to each worker as
    its flags; checked by the engine's options model before anything starts."""
    worker_nice: int = Field(10, ge=0, le=19)
    """Scheduling niceness of the workers `swarmrl rl` starts. The trainer is the critical path
    (workers sample the next batch while it trains), so on a machine where they share cores
    the trainer goes first and workers take what is left."""
    endpoint_workers: int = Field(0, ge=0)
    """Trusted workers `swarmrl rl` starts that generate through an OpenAI-compatible server
    instead of the built-in sampler (`swarmrl worker --engine openai`), each with its own
    `swarmrl serve` process that it reloads with every policy version. Their keys are made
    trusted (written to <run-dir>/trusted_keys.txt with those of `orchestrator.trusted_keys_file`),
    so their groups go without proofs; the `async.workers` still prove theirs (docs/engines.md)."""
    vllm_workers: int = Field(0, ge=0)
    """Untrusted workers `swarmrl rl` starts that generate with vLLM in their own process
    (`swarmrl worker --engine vllm`): the same seeded choice and TOPLOC proofs as the built-in
    engine, so the validator checks them like the `async.workers` (docs/engines.md, "Proving
    vLLM workers"). They run on `vllm_python`; on a CPU each keeps to `worker_threads` cores of
    its own where the machine has them (vLLM pins its threads)."""
    vllm_python: str = ".venv-vllm/bin/python"
    """The python of vLLM's environment, which runs the `vllm_workers` (`make vllm-env` builds it,
    with swarmrl installed in it); relative paths are from the current directory."""
    adversaries: list[str] = Field(default_factory=list)
    """FOR TESTING THE VALIDATOR: extra workers `swarmrl rl` starts that cheat, one per entry,
    each in the named way (`swarmrl worker --help` lists them: other_model, old_version,
    int8_weights, int4_weights, edit_tokens, edit_logprobs, cherry_pick, claim_reward, replay,
    garbage_proofs, truncated_proofs, missing_proofs, wrong_group_size). They are banned and
    leave; the run goes on."""
    adversary_engine: Literal["builtin", "vllm"] = "builtin"
    """The engine the `adversaries` cheat with: "vllm" runs each as a proving vLLM worker
    (`swarmrl worker --engine vllm --adversary KIND` on `vllm_python`), whose cheats the validator
    must catch through vLLM's own kernels."""
    max_pending_groups: int | None = None
    """Back-pressure: the orchestrator stops issuing leases while this many groups are leased or
    wait unconsumed. None: prompts_per_step x min(bound + 1, 2): one batch in flight while the
    trainer trains. A deeper queue only makes data staler, and staler data learned slower on the
    default run (measured: docs/default-run.md#how-this-recipe-was-found-what-failed-first).
    A proven worker's lease counts proven work only:
    what unproven keys hold (orchestrator.unproven_share of this, at most) comes on top."""
    tls: bool = False
    """`swarmrl rl` serves every role it starts over https on loopback (orchestrator, weight
    origin, relays) with a CA made for the run (<run-dir>/tls/), which its children trust: the
    path a real deployment takes (docs/operating.md), on one machine."""

    @field_validator("adversaries", mode="before")
    @classmethod
    def _split(cls, value):
        # `--async.adversaries cherry_pick,other_model` as well as a TOML list.
        return [k.strip() for k in value.split(",") if k.strip()] if isinstance(value, str) else value


class EvalConfig(Section):
    every: int = Field(20, ge=0)
    """Evaluate held-out accuracy every N steps during training (0: only before and after)."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature for held-out evaluation (0: greedy). Default: the rollout
    temperature, so the figure is the accuracy of the policy that is being trained."""
    samples: int = Field(4, ge=1)
    """Samples per held-out problem (accuracy is their mean: avg@k)."""


class SFTConfig(Section):
    steps: int = Field(600, ge=1)
    """Optimizer steps of supervised warm start on worked traces. The default 600 takes the model
    past learning column arithmetic itself, so its accuracy is set by the slips in the data rather
    than by how far a noise-sensitive transition got, whatever the CPU's vector kernels; 400 and
    500 are not always past it (measured: docs/learning.md, section 1 (the base moves with the CPU),
    and docs/learning.md#a-cheaper-default-make-demo-from-8-min-30-s-to-7-min-24-s-on-y-2026-12-02)."""
    batch_size: int = Field(64, ge=1)
    """Traces per step."""
    lr: float = Field(3e-3, gt=0)
    """Peak learning rate (cosine decay to 10%)."""
    examples: int = Field(5000, ge=1)
    """Distinct training traces generated."""
    slip_rate: float = Field(0.7, ge=0.0, le=1.0)
    """Share of traces (among problems where it changes the answer) that show a slip: a dropped
    carry, or the answer digits read off in reverse, with the wrong answer it leads to. The base policy then
    slips about as often, which puts it in the seed
    run's difficulty band, and gives RL a consistent, verifiable behaviour to unlearn."""
    seed: int = 0
    """Initialisation and shuffling seed."""
    dtype: Literal["float32", "float64"] = "float32"
    """Precision of the warm start's arithmetic (the saved base is float32 either way). The
    float32 base depends on the CPU's vector kernels; float64 shrinks that rounding noise, but the
    training is chaotic: it only delays the divergence, so the default recipe is made robust
    instead (measured: docs/learning.md#1-the-base-model-moves-with-the-cpu-cause-found-recipe-made-robust)."""
    threads: int | None = Field(None, ge=1)
    """torch threads for the warm start. None: torch's default (the core count). Reduction order
    can depend on the thread count, so a base meant to match across machines pins it."""
    verbosity: list[int] = Field(default_factory=lambda: [0])
    """Verbosity levels of the worked traces, one drawn uniformly per trace: 0 one terse line per
    column (`6+7=13`, ~34 tokens for 2 digits), 1 with the digit written (`6+7=13, write 3`,
    ~52), 2 each column named with its carry (`ones: 6+7=13, write 3, carry 1`, ~80). Several
    levels give a base that can think at different lengths. With `length.enabled`, each trace's
    prompt carries a target drawn independently of its level, so the base does not follow
    targets and RL has to learn it (configs/length-control.toml)."""

    micro_batches: int = Field(4, ge=1)
    """Forward/backward passes per step. The step's traces are sorted by length and split into
    this many passes, each padded only to its own longest trace; gradients accumulate, so the
    batch and its gradient are those of one pass (up to float rounding), with less padding.
    1: one pass, as bases built before this field existed were. (Drawing whole batches of
    similar length instead, which pads less still, slowed learning. Padding and both measured:
    docs/learning.md#a-cheaper-default-make-demo-from-8-min-30-s-to-7-min-24-s-on-y-2026-12-02.)"""

    tool_rate: float = Field(0.8, ge=0.0, le=1.0)
    """With `tasks.source = "calculator"`: share of the warm start's worked episodes that call the
    calculator on the whole expression and copy its result; the rest answer at once (correctly in
    the data). A base that sometimes calls the tool is one RL can teach to call it always
    (configs/calculator.toml). Measured on machine E (600 steps, seed 0): at 0.5 the base never
    learned to copy the expression into the call or the result into its answer (800 steps
    either); at 0.8 it copies both, and calls the tool in most episodes."""

    target_match: float = Field(0.0, ge=0.0, le=1.0)
    """With `length.enabled`: share of traces whose prompt names the target nearest the trace's
    own length; the rest draw a target uniformly. 0 keeps target and length independent (the
    base never reads N); a small share gives the base a weak habit of reading N, as a pretrained
    LLM has, for RL to turn into control. docs/learning.md, part 3, measures both."""

    @field_validator("verbosity")
    @classmethod
    def _levels(cls, v: list[int]) -> list[int]:
        if not v or any(level not in (0, 1, 2) for level in v) or len(set(v)) != len(v):
            raise ValueError(f"must be distinct levels from 0, 1, 2 (e.g. [0, 1, 2]), got {v}")
        return v
