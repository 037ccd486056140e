"""Running a validator: inside the orchestrator's process (local runs) or as `swarmrl validator`.

Both drive the same loop over a work source: claim pending groups, check them (`core.Validator`),
send the verdicts. In-process, the source is the `Orchestrator` object itself; external
validators reach it over HTTP with the validator token and may run on other machines (they need
the policy weights, fetched from the URLs the trainer announced, like workers do).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from swarmrl import plugins
from swarmrl.config import ValidatorConfig
from swarmrl.errors import SwarmrlError
from swarmrl.protocol.client import ValidatorClient, retrying
from swarmrl.protocol.messages import Claim
from swarmrl.protocol.tls import TLSError
from swarmrl.validator.core import Validator


class InProcessSource:
    def __init__(self, orch):
        self.orch = orch

    def claim(self, n: int) -> dict:
        return self.orch.claim_validation(n)

    def record(self, verdicts: list[dict], retry: list[int]) -> dict:
        return self.orch.record_verdicts(verdicts, retry)


class HttpSource:
    def __init__(self, url: str, token: str, *, unreachable_s: float = 300.0, log=print):
        self.client = ValidatorClient(url, token)
        self.unreachable_s, self.log = unreachable_s, log

    def claim(self, n: int) -> dict:
        return retrying(lambda: self.client.claim(n), what="claim", give_up_s=self.unreachable_s, log=self.log)

    def record(self, verdicts: list[dict], retry: list[int]) -> dict:
        return retrying(
            lambda: self.client.record(verdicts, retry), what="verdicts", give_up_s=self.unreachable_s, log=self.log
        )

    def finished(self) -> bool:
        return bool(retrying(self.client.status, what="status", give_up_s=self.unreachable_s, log=self.log)["finished"])


@dataclass
class Round:
    """What one claim-check-record round did."""

    checked: int = 0  # groups given a verdict
    waiting: int = 0  # groups put back because their policy could not be loaded yet


class Pause:
    """How long to wait before the next claim: short while there is work, doubling while there
    is none (up to `idle_max`), and doubling from `stuck_min` up to `stuck_max` while every claimed
    group has to be put back (its policy cannot be loaded, e.g. the trainer is down): claiming
    them again at once only spins."""

    def __init__(self, idle_s: float = 0.05, idle_max: float = 0.5, stuck_min: float = 1.0, stuck_max: float = 15.0):
        self.idle_s, self.idle_max, self.stuck_min, self.stuck_max = idle_s, idle_max, stuck_min, stuck_max
        self.idle, self.stuck = idle_s, stuck_min

    def after(self, r: Round) -> float:
        if r.checked:
            self.idle, self.stuck = self.idle_s, self.stuck_min
            return 0.0
        if r.waiting:
            wait, self.stuck = self.stuck, min(self.stuck_max, self.stuck * 2)
            return wait
        wait, self.idle = self.idle, min(self.idle_max, self.idle * 2)
        return wait


def validate_once(source, validator: Validator, max_groups: int) -> Round:
    """One claim-check-record round."""
    # Read once as the message it is: the claimed groups are ClaimedGroup from here on.
    work = Claim.model_validate(source.claim(max_groups))
    # The run's thresholds, whoever runs the validator.
    validator.cfg = ValidatorConfig(**work.config)
    validator.calibrated = work.calibrated
    validator.note_calibration_cpu(work.calibrated_cpu)
    done = Round()
    if work.items:
        policies = {int(v): p.model_dump(exclude_unset=True) for v, p in work.policies.items()}
        # The run's precision too: the prefill must run in the dtype the workers sampled in.
        verdicts, retry = validator.check(work.items, policies, work.dtype)
        source.record([v.to_dict() for v in verdicts], retry)
        done = Round(checked=len(verdicts), waiting=len(retry))
    validator.forget_below(work.min_version)
    return done


def run_loop(source, validator: Validator, *, stop: threading.Event, idle_s: float = 0.05, log=print) -> None:
    pause = Pause(idle_s)
    while not stop.is_set():
        wait = pause.after(validate_once(source, validator, validator.cfg.batch_groups))
        if wait:
            stop.wait(wait)
    log("validator stopped")


def start_in_process(orch, run_dir: Path, *, log=print) -> tuple[threading.Thread, threading.Event]:
    """The orchestrator's own validator thread (validator.mode = "in-process")."""
    import torch

    cfg = orch.cfg.validator
    torch.set_num_threads(cfg.threads)
    validator = Validator(cfg, run_dir / "validator", log=log, trainer_key=orch.trainer_public_key)
    stop = threading.Event()

    def body():
        try:
            run_loop(InProcessSource(orch), validator, stop=stop, log=log)
        except BaseException:  # never die silently: groups would wait forever
            log("validator: crashed\n" + traceback.format_exc())
            raise

    thread = threading.Thread(target=body, name="validator", daemon=True)
    thread.start()
    return thread, stop


def run_external(
    orchestrator: str,
    *,
    token_file: str,
    cache_dir: str,
    threads: int | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    relays: list[str] = (),
    trainer_key: str | None = None,
) -> None:
    """`swarmrl validator`: check groups for a remote orchestrator until the run finishes. The
    thresholds, batch size and precision come from the orchestrator with every claim; `dtype`,
    if given, only makes this validator stop when the run's precision is another."""
    import torch

    cfg = ValidatorConfig()
    if threads:
        torch.set_num_threads(threads)
    token = Path(token_file).read_text().strip()
    source = HttpSource(orchestrator, token)
    status = retrying(source.client.status, what="status", give_up_s=source.unreachable_s, log=source.log)
    try:  # the run's plug-ins (its environments replay episodes here) before the first claim
        plugins.follow(status.get("plugins", []), where="the run's plugins")
    except SwarmrlError as e:
        print(f"swarmrl validator: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    validator = Validator(cfg, cache_dir, device=device, dtype=dtype, relays=relays, trainer_key=trainer_key)
    print(f"validator: checking groups for {orchestrator}", flush=True)
    checked, last = 0, time.monotonic()
    pause = Pause(idle_s=0.2, idle_max=0.2)
    try:
        while True:
            r = validate_once(source, validator, validator.cfg.batch_groups)
            checked += r.checked
            wait = pause.after(r)
            if not r.checked and not r.waiting and source.finished():
                print(f"validator: the run is finished ({checked} groups checked)", flush=True)
                return
            if wait:
                time.sleep(wait)
            elif time.monotonic() - last > 30:
                rate = validator.prefill_tokens / max(validator.prefill_seconds, 1e-9)
                print(f"validator: {checked} groups checked (prefill {rate:.0f} tok/s)", flush=True)
                last = time.monotonic()
    except TLSError:
        raise  # a setting to fix (--ca-file): swarmrl.cli says so and exits 2, as for any bad flag
    except SwarmrlError as e:  # refused, unreachable, WrongPrecision, any error meant for the user
        print(f"swarmrl validator: {e}", file=sys.stderr)
        raise SystemExit(1) from None
