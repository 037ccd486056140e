"""PNG plots of a finished run (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

from swarmrl.config import Config


def write_plots(records: list[dict], out: Path, cfg: Config) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    steps = [r for r in records if "time/step" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    x = [r["step"] for r in steps]
    written = []

    def save(fig, name):
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(x, [r["reward/mean"] for r in steps], label="reward/mean (batch)")
    ax.plot(x, [r["reward/task_mean_all"] for r in steps], label="task reward, all sampled")
    ax.set_xlabel("step"), ax.set_ylabel("reward"), ax.legend(), ax.set_title("Reward")
    save(fig, "reward.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], "o-")
    ax.set_ylim(0, 1), ax.set_xlabel("step"), ax.set_ylabel("accuracy")
    ax.set_title(f"Held-out accuracy ({cfg.tasks.eval_size} problems, T={cfg.eval.temperature})")
    save(fig, "heldout_accuracy.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(x, [r["length/mean"] for r in steps], label="mean completion length")
    if cfg.length.enabled:
        ax.plot(x, [r["length/target_mean"] for r in steps], "--", label="mean target")
    ax.set_xlabel("step"), ax.set_ylabel("tokens"), ax.legend(), ax.set_title("Length vs target")
    save(fig, "length.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    parts = ["time/wait_for_batch", "time/train", "time/publish"]
    bottom = [0.0] * len(steps)
    for p in parts:
        vals = [r.get(p, 0.0) for r in steps]
        ax.bar(x, vals, bottom=bottom, label=p, width=1.0)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("step"), ax.set_ylabel("seconds"), ax.legend(), ax.set_title("Step time breakdown")
    save(fig, "step_time.png")
    return written
