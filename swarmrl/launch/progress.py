"""Where a run's metrics go while it runs: the terminal (rich), and wandb when configured."""

from __future__ import annotations

import sys

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
        return self

    def update(self, r: dict) -> None:
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in r.items() if isinstance(v, (int, float))}, step=r["step"])
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
