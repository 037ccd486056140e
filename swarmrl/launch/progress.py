"""Where a run's metrics go while it runs: the terminal (rich), and wandb and TensorBoard when
configured, each fed the same records of metrics.jsonl."""

from __future__ import annotations

import sys
from pathlib import Path

from swarmrl.config import Config
from swarmrl.protocol.reasons import FRAUD_REASONS


class Progress:
    def __init__(self, cfg: Config, *, enabled: bool = True):
        self.cfg = cfg
        self.total = cfg.trainer.steps
        self.live = enabled and sys.stdout.isatty()
        self.enabled = enabled
        self._progress = None
        self._wandb = None
        self._tensorboard = None

    def __enter__(self) -> Progress:
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._progress = RichProgress(
                TextColumn("[bold]rl"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self._progress.start()
            self._task = self._progress.add_task("steps", total=self.total, info="building batch 0...")
        if self.cfg.logging.wandb_project:
            try:
                import wandb
            except ImportError:
                print(
                    "logging.wandb_project is set but wandb is not installed (pip install wandb); "
                    "logging to metrics.jsonl only",
                    file=sys.stderr,
                )
            else:
                self._wandb = wandb.init(
                    project=self.cfg.logging.wandb_project, config=self.cfg.model_dump(mode="json", by_alias=True)
                )
        if self.cfg.logging.tensorboard and self.cfg.run_dir:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step 0: the records are written again from the first on every start of the
            # launcher (a resume reads metrics.jsonl from its start), and TensorBoard drops the
            # earlier session's events instead of showing each step twice.
            self._tensorboard = SummaryWriter(str(tensorboard_dir(self.cfg.run_dir)), purge_step=0)
            self._tensorboard.add_text("config", "```toml\n" + self.cfg.to_toml() + "\n```", 0)
        return self

    def update(self, r: dict) -> None:
        scalars = {k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._wandb is not None:
            self._wandb.log(scalars, step=r["step"])
        if self._tensorboard is not None:
            for name, value in scalars.items():
                if name != "step":
                    self._tensorboard.add_scalar(name, value, global_step=int(r["step"]))
            self._tensorboard.flush()
        if "time/step" in r:
            info = (
                f"reward {r['reward/mean']:.2f}  acc {r['reward/task_mean_all']:.2f}  "
                f"{r['throughput/generated_tokens_per_s']:.0f} tok/s  off-policy {r['off_policy/max']:.0f}"
                f"  {r['time/step']:.2f}s/step"
            )
        elif "eval/accuracy" in r:
            info = f"held-out accuracy {r['eval/accuracy']:.3f}"
        else:
            return
        if "eval/accuracy" in r and "time/step" in r:
            info += f"  held-out {r['eval/accuracy']:.3f}"
        refused = {k.split("/", 1)[1]: int(v) for k, v in r.items() if k.startswith("rejected/") and v}
        fraud = {k: v for k, v in refused.items() if k in FRAUD_REASONS}
        if fraud:
            info += "  rejected " + ", ".join(f"{k} {v}" for k, v in sorted(fraud.items()))
        late = sum(v for k, v in refused.items() if k not in FRAUD_REASONS)
        if late:
            info += f"  late {late}"  # stale or duplicate submissions of honest workers
        if r.get("workers/banned"):
            info += f"  banned {int(r['workers/banned'])}"
        if self._progress is not None:
            self._progress.update(self._task, completed=min(r["step"], self.total), info=info)
        elif self.enabled:
            print(f"step {r['step']}/{self.total}  {info}", flush=True)

    def note(self, line: str) -> None:
        """An event worth a line of its own (a worker banned, a validator rejection)."""
        if self._progress is not None:
            self._progress.console.print(line)
        else:
            print(line, flush=True)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()


def tensorboard_dir(run_dir) -> Path:
    return Path(run_dir) / "tensorboard"


def check_tensorboard(cfg: Config) -> None:
    """A run that asks for TensorBoard has its package, or does not start."""
    if cfg.logging.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ValueError(
                "logging.tensorboard = true needs the tensorboard package: pip install tensorboard "
                "(or swarmrl[tensorboard]), or set logging.tensorboard = false"
            ) from None
