"""The model, the tasks and how they are sampled and rewarded: what a rollout is made of."""

from __future__ import annotations

import math
import os
from typing import Literal

from pydantic import Field, field_validator, model_validator

from swarmrl.config.base import Section


class ModelConfig(Section):
    path: str | None = None
    """The model to start from: a Hugging Face model folder (any causal LM) or a Hub id such as
    "HuggingFaceTB/SmolLM2-135M-Instruct", read from the Hugging Face cache (downloaded into it when
    the hub is reachable and HF_HUB_OFFLINE is not set). None: the project's tiny Qwen2 warm
    started by `swarmrl sft`, built on first use and cached under `base_cache_dir`. `~` and
    `$VARS` are expanded (configs/smollm2-135m.toml points into the real assets' cache)."""
    revision: str | None = None
    """With a Hub id: the branch, tag or commit to start from (default: the main branch).
    `swarmrl rl` pins it to the commit it resolved to in the run's config.toml, and every version's
    signed manifest names the id and that commit, so the run starts from the same weights wherever
    and whenever it is resumed."""

    @field_validator("path")
    @classmethod
    def _expand(cls, value: str | None) -> str | None:
        return os.path.expanduser(os.path.expandvars(value)) if value else value

    base_cache_dir: str = ".cache/swarmrl/base"
    """Where the built-in base model is cached (relative to the working directory)."""
    device: str = "cpu"
    """Torch device for trainer and workers: "cpu", "cuda", "cuda:1"..."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The trainer's compute dtype. float32 on CPU (bf16 matmuls are far slower on these CPUs);
    bfloat16 on GPUs, as in the seed run, where `trainer.precision` says how the weights are kept
    (by default "mixed": float32 master weights and optimizer state). Workers and validators
    compute in `sampling.dtype`, the run's inference precision."""


# `tasks.source = "mix"`: several registered sources in one run (swarmrl/tasks/registry.py).
MIX = "mix"
# The IFEval instruction types the built-in instruction generator writes constraints for
# (swarmrl/tasks/instructions.py, TEMPLATES; a unit test keeps the two equal), named here so that
# validating a config imports nothing above it.
INSTRUCTION_TEMPLATES = (
    "punctuation:no_comma",
    "change_case:english_lowercase",
    "change_case:english_capital",
    "change_case:capital_word_frequency",
    "length_constraints:number_words",
    "length_constraints:number_sentences",
    "length_constraints:number_paragraphs",
    "keywords:existence",
    "keywords:frequency",
    "keywords:forbidden_words",
    "keywords:letter_frequency",
    "detectable_content:postscript",
    "detectable_content:number_placeholders",
    "detectable_format:number_bullet_lists",
    "detectable_format:number_highlighted_sections",
    "detectable_format:title",
    "detectable_format:multiple_sections",
    "detectable_format:json_format",
    "startend:end_checker",
    "startend:quotation",
    "combination:repeat_prompt",
    "combination:two_responses",
)


class TasksConfig(Section):
    source: str = "arithmetic"
    """A registered task source (swarmrl/tasks/registry.py): the built-in "arithmetic" (procedural
    math), "instructions" (procedural instruction following: plain requests with IFEval
    constraints, docs/instructions.md), "calculator" or "guess" (multi-turn episodes of the
    built-in environments, docs/environments.md), or one a plug-in registers (docs/plugins.md);
    "mix" for several registered ones in one run (`mix`); or a path to tasks in the INTELLECT-2 RL
    dataset schema: a .jsonl/.parquet file or a local Hugging Face dataset folder (rows whose
    task_type is "env:NAME" are episodes of environment NAME)."""
    options: dict = Field(default_factory=dict)
    """Settings of a plug-in task source, checked by its own options model when the rows are made
    (e.g. `{dataset = "leg_counting"}`); in a mix, one table per source:
    `{my_source = {dataset = "x"}}`. The built-in sources take theirs from the fields below."""
    mix: dict[str, float] = Field(default_factory=dict)
    """With `source = "mix"`: the registered sources of the run and their weights, e.g.
    `{arithmetic = 0.5, instructions = 0.5}` (episode sources run alone). Each source gets its
    weight's share of `train_size` (normalised over the weights, at least one problem) and its own
    `eval_size` held-out problems, reported as `eval/accuracy/<source>` beside the overall
    `eval/accuracy`."""
    types: list[str] = Field(default_factory=list)
    """Task types beyond the built-in ones (verifiable_math, prime_rl_code, multiple_choice), as
    "module:ATTRIBUTE" naming a swarmrl.rewards.registry.TaskType in a module on the Python path;
    every process of the run registers them (docs/architecture.md, "Adding a task type")."""
    eval_source: str | None = None
    """Held-out tasks for a file `source` (same formats). None with "arithmetic": its held-out split."""
    digits: int = Field(2, ge=1, le=9)
    """Arithmetic difficulty: digits per operand."""
    ops: str = Field("+-", pattern=r"^[+-]+$")
    """Arithmetic operators to draw from."""
    style: Literal["reasoning", "plain"] = "reasoning"
    """Arithmetic prompts and grading. "reasoning": "Compute 12 + 7." graded on the last \\boxed{}
    (the format `swarmrl sft` teaches the built-in base). "plain": "What is 12 + 7? Answer with
    only the number." graded on the last number written, for a pretrained chat model that was
    never taught the boxed format (configs/smollm2-135m.toml)."""
    max_constraints: int = Field(3, ge=1, le=6)
    """Instructions: each prompt has 1 to this many constraints (uniformly), no two of one kind
    (swarmrl/tasks/instructions.py)."""
    instruction_types: list[str] = Field(default_factory=list)
    """Instructions: the IFEval instruction ids the constraints are drawn from; empty for all the
    generator's templates (`INSTRUCTION_TEMPLATES` above, 22 of IFEval's 25)."""
    held_out_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    """Share of the built-in problems in the held-out split, by a hash: of each arithmetic problem,
    of each instruction request (120 in all). Raise it for 1-digit problems, of which there are
    only 100 per operator."""
    train_size: int = Field(5000, ge=1)
    """Number of distinct built-in training problems (in a mix, over all its sources)."""
    eval_size: int = Field(200, ge=1)
    """Number of held-out problems used for `eval/accuracy` (in a mix, per source)."""
    solve_rate_column: str | None = None
    """Column used for offline difficulty filtering (the seed used a 7B model's solve rate)."""
    solve_rate_range: tuple[float, float] | None = None
    """Keep rows whose solve rate lies in [lo, hi]. Seed run: [0.1, 0.8] (INTELLECT-2 report)."""
    seed: int = 0
    """Seed for task generation and shuffling."""
    retire_after: int = Field(0, ge=0)
    """Online difficulty filtering: retire a training problem once it has given this many groups in
    a row whose rewards are all equal (all solved or none: no signal for GRPO), counting groups of
    proven or trusted keys only; leases skip retired problems (orchestrator/curriculum.py). 0: never
    retire. The counts are kept in the run's store, so a restart or resume keeps them."""
    retire_max_share: float = Field(0.9, gt=0.0, lt=1.0)
    """At most this share of the training problems is ever retired (the rest stay in rotation)."""
    max_turns: int | None = Field(None, ge=1)
    """Episodes: model turns at most (None: each environment's own `max_turns`). An episode's
    tokens after the prompt, turns and observations together, are at most
    `sampling.max_new_tokens`."""
    guess_high: int = Field(16, ge=2, le=10**6)
    """"guess": the hidden number is from 1 to this."""
    guess_turn_cost: float = Field(0.0, ge=0.0, lt=1.0)
    """"guess": a number found on turn t pays 1 - guess_turn_cost * (t - 1) (0 when not found), so
    that GRPO prefers games won in fewer turns; 0 pays 1 whatever the turn."""

    @model_validator(mode="after")
    def _check_builtin(self) -> TasksConfig:
        if self.source == MIX:
            if not self.mix:
                raise ValueError(
                    'tasks.source = "mix" needs tasks.mix, the sources and their weights, e.g. '
                    "{arithmetic = 0.5, instructions = 0.5}"
                )
            for name, weight in self.mix.items():
                if not (weight > 0 and math.isfinite(weight)):
                    raise ValueError(
                        f"tasks.mix.{name} = {weight}: weights must be positive numbers (leave a source out "
                        "to not use it)"
                    )
        elif self.mix:
            raise ValueError(
                f'tasks.mix is set but tasks.source = "{self.source}": set tasks.source = "mix" to mix '
                "registered sources, or remove tasks.mix"
            )
        unknown = [name for name in self.instruction_types if name not in INSTRUCTION_TEMPLATES]
        if unknown:
            raise ValueError(
                f"tasks.instruction_types: the instruction generator has no template for "
                f"{', '.join(map(repr, unknown))}; it writes: {', '.join(INSTRUCTION_TEMPLATES)}"
            )
        return self


# The no-signal stop must not end an honest hard run: a base solving NO_SIGNAL_ACCURACY of its
# tasks reaches the default streak with probability at most NO_SIGNAL_FALSE_STOP per group, so a
# run of a million groups stops falsely with probability below 0.1%.
NO_SIGNAL_ACCURACY = 0.05
NO_SIGNAL_FALSE_STOP = 1e-9


def all_equal_chance(accuracy: float, group_size: int) -> float:
    """P(all of a group's rewards are equal) for a policy solving `accuracy` of its tasks, with
    0/1 rewards: all right or all wrong, p^g + (1 - p)^g."""
    return accuracy**group_size + (1 - accuracy) ** group_size


def default_uninformative_limit(group_size: int, prompts_per_step: int) -> int:
    """The default `sampling.uninformative_limit`: at least 32 groups and 4 batches' worth (a
    short unlucky patch is not a verdict), and long enough that a base at NO_SIGNAL_ACCURACY
    reaches it with probability at most NO_SIGNAL_FALSE_STOP (N >= log(risk) / log(q))."""
    q = all_equal_chance(NO_SIGNAL_ACCURACY, group_size)
    return max(32, 4 * prompts_per_step, math.ceil(math.log(NO_SIGNAL_FALSE_STOP) / math.log(q)))


class SamplingConfig(Section):
    group_size: int = Field(8, ge=2)
    """Completions per prompt (G in GRPO). Seed run: 16."""
    prompts_per_step: int = Field(16, ge=1)
    """Informative groups in one training batch; samples per step = this x group_size.
    Seed run: 32 prompts x 16 = 512 samples."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature; logprobs are taken under the same temperature. Seed run: 0.6
    (later raised to 1.0 in their ablations)."""
    max_new_tokens: int = Field(64, ge=1)
    """Token limit per completion; hitting it gives finish reason "length"."""
    worker_batch_prompts: int = Field(8, ge=1)
    """Prompts (groups) in one lease: what a worker samples in one batched generate call.
    Smaller leases let the orchestrator stop handing out work with a version closer to exactly
    what the next batch needs (less dropped as stale); larger ones batch the sampler better."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The run's inference precision: leases carry it, workers sample in it (a worker set to
    another refuses the lease with a message) and validators prefill in it, so honest work is
    judged against its own numerics (docs/validation.md calibrates both). float32 on CPU;
    bfloat16 for GPU fleets, as in the seed run."""
    uninformative_limit: int | None = Field(None, ge=1)
    """Stop the run with an error (naming the cause and the fixes) once this many groups in a
    row had all-equal rewards and no batch can be built: GRPO has no signal, and waiting for an
    informative group would wait forever. None: derived from the run, `no_signal_limit()`: the
    largest of 32, 4 batches' worth (4 x prompts_per_step) and the streak a base solving 5% of
    its tasks reaches with probability below 1e-9 (docs/operating.md, "A run with no signal")."""

    def no_signal_limit(self) -> int:
        """The all-equal streak at which the run stops: `uninformative_limit`, or its default."""
        if self.uninformative_limit is not None:
            return self.uninformative_limit
        return default_uninformative_limit(self.group_size, self.prompts_per_step)


class LengthConfig(Section):
    enabled: bool = False
    """Length-controlled reasoning: append " Think for {N} tokens before giving a response."
    to each prompt and shape the reward by how well the completion meets N."""
    targets: list[int] = Field(default_factory=lambda: [48, 64, 96])
    """Target lengths sampled uniformly per prompt. Seed run: 2000-10000 in steps of 2000."""
    mode: Literal["exact", "max", "clip"] = "max"
    """exact: task - coef*|len - N|; max: task * clip(coef*(N - len) + 0.5, 0, 1);
    clip: task if len <= N else 0 (the three modes of the INTELLECT-2 report)."""
    coef: float = Field(0.01, ge=0.0)
    """Penalty slope per token. Seed run: 0.001 for 2000-10000 token targets."""


class RewardsConfig(Section):
    verify_workers: int = Field(1, ge=1)
    """Processes grading answers with math-verify."""
    verify_timeout_s: float = Field(1.0, gt=0)
    """Hard per-answer grading budget of math and multiple-choice answers (the grading process is
    killed and replaced); an answer that exceeds it scores 0. Honest answers on the real GSM8K and
    AIME rows take at most ~0.12 s, LaTeX-heavy ones up to ~0.8 s on a loaded 2-core machine
    (benchmarks/bench_grading.py, docs/security.md "Grading"); an answer built to burn the grader
    costs at most this. Code answers have their own budgets (`sandbox.test_timeout_s`,
    `sandbox.total_timeout_s`)."""
    verify_memory_mb: int = Field(1024, ge=64)
    """Address-space limit (RLIMIT_AS) of each grading process; an answer needing more scores 0
    and the process is replaced."""
    instruction_reward: Literal["all", "fraction"] = "all"
    """Reward of a training row of instruction following: "all" 1 when every constraint is
    followed, else 0 (IFEval's prompt-level strict measure); "fraction" the share of its
    constraints followed (instruction-level strict), a denser signal. Held-out accuracy is
    prompt-level strict either way (docs/instructions.md)."""


class SandboxConfig(Section):
    """How code rewards (`prime_rl_code` rows) run untrusted programs: each test in a fresh
    bubblewrap sandbox (see docs/sandbox.md)."""

    workers: int | None = Field(None, ge=1)
    """Sandboxes running at once (completions graded in parallel). None: one per CPU core."""
    test_timeout_s: float = Field(5.0, gt=0)
    """Wall-clock limit of one test; RLIMIT_CPU is this rounded up plus 1 s. Sandbox startup
    gets `startup_grace_s` on top (its cost, measured:
    docs/sandbox.md#measured-here-2-cores-benchmarksbench_sandboxpy-2026-11-30)."""
    total_timeout_s: float = Field(30.0, gt=0)
    """Wall-clock limit for all tests of one completion; tests that no longer fit fail."""
    partial_credit: bool = False
    """False: reward 1 only if every test passes, stopping at the first failure (the seed run).
    True: the fraction of tests passed, running them all."""
    memory_mb: int = Field(512, ge=32)
    """Address-space limit (RLIMIT_AS) of each process in the sandbox; the slot's cgroup gets
    this plus `tmp_mb` plus 64 MB for the whole sandbox."""
    max_procs: int = Field(32, ge=1)
    """Processes and threads a program may have (RLIMIT_NPROC, and the cgroup's pids.max)."""
    max_output_kb: int = Field(1024, ge=1)
    """Stdout and stderr each read up to this; a program writing more is killed and fails."""
    max_file_mb: int = Field(16, ge=1)
    """Largest file a program may write (RLIMIT_FSIZE)."""
    max_open_files: int = Field(64, ge=8)
    """Open file descriptors (RLIMIT_NOFILE)."""
    tmp_mb: int = Field(64, ge=1)
    """Size of the sandbox's private /tmp (a tmpfs, the only writable place)."""
    startup_grace_s: float = Field(1.0, ge=0)
    """Added to each test's wall-clock limit for starting the sandbox and the interpreter."""
    uid_base: int = Field(61000, ge=1000)
    """Run as root, each sandbox pool claims `workers` consecutive uids from uid_base up that no
    other pool on the machine holds (lock files under /run/swarmrl/sandbox-uids), and slot i's
    programs run as the i-th (no account needed): never root, and one uid per slot, in no other
    pool, so each slot's process limit is its own."""
    cgroups: Literal["auto", "required", "off"] = "auto"
    """Per-slot pids+memory cgroup (v2 if delegated, else v1). "auto": use one where the
    cgroup filesystem is writable (root), else rely on rlimits and namespaces; "required":
    refuse to start without; "off": never."""
    bwrap: str = "bwrap"
    """The bubblewrap executable (Debian package `bubblewrap`)."""
    python: str | None = None
    """Interpreter run inside the sandbox (standard library only). None: this Python's base
    interpreter."""
    unsafe_no_sandbox: bool = False
    """DANGEROUS: run programs with no sandbox (as this user, with network and files), for code
    you trust on machines where bubblewrap cannot run. Prints a warning at every start."""
