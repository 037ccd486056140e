"""The trainer role (`swarmrl trainer --run-dir DIR`): the RL loop, one screen long.

    for step n:
        batch n   <- pulled from the orchestrator (versions >= n - k, rewards recomputed there,
                     zero-advantage groups dropped); asking again returns the same batch
        update    <- old logprobs, then `optimizer_steps` clipped-GRPO steps
        publish   -> policy version n + 1: a complete HF folder (atomically), then sharded and
                     signed into <run>/broadcast and served by the broadcast origin
                     by this process, announced to the orchestrator with its file hashes
        record    -> metrics.jsonl, consumed.jsonl, checkpoints, held-out accuracy

Rank 0 talks to the orchestrator and writes files; under torchrun the other ranks receive each
batch by broadcast and take part in the sharded update.
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from swarmrl.config import load_config
from swarmrl.errors import SwarmrlError
from swarmrl.eval.training import evaluate
from swarmrl.model.checkpoint import load_policy, save_policy
from swarmrl.model.hub import hub_source
from swarmrl.model.lora import save_adapter
from swarmrl.protocol.client import Refused, TrainerClient, Unavailable, retrying
from swarmrl.protocol.manifest import content_digest
from swarmrl.protocol.messages import Batch
from swarmrl.protocol.signing import load_or_create_key, public_key_hex
from swarmrl.rewards import registry
from swarmrl.rewards.pool import DEFAULT_PRELOAD, VerifierPool
from swarmrl.rewards.registry import Graders, open_graders, preload_for
from swarmrl.tasks.source import task_rows
from swarmrl.trainer.batch import build_train_batch
from swarmrl.trainer.checkpoint import checkpoint_dirs, load_checkpoint, save_checkpoint
from swarmrl.trainer.grpo import GRPOTrainer, init_distributed, weights_dtype
from swarmrl.transport.broadcast import (
    BroadcastError,
    ShardServer,
    prune_versions,
    publish_version,
    published_manifest,
    unpublish_version,
)
from swarmrl.transport.filesystem import RunDir, atomic_write_text


def _forget_after(rd: RunDir, step: int) -> None:
    """On resume: the records of steps after the checkpoint are of steps that will be redone, so
    they go (metrics.jsonl and consumed.jsonl would otherwise list them twice)."""
    for name, keep in (
        ("metrics.jsonl", lambda r: r.get("step", 0) <= step and not r.get("final")),
        ("consumed.jsonl", lambda r: r.get("step", 0) < step),
    ):
        path = rd.root / name
        if not path.exists():
            continue
        rows = [line for line in path.read_text().splitlines() if line.strip()]
        kept = [line for line in rows if keep(json.loads(line))]
        if len(kept) != len(rows):
            atomic_write_text(path, "".join(line + "\n" for line in kept))


def _log_metrics(rd: RunDir, record: dict) -> None:
    with open(rd.root / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def _parent_watchdog():
    """Started by `swarmrl rl`: exit when the launcher is gone instead of running on orphaned.
    Under torchrun the launcher is the grandparent (torchrun's agent in between), so a parent
    other than the launcher only means it is gone once the launcher's pid is gone too."""
    parent = os.environ.get("SWARMRL_LAUNCHER_PID")

    from swarmrl.transport.broadcast.common import pid_alive as alive

    def check() -> None:
        if parent and str(os.getppid()) != parent and not alive(int(parent)):
            raise SystemExit("the swarmrl rl launcher is gone; stopping the trainer")

    return check


def _same_checkpoint_on_every_rank(root: Path) -> None:
    """Every rank reads the newest checkpoint from its own disk; ranks on other nodes that hold
    another one (or none) would train from other weights, or hang in mismatched collectives."""
    found = checkpoint_dirs(root)
    steps: list = [None] * dist.get_world_size()
    dist.all_gather_object(steps, found[-1][0] if found else None)
    if len(set(steps)) > 1:
        newest = max(s for s in steps if s is not None)
        behind = [r for r, s in enumerate(steps) if s != newest]
        raise RuntimeError(
            f"--resume: ranks {behind} do not hold checkpoint step {newest} (per rank: {steps}); "
            f"copy {root}/step_{newest:06d} from node 0 to the same place on every trainer node "
            "(or share the run directory's filesystem), then start again"
        )


def _broadcast(obj, dist_info):
    if dist_info.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _orchestrator(rd: RunDir, url: str | None, token_file: str | None) -> TrainerClient:
    if url is None:
        info = rd.root / "orchestrator.json"
        if not info.exists():
            raise FileNotFoundError(f"no --orchestrator URL and no {info}: start `swarmrl orchestrator` first")
        url = json.loads(info.read_text())["url"]
    token_path = Path(token_file) if token_file else rd.root / "trainer.token"
    if not token_path.exists():
        raise FileNotFoundError(f"{token_path} is missing: the orchestrator creates it; pass --token-file")
    return TrainerClient(url, token_path.read_text().strip())


class RunStopped(SwarmrlError, RuntimeError):
    """The run cannot go on, for a reason the user must act on (not a crash): its message says
    what is wrong and what to do, and is what the trainer prints (and `swarmrl rl` shows) on exit."""


class _Link:
    """Rank 0's connection to the orchestrator: pull batches, announce versions. Every call
    rides out an orchestrator restart (retry with backoff for up to `unreachable_s`)."""

    def __init__(
        self, client: TrainerClient, url: str, rd: RunDir, check, cfg, server: ShardServer, unreachable_s: float = 600
    ):
        self.client, self.url, self.rd, self.check, self.cfg = client, url, rd, check, cfg
        self.server, self.unreachable_s = server, unreachable_s
        self.accuracy_before: float | None = None  # held-out, at step 0: named if the run stops for lack of signal
        # The trainer's signing key: relays and workers accept only versions it signed.
        self.key = load_or_create_key(rd.root / "trainer_key.pem")
        atomic_write_text(rd.root / "trainer.pub", public_key_hex(self.key) + "\n")

    def _call(self, fn, what):
        return retrying(fn, what=what, give_up_s=self.unreachable_s, check=self.check)

    def publish(self, version: int) -> None:
        """Shard and sign version `version` into <run>/broadcast (atomically), then announce it.
        A version number already there is from before a resume: its steps are being redone."""
        root = self.rd.root / "broadcast"
        lora = self.cfg.trainer.lora.rank > 0
        base = self._lora_base(root) if lora and version else None

        def publish() -> dict:
            return publish_version(
                self.rd.version_path(version),
                root,
                version,
                key=self.key,
                parent=version - 1 if version else None,
                shard_size=self.cfg.broadcast.shard_size,
                base=base,
                patch_from=None if lora else self._patch_from(root, version),
                source=hub_source(self.cfg),
            )

        try:
            # After a resume, a redone step usually gives the same weights: then the version
            # already published stands (same manifest, same digest), and no worker refetches it.
            manifest = publish()
        except BroadcastError as e:
            print(f"republishing v{version}: {e}", flush=True)
            unpublish_version(root, version)
            manifest = publish()
        self._call(lambda: self.client.publish(version, self.url, manifest), f"publish v{version}")
        keep = max(self.cfg.trainer.keep_versions, self.cfg.async_.bound + 2)
        # Under LoRA every later version is an adapter on version 0: the base stays served.
        prune_versions(root, keep, in_use=lambda v: (lora and v == 0) or self.server.in_use(v))

    def _patch_from(self, root: Path, version: int) -> dict | None:
        """What version `version` is patched against: the one before it, while its folder and
        its published manifest are both still here; None when broadcast.patches says not to."""
        mode = self.cfg.broadcast.patches
        if mode == "off" or version == 0 or (mode == "auto" and self.cfg.sampling.dtype == "float32"):
            return None
        folder, held = self.rd.version_path(version - 1), published_manifest(root, version - 1)
        if held is None or not folder.is_dir():
            return None
        return {"dir": folder, "manifest": held, "max_share": self.cfg.broadcast.patch_max_share}

    def _lora_base(self, root: Path) -> dict:
        """What an adapter version's manifest names as its base: version 0 by content digest,
        published first if this broadcast root lacks it (a resume after it was lost)."""
        held = published_manifest(root, 0)
        if held is None:
            held = publish_version(
                self.rd.version_path(0),
                root,
                0,
                key=self.key,
                shard_size=self.cfg.broadcast.shard_size,
                source=hub_source(self.cfg),
            )
        return {"version": 0, "digest": content_digest(held)}

    def report(self, step: int, metrics: dict) -> None:
        """Held-out figures for the orchestrator's dashboard: best effort (the run does not wait
        on it, and an orchestrator from before the dashboard answers 404)."""
        numbers = {k: float(v) for k, v in metrics.items() if k.startswith("eval/") and isinstance(v, (int, float))}
        try:
            self.client.report(step, numbers)
        except (Refused, Unavailable) as e:
            print(f"dashboard: could not report held-out figures for step {step}: {e}", flush=True)

    def pull(self, step: int, poll_s: float = 0.05, report_s: float = 60.0) -> Batch:
        """Batch `step`, polling until the orchestrator has built it; its groups are rollout records
        (`Group`). Raises RunStopped when it refuses with no_signal (every recent group had
        all-equal rewards): waiting would be forever."""
        t0 = last = time.monotonic()
        while True:
            try:
                resp = self._call(lambda: self.client.batch(step), f"batch {step}")
            except Refused as e:
                if e.code == "no_signal":
                    raise RunStopped(self._with_accuracy(e.detail)) from None
                raise RuntimeError(e.detail) from None
            if resp.ready:
                return resp
            if time.monotonic() - last > report_s:  # a standalone trainer may wait for workers to join
                last = time.monotonic()
                print(f"waiting {last - t0:.0f} s for batch {step}: {waiting_note(resp)}", flush=True)
            self.check()
            time.sleep(poll_s)

    def _with_accuracy(self, message: str) -> str:
        """The orchestrator's no_signal message, with the held-out accuracy before RL when it
        could not name it (the trainer's report of it is best effort)."""
        if self.accuracy_before is None or "Held-out accuracy" in message:
            return message
        return f"{message}\nHeld-out accuracy before RL: {self.accuracy_before:.3f} (measured by this trainer)."


def waiting_note(resp: Batch) -> str:
    """What a not-ready batch reply says: informative groups queued of those needed, and, from an
    orchestrator that counts them, how many groups had all-equal rewards (no signal): a run
    heading for the no_signal stop shows it here first."""
    note = f"{resp.queued}/{resp.needed} informative groups"
    seen, same = resp.groups_seen, resp.groups_all_equal
    if not seen or same is None:
        return note
    note += f"; {same} of the {seen} groups sampled so far had all-equal rewards (no signal)"
    streak, limit = resp.all_equal_streak, resp.all_equal_limit
    if streak and limit:
        note += f", the last {streak} in a row: the run stops with no_signal at {limit} in a row"
    return note


def _write_version(trainer, model, tokenizer, path: Path, full_sd, dtype: torch.dtype) -> None:
    """policies/vNNNNNN: the whole model (`full_sd`: its gathered weights in the run's inference
    precision), or under trainer.lora the adapter alone, in that precision."""
    if trainer.lora:
        save_adapter(trainer.model, path, dtype=dtype)
    else:
        save_policy(model, tokenizer, path, state_dict=full_sd)


class _EvalPolicy:
    """What rank 0 samples held-out answers with. An FSDP2 model's forward is a collective (each
    layer all-gathers its shards), so rank 0 cannot sample alone with it: under torchrun it loads
    the full weights it gathers anyway (to publish) into an unsharded copy. Under trainer.lora: a
    plain copy with the adapters merged in, as workers merge them."""

    def __init__(self, trainer: GRPOTrainer, base: Path, device: str, dtype: torch.dtype):
        self.trainer, self.base, self.device, self.dtype = trainer, base, device, dtype
        self.unsharded = None

    def __call__(self, full_sd):
        trainer = self.trainer
        if trainer.lora:  # (the built-in sampler runs plain modules, not peft's)
            return copy.deepcopy(trainer.model).merge_and_unload().to(self.dtype).eval()
        if trainer.dist.world_size == 1:
            return trainer.model
        if self.unsharded is None:
            self.unsharded = load_policy(self.base, device=self.device, dtype=self.dtype)[0]
        if full_sd is not None:
            self.unsharded.load_state_dict(full_sd)
        return self.unsharded.eval()


# long: the trainer's whole loop (pull a batch, step, publish, checkpoint, evaluate), read top to bottom
def run_trainer(
    run_dir: str | Path, *, resume: bool = False, orchestrator: str | None = None, token_file: str | None = None
) -> dict:
    rd = RunDir(run_dir)
    cfg = load_config(rd.root / "config.toml")
    registry.load(cfg.tasks.types)  # the run's own task types, for held-out grading
    dinfo = init_distributed(cfg.model.device, cfg.trainer.dist_timeout_s)
    torch.set_num_threads(cfg.async_.trainer_threads)
    torch.manual_seed(cfg.seed)
    device = dinfo.device(cfg.model.device)
    # In the optimizer's dtype (float32 masters if "mixed"); published in the inference precision.
    model, tokenizer = load_policy(rd.version_path(0), device=device, dtype=weights_dtype(cfg))
    publish_dtype = getattr(torch, cfg.sampling.dtype)
    trainer = GRPOTrainer(model, cfg, dinfo)
    main = dinfo.is_main
    start, extra = 0, {}
    if resume:
        if dinfo.world_size > 1:
            _same_checkpoint_on_every_rank(rd.root / "checkpoints")
        state = load_checkpoint(trainer, rd.root / "checkpoints")
        if state is not None:
            start, extra = state["step"], state["extra"]
            print(f"resumed from checkpoint at step {start}", flush=True)
            if main:
                _forget_after(rd, start)
    # Only rank 0 evaluates: the other ranks (on other nodes too) need no task files.
    held_out = task_rows(cfg, log=lambda *_: None)[1] if main else []
    pool = (
        VerifierPool(
            cfg.rewards.verify_workers,
            cfg.rewards.verify_timeout_s,
            memory_bytes=cfg.rewards.verify_memory_mb << 20,
            preload=(*DEFAULT_PRELOAD, *preload_for(held_out)),
        )
        if main
        else None
    )
    graders = open_graders(held_out, cfg.sandbox) if main else Graders()
    policy_for_eval = _EvalPolicy(trainer, rd.version_path(0), device, publish_dtype)
    server = link = None
    t_run = time.monotonic()
    try:
        if main:
            (rd.root / "broadcast").mkdir(exist_ok=True)
            tls = None
            if cfg.broadcast.tls_cert:
                from swarmrl.protocol.tls import server_context

                tls = server_context(cfg.broadcast.tls_cert, cfg.broadcast.tls_key, flag="broadcast.tls_cert")
            server = ShardServer(
                rd.root / "broadcast", tls=tls, host=cfg.trainer.weights_host, port=cfg.trainer.weights_port
            ).start()
            origin = cfg.trainer.weights_url or server.url
            link = _Link(_orchestrator(rd, orchestrator, token_file), origin, rd, _parent_watchdog(), cfg, server)
            # Where relays find the origin (`swarmrl rl` starts them once this exists).
            atomic_write_text(rd.root / "origin.json", json.dumps({"url": origin}))
        sd = trainer.full_state_dict(publish_dtype) if start and not trainer.lora else None
        if main:
            if start:
                # The checkpoint's weights are version `start`; versions written after it belong to
                # steps that will be redone (on the same frozen batches), so they are replaced.
                _write_version(trainer, model, tokenizer, rd.version_path(start), sd, publish_dtype)
            link.publish(start)
        if start == 0 and main:
            before = evaluate(policy_for_eval(sd), tokenizer, held_out, cfg, pool, graders=graders)
            extra["accuracy_before"] = before["eval/accuracy"]
            _log_metrics(rd, {"step": 0, **before})
            print(f"held-out accuracy before: {before['eval/accuracy']:.3f}", flush=True)
            link.report(0, before)
        if main:
            link.accuracy_before = extra.get("accuracy_before")
        for step in range(start, cfg.trainer.steps):
            t0 = time.monotonic()
            groups, metrics = None, {}
            if main:
                pulled = link.pull(step)
                groups = pulled.groups
                metrics = {**pulled.metrics, "time/wait_for_batch": time.monotonic() - t0}
                with open(rd.root / "consumed.jsonl", "a") as f:
                    f.write(json.dumps({"step": step, "group_ids": pulled.group_ids}) + "\n")
            groups = _broadcast(groups, dinfo)
            batch = build_train_batch(
                groups,
                pad_token_id=tokenizer.pad_token_id,
                normalize_std=cfg.algorithm.normalize_std,
                adv_eps=cfg.algorithm.adv_eps,
            )
            t1 = time.monotonic()
            metrics.update(trainer.train_step(batch))
            t2 = time.monotonic()
            sd = None if trainer.lora else trainer.full_state_dict(publish_dtype)
            if main:
                _write_version(trainer, model, tokenizer, rd.version_path(step + 1), sd, publish_dtype)
                link.publish(step + 1)
                rd.prune_versions(keep_from=min(step + 1 - cfg.async_.bound, step + 2 - cfg.trainer.keep_versions))
            t3 = time.monotonic()
            metrics.update({"time/train": t2 - t1, "time/publish": t3 - t2, "time/step": t3 - t0})
            metrics["throughput/generated_tokens_per_s"] = metrics.get("batch/generated_tokens", 0.0) / max(
                t3 - t0, 1e-9
            )
            done = step + 1
            if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.trainer.steps and main:
                held = evaluate(policy_for_eval(sd), tokenizer, held_out, cfg, pool, graders=graders)
                metrics.update(held)
                print(f"held-out accuracy after step {done}: {held['eval/accuracy']:.3f}", flush=True)
                link.report(done, held)
            if done % cfg.trainer.checkpoint_every == 0 or done == cfg.trainer.steps:
                save_checkpoint(trainer, rd.root / "checkpoints", done, extra)
            if main:
                _log_metrics(rd, {"step": done, **metrics})
                print(
                    f"step {done} reward {metrics['reward/mean']:.3f} acc {metrics['reward/task_mean_all']:.3f} "
                    f"off_policy {metrics['off_policy/max']:.0f} step {metrics['time/step']:.2f}s",
                    flush=True,
                )
        summary = {}
        if main:
            rd.request_stop()  # first: the launcher must know workers leaving now are done, not dead
            link._call(link.client.finish, "finish")
            after = evaluate(policy_for_eval(sd), tokenizer, held_out, cfg, pool, graders=graders)
            _log_metrics(rd, {"step": cfg.trainer.steps, "final": True, **after})
            link.report(cfg.trainer.steps, after)
            summary = {
                "accuracy_before": extra.get("accuracy_before"),
                "accuracy_after": after["eval/accuracy"],
                "steps": cfg.trainer.steps,
                "trainer_seconds": time.monotonic() - t_run,
            }
            atomic_write_text(rd.root / "trainer_summary.json", json.dumps(summary, indent=1))
            print(f"held-out accuracy after: {after['eval/accuracy']:.3f}", flush=True)
        if dist.is_initialized():
            # Every rank tears its process group down together, after rank 0's final evaluation:
            # a rank that destroyed its gloo group while rank 0 was still evaluating was seen to
            # abort at exit ("terminate called without an active exception", SIGABRT), which
            # torchrun reports as the run failing. Only on the normal path: after an error the
            # other ranks may never arrive.
            dist.barrier()
        return summary
    finally:
        if server is not None:
            server.close()
        if pool is not None:
            pool.close()
        graders.close()
        if dist.is_initialized():
            dist.destroy_process_group()
