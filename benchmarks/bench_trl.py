"""Benchmark (not a test): swarmrl's GRPO loop against Hugging Face TRL's `GRPOTrainer` on the
same problem, from the same base checkpoint, in the same sitting.

Matched (both sides read one swarmrl config: the embedded default, or --config FILE; the figures
below are the default's):
  model      the --model HF folder, fp32 on CPU; no reference model, no KL (beta 0); with the
             config's [trainer.lora] both train the same adapters (swarmrl's `apply_lora`: same
             targets, rank, alpha and zero-initialised B), the optimizer on the adapters alone
  data       `task_rows(cfg)` train split; prompts rendered by the chat template with the generation
             prompt, the token ids checked equal to `model_input`'s for every row (TRL gets
             conversational prompts; the check runs TRL's own prompt tokenizer)
  reward     `math_task_reward` on the completion decoded with special tokens kept (as swarmrl's
             scorer does: `</think>` decides where the answer may be), in-process
  batch      16 prompts x group 8 = 128 completions per generation, 2 optimizer steps of 64 each:
             per_device_train_batch_size 64, gradient_accumulation_steps 1, steps_per_generation 2,
             num_iterations 1; TRL then recomputes old logprobs once per generation, as swarmrl does
  loss       two-sided clipped ratio (epsilon = epsilon_high = 0.2, delta 4), loss_type "bnpo" with
             one 64-completion micro-batch per optimizer step: the step's token-sum over its own
             tokens, swarmrl's "token" normaliser ("dapo" divides by the generation's mean instead)
  optimizer  the same AdamW (lr 1e-4, betas (0.9, 0.99), weight decay 0.01 on every parameter) and
             swarmrl's own LambdaLR (`lr_lambda`: 5 warmup optimizer steps, cosine to 0 at the last),
             passed to TRL as `optimizers=`; grad clip 1.0; T = 1, max 64 new tokens, top-k/top-p off
  steps      --steps counts generations (swarmrl's rollout steps): TRL runs 2x that optimizer steps
  eval       avg@4 at T = 1 on the same 200 held-out problems, seed 0: swarmrl's in-run evaluation
             (metrics.jsonl) and `swarmrl eval` on TRL's checkpoints (same runner, same seeds)

Differs (by design of each, not matched):
  - swarmrl is asynchronous by one step (workers sample step n+1 with policy n while the trainer
    trains step n) and fills each batch with 16 *informative* groups (all-equal rewards dropped
    and replaced); TRL is synchronous and trains on all 16 groups, whose zero-advantage tokens
    still count in the token normaliser (a smaller update when many groups are solved or failed).
  - Advantages: TRL divides by the Bessel-corrected group std (+1e-4), swarmrl by the population
    std (+1e-6): every advantage differs by the same factor sqrt(7/8) for groups of 8.
  - Sampling: TRL uses `model.generate` in the trainer process (--threads torch threads); swarmrl
    samples in 2 worker processes (1 thread each) beside a 1-thread trainer, with seeded sampling,
    TOPLOC proofs and validation, and it writes a policy version every step (counted in its time).
  - Prompt order: each shuffles the train split with its own seed.
Wall time is trainer time: swarmrl's summed `time/step` (as study_async.py); TRL's from the start
of `train()` to each checkpoint, less the time spent saving it. Evaluations are never counted.
"After the first" averages steps 2..N (step 1 carries each side's start: the workers' first
batch, TRL's first generation).
Share of the matmul limit: the model FLOPs a step needs (one forward per prompt and completion
token to sample; 3 forwards' worth per token to train, 2 with LoRA), the same formula on both
sides from each side's mean completion length, over the step time after the first, against a
2048^2 fp32 product measured at the start of the sitting on all threads.
CPU per step (the kernel's count): TRL's process over `train()`, less saving; swarmrl's processes
by role over the steps with no in-run evaluation before their record, the trusted side (trainer,
orchestrator with its validator and graders, relay, launcher) apart from the workers.

Usage: python benchmarks/bench_trl.py --model BASE [BASE_1 BASE_2] [--seeds 0 1 2]
           [--steps 60 --eval-every 20 --threads 2]
Seeds run one after the other, swarmrl then TRL for each (one sitting); one --model serves every
seed, or give one per seed. Issue 30's figures: --steps 20 --eval-every 2 with the bases of seeds
0-2 (the crossing of +20 points located to 2 steps); on the real model:
  --config configs/smollm2-135m.toml --model ~/.cache/swarmrl/real/models/smollm2-135m-q4
  --seeds 0 1 2 --steps 6 --eval-every 0      (LoRA both sides; held-out before and after)
Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from swarmrl.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Sibling scripts: the profiler's process helpers, and the matmul limit and per-token FLOPs the
# engine benchmarks measure against.
from bench_sampler import flops_per_token  # noqa: E402
from bench_vllm import matmul_gflops  # noqa: E402
from profile_step import cpu_name, cpu_seconds, descendants, role_of, steps_done  # noqa: E402


def cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds used so far by the processes under `root`, by role; a process that is no
    swarmrl role (a grading pool's) counts as its nearest ancestor's."""
    out: dict[str, float] = {}
    for pid, secs in cpu_seconds(descendants(root)).items():
        role, p = "other", int(pid)
        while role == "other" and p > 1:
            try:
                role = role_of(Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode())
                p = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                break
        out[role] = out.get(role, 0.0) + secs
    return out


def eval_checkpoint(model: Path | str, out_dir: Path, cfg, config: str | None) -> float:
    """avg@k of one HF folder through `swarmrl eval`: the runner swarmrl's in-run eval uses, on the
    held-out split the config's [tasks] define."""
    cmd = [
        sys.executable,
        "-m",
        "swarmrl.cli",
        "eval",
        "--model",
        str(model),
        "--benchmark",
        "arithmetic",
        "--k",
        str(cfg.eval.samples),
        "--temperature",
        str(cfg.eval.temperature),
        "--max-tokens",
        str(cfg.sampling.max_new_tokens),
        "--seed",
        str(cfg.seed),
        "--workers",
        "1",
        "--output-dir",
        str(out_dir),
    ]
    cmd += ["--config", config] if config else []
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"swarmrl eval of {model} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads((out_dir / "summary.json").read_text())[f"avg@{cfg.eval.samples}"]


# ---- swarmrl ------------------------------------------------------------------------------------
def run_swarmrl(args, cfg, out: Path) -> dict:
    run_dir = out / "swarmrl-run"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resumed one
    cmd = [
        sys.executable,
        "-m",
        "swarmrl.cli",
        "rl",
        "--run-dir",
        str(run_dir),
        "--model.path",
        args.model,
        "--trainer.steps",
        str(args.steps),
        "--eval.every",
        str(args.eval_every),
        "--logging.progress",
        "false",
        "--logging.plots",
        "false",
    ]
    cmd += ["--seed", str(cfg.seed)] + (["--config", args.config] if args.config else [])
    started = time.monotonic()
    err = (out / "swarmrl-rl.log").open("w")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
    # CPU seconds of every process of the run (the kernel's count), by role (trainer, orchestrator
    # with its validator and graders, relay, launcher: the trusted side; workers), snapshotted as
    # each step's record appears. Summed over the steps with no evaluation before their record
    # (in-run evaluations run in the trainer before their step's record; TRL's are outside its
    # timer): CPU per trained step.
    snaps: dict[int, dict[str, float]] = {}
    seen = 0
    while proc.poll() is None:
        done = len(steps_done(run_dir))
        if done > seen:
            seen = done
            snaps[done] = cpu_by_role(proc.pid)
        time.sleep(0.05)
    err.close()
    if proc.returncode != 0:
        tail = (out / "swarmrl-rl.log").read_text()[-2000:]
        raise SystemExit(f"swarmrl rl failed (exit {proc.returncode}); logs in {run_dir}/logs\n{tail}")
    process_wall = time.monotonic() - started
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    wall, curve, step_walls, lengths, accuracy = 0.0, [], [], [], []
    for r in records:
        if "time/step" in r:
            wall += r["time/step"]
            step_walls.append(r["time/step"])
        if "length/mean" in r:
            lengths.append(r["length/mean"])
            accuracy.append(r["reward/task_mean_all"])
        if "eval/accuracy" in r:
            curve.append({"step": r.get("step", 0), "wall_s": round(wall, 1), "accuracy": r["eval/accuracy"]})
    a = cfg.async_
    cpu: dict[str, float] = {}
    evals = {args.steps} | (
        {n for n in range(args.eval_every, args.steps, args.eval_every)} if args.eval_every else set()
    )
    clean = [k for k in snaps if k >= 1 and k + 1 in snaps and k + 1 not in evals and "trainer" in snaps[k + 1]]
    for k in clean:
        for role, secs in snaps[k + 1].items():
            cpu[role] = cpu.get(role, 0.0) + (secs - snaps[k].get(role, 0.0)) / len(clean)
    return {
        "side": "swarmrl",
        "seed": cfg.seed,
        "curve": curve,
        "trainer_wall_s": round(wall, 1),
        "s_per_step": wall / max(len(step_walls), 1),
        "step_walls": step_walls,
        "completion_tokens": sum(lengths) / len(lengths) if lengths else None,
        "train_accuracy": accuracy,  # per step, every sampled group (before the filter)
        "process_wall_s": round(process_wall, 1),
        "threads": f"trainer {a.trainer_threads} + {a.workers} workers x {a.worker_threads}",
        "cpu_s_per_step": sum(cpu.values()) if cpu else None,
        "trusted_cpu_s_per_step": sum(v for r, v in cpu.items() if r != "worker") if cpu else None,
        "cpu_by_role": cpu,
    }


# ---- TRL ----------------------------------------------------------------------------------------
def trl_config(args, cfg, out: Path):
    from trl import GRPOConfig

    s, t, alg = cfg.sampling, cfg.trainer, cfg.algorithm
    samples = s.prompts_per_step * s.group_size
    per_opt = samples // t.optimizer_steps
    grpo = GRPOConfig(
        output_dir=str(out / "trl-trainer"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        activation_checkpointing=False,
        seed=cfg.seed,
        report_to="none",
        push_to_hub=False,
        save_strategy="no",
        use_vllm=False,
        disable_tqdm=True,
        logging_steps=t.optimizer_steps,
        dataloader_num_workers=0,
        # One generation of 128 = 2 optimizer steps x one 64-completion micro-batch, used once each.
        per_device_train_batch_size=per_opt,
        gradient_accumulation_steps=1,
        steps_per_generation=t.optimizer_steps,
        num_iterations=1,
        num_generations=s.group_size,
        max_steps=args.steps * t.optimizer_steps,
        max_completion_length=s.max_new_tokens,
        temperature=s.temperature,
        top_p=1.0,
        top_k=0,
        beta=alg.kl_coef,
        epsilon=alg.eps_low,
        epsilon_high=alg.eps_high,
        delta=alg.delta,
        loss_type="bnpo",
        scale_rewards="group",
        mask_truncated_completions=False,
        # Informational only: the optimizer and schedule passed to the trainer are what runs.
        learning_rate=t.lr,
        adam_beta1=t.betas[0],
        adam_beta2=t.betas[1],
        weight_decay=t.weight_decay,
        max_grad_norm=t.grad_clip,
    )
    if grpo.generation_batch_size != samples or grpo.steps_per_generation != t.optimizer_steps:
        raise SystemExit(
            f"GRPOConfig resolved generation_batch_size={grpo.generation_batch_size}, "
            f"steps_per_generation={grpo.steps_per_generation}; expected {samples}, {t.optimizer_steps}"
        )
    return grpo


def make_reward(tokenizer):
    from swarmrl.rewards.math import math_task_reward

    eos = tokenizer.eos_token_id

    def swarmrl_math(prompts, completions, completion_ids, verification_info, **_):
        rewards = []
        for ids, info in zip(completion_ids, verification_info):
            ids = list(ids)
            ids = ids[: ids.index(eos) + 1] if eos in ids else ids  # nothing after the stop token
            # Special tokens kept, as swarmrl's scorer decodes: TRL's `completions` strip `</think>`.
            rewards.append(math_task_reward(json.loads(info), tokenizer.decode(ids, skip_special_tokens=False))[0])
        return rewards

    return swarmrl_math


def check_prompts(trainer, tokenizer, rows: list[dict]) -> str:
    """Every train prompt must reach the model as exactly the ids swarmrl's sampler sees."""
    from swarmrl.tasks.source import model_input

    want = [model_input(tokenizer, r["prompt"], None)[1] for r in rows]
    got, _, _ = trainer._tokenize_prompts([[{"role": "user", "content": r["prompt"]}] for r in rows])
    bad = sum(list(a) != b for a, b in zip(got, want))
    if bad:
        raise SystemExit(f"{bad}/{len(rows)} prompts tokenise differently in TRL than in swarmrl's model_input")
    return f"conversational prompts, ids identical to model_input for all {len(rows)} rows"


def run_trl(args, cfg, out: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOTrainer

    from swarmrl.model.checkpoint import load_policy, save_policy
    from swarmrl.model.lora import apply_lora
    from swarmrl.tasks.source import task_rows
    from swarmrl.trainer.grpo import lr_lambda

    hf_logging.disable_progress_bar()  # no bar per checkpoint write or model load
    torch.set_num_threads(args.threads)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_policy(args.model)
    _, save_tokenizer = load_policy(args.model)  # a copy TRL never touches, for the checkpoints
    train, _ = task_rows(cfg, log=lambda *_: None)
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["prompt"]}], "verification_info": r["verification_info"]}
            for r in train
        ]
    )
    t, per_gen = cfg.trainer, cfg.trainer.optimizer_steps
    if t.lora.rank:
        # swarmrl's own wrapping (same targets, rank, alpha, init), so both sides train the same
        # adapters; TRL takes a PeftModel as it is. The optimizer sees the adapters only.
        model = apply_lora(model, t.lora)
    trainable = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    ckpt_dir = out / "trl-checkpoints"
    shutil.rmtree(ckpt_dir, ignore_errors=True)

    class SaveAndTime(TrainerCallback):
        """Checkpoint every --eval-every generations and at the end; the wall time excludes saving."""

        def __init__(self):
            self.saves, self.t0, self.paused, self.walls, self.lengths, self.accuracy = [], 0.0, 0.0, [], [], []

        def on_train_begin(self, args_, state, control, **kw):
            self.t0, self.cpu0, self.cpu_paused = time.monotonic(), time.process_time(), 0.0
            self.last = self.t0

        def on_step_end(self, args_, state, control, model=None, **kw):
            step = state.global_step
            if step % per_gen == 0:  # a generation's optimizer steps are done: one swarmrl step
                now = time.monotonic()
                self.walls.append(now - self.last)
                self.last = now
            due = args.eval_every and step % (args.eval_every * per_gen) == 0
            if not due and step != state.max_steps:
                return
            wall = time.monotonic() - self.t0 - self.paused
            cpu = time.process_time() - self.cpu0 - self.cpu_paused
            started, cpu_started = time.monotonic(), time.process_time()
            if hasattr(model, "merge_and_unload"):  # LoRA: the checkpoint is the merged policy
                model = copy.deepcopy(model).merge_and_unload()
            path = save_policy(model, save_tokenizer, ckpt_dir / f"step-{step // per_gen:06d}")
            self.paused += time.monotonic() - started
            self.cpu_paused += time.process_time() - cpu_started
            self.last += time.monotonic() - started  # the save is not the next step's time
            self.saves.append({"step": step // per_gen, "wall_s": round(wall, 1), "cpu_s": cpu, "path": str(path)})

        def on_log(self, args_, state, control, logs=None, **kw):
            logs = logs or {}
            if "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])
                self.accuracy.append(logs.get("reward", float("nan")))
            if "reward" in logs:
                print(
                    f"trl step {state.global_step / per_gen:g} reward {logs['reward']:.3f} zero-std groups "
                    f"{logs.get('frac_reward_zero_std', float('nan')):.2f} lr {logs.get('learning_rate', 0):.2e}",
                    flush=True,
                )

    timer = SaveAndTime()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=make_reward(tokenizer),
        args=trl_config(args, cfg, out),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
        optimizers=(optimizer, scheduler),
    )
    trainer.remove_callback(PrinterCallback)  # our on_log line instead of every raw log dict
    prompts = check_prompts(trainer, tokenizer, train)
    print(f"trl: {prompts}", flush=True)
    started = time.monotonic()
    trainer.train()
    train_wall = time.monotonic() - started
    curve = [
        {
            "step": 0,
            "wall_s": 0.0,
            "accuracy": eval_checkpoint(args.model, out / "trl-eval" / "step-000000", cfg, args.config),
        }
    ]
    for s in timer.saves:
        acc = eval_checkpoint(s["path"], out / "trl-eval" / Path(s["path"]).name, cfg, args.config)
        curve.append({"step": s["step"], "wall_s": s["wall_s"], "accuracy": acc})
    final_wall = timer.saves[-1]["wall_s"] if timer.saves else train_wall
    cpu_per_step = timer.saves[-1]["cpu_s"] / args.steps if timer.saves else None
    return {
        "side": "trl",
        "seed": cfg.seed,
        "cpu_s_per_step": cpu_per_step,
        "trusted_cpu_s_per_step": cpu_per_step,  # one process: all of it is the trainer's
        "curve": curve,
        "trainer_wall_s": final_wall,
        "s_per_step": final_wall / args.steps,
        "step_walls": timer.walls,
        "completion_tokens": sum(timer.lengths) / len(timer.lengths) if timer.lengths else None,
        "train_accuracy": timer.accuracy,  # per step, every sampled group
        "process_wall_s": round(train_wall, 1),
        "threads": f"{torch.get_num_threads()} (one process)",
        "prompts": prompts,
    }


# ---- the machine's share ------------------------------------------------------------------------
def step_work(cfg, model_path: str) -> dict:
    """What one step must compute, the same for both sides: the mean prompt length of the train
    rows (as the sampler tokenises them), the forward FLOPs per token, and the training passes per
    token (forward and backward: 3 forwards' worth for full fine-tuning, 2 with LoRA, whose frozen
    base gets no weight gradients)."""
    from swarmrl.model.checkpoint import load_policy
    from swarmrl.tasks.source import model_input, task_rows

    model, tokenizer = load_policy(model_path)
    train, _ = task_rows(cfg, log=lambda *_: None)
    prompt = sum(len(model_input(tokenizer, r["prompt"], None)[1]) for r in train) / len(train)
    return {
        "prompt_tokens": prompt,
        "model": model,
        "completions": cfg.sampling.prompts_per_step * cfg.sampling.group_size,
        "train_passes": 2 if cfg.trainer.lora.rank else 3,
    }


def add_share(r: dict, work: dict, limit_gflops: float) -> None:
    """Model FLOPs per step (generation: one forward per prompt and completion token; training:
    `train_passes` forwards per token) over the steady step time, as a share of the matmul limit.
    Only the trained batch counts: groups swarmrl samples and drops for want of signal do not."""
    walls = r.get("step_walls") or []
    r["s_per_step_steady"] = sum(walls[1:]) / (len(walls) - 1) if len(walls) > 1 else r["s_per_step"]
    c = r.get("completion_tokens")
    if c is None:
        r["model_gflop_per_step"] = r["matmul_share"] = None
        return
    p = work["prompt_tokens"]
    per_token = flops_per_token(work["model"], context=p + c / 2)
    flops = work["completions"] * (p + c) * per_token * (1 + work["train_passes"])
    r["model_gflop_per_step"] = flops / 1e9
    r["matmul_share"] = flops / 1e9 / r["s_per_step_steady"] / limit_gflops


# ---- report -------------------------------------------------------------------------------------
def time_to_gain(curve: list[dict], gain: float) -> float | None:
    base = curve[0]["accuracy"]
    return next((c["wall_s"] for c in curve if c["accuracy"] - base >= gain - 1e-9), None)


def time_to_gain_interpolated(curve: list[dict], gain: float) -> float | None:
    """The wall time at which the held-out gain reaches `gain`, linear between the two evaluations
    around the first crossing: less tied to the evaluation grid than `time_to_gain`, which jumps a
    whole interval when a seed is a point short at one evaluation."""
    base = curve[0]["accuracy"]
    for a, b in zip(curve, curve[1:]):
        if b["accuracy"] - base >= gain - 1e-9:
            lo, hi = a["accuracy"] - base, b["accuracy"] - base
            return a["wall_s"] + (b["wall_s"] - a["wall_s"]) * (gain - lo) / (hi - lo)
    return None


def _f(x, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def table(results: list[dict], gain: float) -> str:
    pts = round(gain * 100)
    lines = [
        f"| side | seed | torch threads | base | final | trainer wall (s) | s/step | s/step after the first "
        f"| time to +{pts} pts | CPU s/step (all) | CPU s/step (trusted side) | completion tokens "
        "| model GFLOP/step | share of matmul limit | process wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        reach = r["time_to_gain_s"]
        lines.append(
            f"| {r['side']} | {r['seed']} | {r['threads']} | {r['curve'][0]['accuracy']:.3f} "
            f"| {r['curve'][-1]['accuracy']:.3f} | {r['trainer_wall_s']:.1f} | {r['s_per_step']:.2f} "
            f"| {r['s_per_step_steady']:.2f} | {f'{reach:.1f} s' if reach is not None else 'not reached'} "
            f"| {_f(r.get('cpu_s_per_step'), '.2f')} | {_f(r.get('trusted_cpu_s_per_step'), '.2f')} "
            f"| {_f(r.get('completion_tokens'), '.1f')} | {_f(r.get('model_gflop_per_step'), '.0f')} "
            f"| {_f(r.get('matmul_share'), '.1%')} | {r['process_wall_s']:.0f} |"
        )
    lines += ["", "| side | seed | step | trainer wall (s) | held-out avg@k |", "|---|---|---|---|---|"]
    for r in results:
        lines += [
            f"| {r['side']} | {r['seed']} | {c['step']} | {c['wall_s']:.1f} | {c['accuracy']:.3f} |" for c in r["curve"]
        ]
    lines += ["", "Training accuracy per step (every sampled group of the step):", ""]
    for r in results:
        lines.append(f"- {r['side']} seed {r['seed']}: " + " ".join(f"{a:.2f}" for a in r.get("train_accuracy", [])))
    return "\n".join(lines) + "\n"


def summary_lines(results: list[dict], gain: float) -> str:
    """Per side over seeds: mean time to the gain, s/step and CPU; then swarmrl / TRL ratios."""
    pts = round(gain * 100)
    sides: dict[str, dict] = {}
    for r in results:
        d = sides.setdefault(
            r["side"], {"reach": [], "interp": [], "step": [], "steady": [], "share": [], "cpu": [], "trusted": []}
        )
        d["reach"].append(r["time_to_gain_s"])
        d["interp"].append(time_to_gain_interpolated(r["curve"], gain))
        d["step"].append(r["s_per_step"])
        d["steady"].append(r.get("s_per_step_steady"))
        d["share"].append(r.get("matmul_share"))
        d["cpu"].append(r.get("cpu_s_per_step"))
        d["trusted"].append(r.get("trusted_cpu_s_per_step"))

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    out = [
        f"| side | seeds | time to +{pts} pts (each) | mean | s/step (mean) | after the first | share of matmul "
        "limit | CPU s/step | trusted CPU s/step |"
    ]
    out.append("|---|---|---|---|---|---|---|---|---|")
    for side, d in sides.items():
        each = ", ".join(_f(x, ".1f") for x in d["reach"])
        out.append(
            f"| {side} | {len(d['reach'])} | {each} | {_f(mean(d['reach']), '.1f')} | {_f(mean(d['step']), '.2f')} "
            f"| {_f(mean(d['steady']), '.2f')} | {_f(mean(d['share']), '.1%')} "
            f"| {_f(mean(d['cpu']), '.2f')} | {_f(mean(d['trusted']), '.2f')} |"
        )
    if {"swarmrl", "trl"} <= sides.keys():
        sw, tr = sides["swarmrl"], sides["trl"]
        ratio = lambda a, b: _f(a / b, ".2f") if a is not None and b else "n/a"  # noqa: E731
        out.append("")
        out.append(
            f"swarmrl / TRL: time to +{pts} pts {ratio(mean(sw['reach']), mean(tr['reach']))} (mean over seeds; "
            f"per seed {', '.join(ratio(a, b) for a, b in zip(sw['reach'], tr['reach']))}); s/step "
            f"{ratio(mean(sw['step']), mean(tr['step']))} (after the first step "
            f"{ratio(mean(sw['steady']), mean(tr['steady']))}); trusted-side CPU per step against TRL's "
            f"{ratio(mean(sw['trusted']), mean(tr['trusted']))}"
        )
        out.append(
            f"Interpolated between evaluations: time to +{pts} pts swarmrl "
            f"{', '.join(_f(x, '.1f') for x in sw['interp'])} (mean {_f(mean(sw['interp']), '.1f')}), TRL "
            f"{', '.join(_f(x, '.1f') for x in tr['interp'])} (mean {_f(mean(tr['interp']), '.1f')}): "
            f"{ratio(mean(sw['interp']), mean(tr['interp']))}"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        nargs="+",
        help="base HF folder both sides start from (`swarmrl sft --output`): one per --seeds entry, or one for all",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="run seeds (both sides, one sitting, interleaved)")
    p.add_argument("--steps", type=int, default=60, help="generations (swarmrl rollout steps) per side")
    p.add_argument(
        "--eval-every",
        type=int,
        default=20,
        help="evaluate every N generations (and at the end; 0: only before and after)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads of the TRL process")
    p.add_argument("--gain", type=float, default=0.20, help="the held-out gain whose wall time is reported")
    p.add_argument(
        "--config",
        default=None,
        help="a swarmrl TOML config both sides read (default: the embedded default); with [trainer.lora] "
        "TRL trains the same adapters (configs/smollm2-135m.toml: the real model)",
    )
    p.add_argument("--out", default="/tmp/bench_trl")
    p.add_argument("--skip-swarmrl", action="store_true")
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument(
        "--report", metavar="RESULTS_JSON", help="print the summary of an earlier sitting's results.json; run nothing"
    )
    args = p.parse_args()
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        print(summary_lines(saved["sides"], saved["gain"]), end="")
        return
    if not args.model:
        p.error("--model is required (or --report)")
    if len(args.model) not in (1, len(args.seeds)):
        p.error(f"give one --model, or one per seed ({len(args.seeds)})")
    models = args.model * len(args.seeds) if len(args.model) == 1 else args.model
    for m in models:
        if not (Path(m) / "config.json").exists():
            p.error(f"--model {m} is not a Hugging Face model folder")
    if not args.skip_trl:
        try:
            import trl
        except ImportError:
            raise SystemExit('TRL is not installed; from the repository root: pip install -e ".[trl]"') from None
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"cpu: {cpu_name()}; torch {torch.__version__}, default threads {torch.get_num_threads()}; "
        f"trl {'skipped' if args.skip_trl else trl.__version__}",
        flush=True,
    )
    limit = matmul_gflops()
    print(f"matmul limit: {limit:.0f} GFLOP/s (fp32, {torch.get_num_threads()} threads, 2048^2)", flush=True)
    results, works = [], {}
    for seed, model in zip(args.seeds, models):
        cfg = load_config(
            args.config,
            ["--trainer.steps", str(args.steps), "--eval.every", str(args.eval_every), "--model.path", model]
            + ["--seed", str(seed)],
        )
        side_args = argparse.Namespace(**{**vars(args), "model": model})
        seed_out = out / f"seed-{seed}"
        seed_out.mkdir(parents=True, exist_ok=True)
        if not args.skip_swarmrl:
            results.append(run_swarmrl(side_args, cfg, seed_out))
            print(f"seed {seed}: swarmrl done: {results[-1]['trainer_wall_s']:.0f} s trainer wall", flush=True)
        if not args.skip_trl:
            results.append(run_trl(side_args, cfg, seed_out))
            print(f"seed {seed}: trl done: {results[-1]['trainer_wall_s']:.0f} s trainer wall", flush=True)
        if model not in works:
            works[model] = step_work(cfg, model)
        for r in results:
            if r["seed"] == seed:
                add_share(r, works[model], limit)
    for r in results:
        r["time_to_gain_s"] = time_to_gain(r["curve"], args.gain)
    summary = {
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "trl": None if args.skip_trl else trl.__version__,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "gain": args.gain,
        "seeds": args.seeds,
        "config": args.config,
        "matmul_limit_gflops": limit,
        "sides": results,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    text = summary_lines(results, args.gain) + "\n" + table(results, args.gain)
    (out / "table.md").write_text(text)
    print(f"cpu: {cpu_name()}\n" + text)


if __name__ == "__main__":
    main()
