"""Limits files: the validator's thresholds and evidence models for one model, dtype and CPU kind.

`swarmrl calibrate` measures honest groups through each engine a run will accept and the cheat
catalogue against the validator's own prefill, then `choose_limits` (pure, below) turns those
statistics into what a run judges with:

  * hard limits per group, for what is unambiguous (far beyond any honest group: honest worst
    times a margin): a group beyond them is refused and counts as fraud (`validator.ban_after`);
  * one evidence model per engine (proofs/evidence.py): the statistic that separates honest
    work from the nearest cheat best, binned, summed per key in a CUSUM that bans at the bound
    chosen for `false_ban_rate` over `horizon` groups;
  * the engines it refuses: an engine whose honest groups leave some cheat of the catalogue
    neither refused by the hard limits nor banned by evidence within `max_groups_to_ban` groups
    is refused, with the figures. No declared engine buys limits the calibration did not show
    to be safe against every cheat: a cheat declaring that engine is judged by them too.

The file is stamped with the model's content digest (`model_digest`), the dtype, the engines
and the CPU kind (`cpu_kind`); `load_limits` refuses a file for another model or dtype, and the
validator says so when it runs on another CPU kind than the one measured.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from swarmrl.errors import SwarmrlError
from swarmrl.proofs.evidence import EvidenceModel, ban_bound, fit, groups_to_ban

FORMAT = "swarmrl-limits/1"

# The verdict statistics an evidence model may read (validator/core.py, Validator.judge).
EVIDENCE_STATS = (
    "mant_err_group",
    "logprob_err_mean",
    "logprob_bias",
    "logprob_err_max",
    "sampling_margin_max",
    "mant_err_mean_max",
)

# Hard limit = max(honest worst x FACTOR, honest worst + FLOOR), per verdict statistic, and the
# limit name it sets (the names of ValidatorConfig.limits()). The floors keep a limit above zero
# when every honest group measured 0 (float32's mantissa median).
HARD = {
    "exp_mismatches_max": ("exp_mismatches_max", 2.0, 4.0),
    "mant_err_mean_max": ("mant_err_mean_max", 1.5, 0.25),
    "mant_err_median_max": ("mant_err_median_max", 1.5, 0.25),
    "mant_err_group": ("group_mant_err_max", 1.5, 0.1),
    "sampling_margin_max": ("sampling_margin", 2.0, 0.05),
    "logprob_err_max": ("logprob_tol", 2.0, 0.005),
}
# The group's signed mean logprob error (`logprob_bias`) is evidence only, never a hard limit. A
# trained policy's completions in a group collapse onto the same few tokens, so its errors are
# one completion's counted eight times, not eight measurements: on SmolLM2-135M in bf16 (machine
# Z, LoRA lr 5e-4) honest groups measured at most 0.017 at v0 and 0.058 by v23, two honest
# groups of 632 were refused by the limit fitted at v0 (0.04), and that limit refused no cheat
# of the catalogue that another limit did not already refuse (edited logprobs: logprob_tol).
# A file chosen with it is chosen again when it is loaded (`load_limits`).
RETIRED_LIMITS = ("logprob_bias_max",)


class LimitsError(SwarmrlError, ValueError):
    """A limits file that cannot be used for this run (another model, dtype, or not a limits file)."""


def model_digest(folder: str | Path) -> str:
    """sha256 over a model folder's weights and config (name and sha256 of each `*.safetensors`,
    `*.bin`, `config.json` and a LoRA adapter's `adapter_config.json`, in name order): the same
    weights give the same digest wherever they are."""
    root = Path(folder)
    files = sorted(p for p in root.iterdir() if _digested(p.name))
    if not files:
        raise LimitsError(f"{root} holds no model weights (*.safetensors or *.bin): not a model folder")
    named = []
    for p in files:
        inner = hashlib.sha256()
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                inner.update(block)
        named.append((p.name, inner.hexdigest()))
    return _digest_of(named)


def manifest_model_digest(manifest: dict) -> str:
    """`model_digest` of the folder a broadcast manifest describes, from the sha256 of each file
    it lists (the trainer signs them): a version's digest after its folder was pruned."""
    return _digest_of(sorted((f["name"], f["sha256"]) for f in manifest["files"] if _digested(f["name"])))


def _digested(name: str) -> bool:
    return Path(name).suffix in (".safetensors", ".bin") or name in ("config.json", "adapter_config.json")


def _digest_of(named: list[tuple[str, str]]) -> str:
    outer = hashlib.sha256()
    for name, sha in named:
        outer.update(f"{name}\0{sha}\n".encode())
    return outer.hexdigest()


def cpu_kind() -> str:
    """The CPU kind the kernels ran on, as this project names them: "amx" (Intel with AMX),
    "avx512", "avx2" or "default", from torch's dispatch (which follows ATEN_CPU_CAPABILITY, so
    forced AVX2 kernels read as "avx2") and the CPU's flags."""
    import torch

    cap = str(torch.backends.cpu.get_cpu_capability()).lower()
    if cap.startswith("avx512"):
        try:
            flags = Path("/proc/cpuinfo").read_text()
        except OSError:
            flags = ""
        forced = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
        if " amx_tile" in flags and (not forced or "AMX" in forced):
            return "amx"
        return "avx512"
    return cap if cap in ("avx2",) else "default"


def tail_limit(values: list[float], refusal_rate: float = 1e-6) -> float:
    """Where honest values should fall beyond only once in 1 / `refusal_rate` groups: the
    exponential tail fitted above the 90th percentile (peaks over a threshold), q90 + mean
    excess x log(0.1 / rate). The maximum of a few hundred groups is no such bound: a limit at
    twice it refused an honest group of a later version within 24 groups."""
    xs = sorted(values)
    q90 = xs[min(len(xs) - 1, math.ceil(0.9 * len(xs)) - 1)]
    excess = [x - q90 for x in xs if x > q90]
    mean_excess = sum(excess) / len(excess) if excess else 0.0
    return q90 + mean_excess * math.log(0.1 / refusal_rate)


def hard_limits(honest: list[dict], refusal_rate: float = 1e-6) -> dict[str, float]:
    """Per-group limits from honest verdict statistics, beyond which honest work should not come
    within `refusal_rate` per group: the larger of the honest worst times a margin (plus a floor)
    and the fitted tail's (`tail_limit`)."""
    out: dict[str, float] = {}
    for stat, (name, factor, floor) in HARD.items():
        values = [float(s.get(stat, 0.0)) for s in honest]
        worst = max(values)
        value = max(worst * factor, worst + floor, tail_limit(values, refusal_rate))
        out[name] = int(math.ceil(value)) if name == "exp_mismatches_max" else round(value, 6)
    return out


def refused_by_hard(stats: dict, limits: dict[str, float]) -> bool:
    """Whether a group with these verdict statistics fails a hard limit."""
    return any(float(stats.get(stat, 0.0)) > limits[name] for stat, (name, _, _) in HARD.items())


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


def _values(groups: list[dict], stat: str) -> list[float]:
    return [float(s.get(stat, 0.0)) for s in groups]


def _evidence_models(hon: list[dict], passing: dict[str, list[dict]], confidence: float) -> list[EvidenceModel]:
    """One test per cheat whose groups pass the hard limits: fitted to that cheat alone, on the
    statistic that bans it soonest (a test per cheat costs only log(cheats) on the bound, where
    one test fitted to several cheats pooled loses power on each of them)."""
    models = []
    for name, groups in sorted(passing.items()):
        if not groups:
            continue
        best: tuple[float, EvidenceModel] | None = None
        for stat in EVIDENCE_STATS:
            m = fit(stat, _values(hon, stat), _values(groups, stat), bound=1.0, confidence=confidence)
            g = groups_to_ban(m, _values(groups, stat))
            if best is None or g < best[0]:
                best = (g, replace(m, target=name))
        if best is not None and not math.isinf(best[0]):  # a test that bans nothing is not worth its bound
            models.append(best[1])
    return models


INFORMATIONAL = frozenset({"previous_version"})
"""Cheats measured and reported (how many groups their key needs to be banned), never fitted a test
nor used to refuse an engine: the previous version is the policy one step behind, work the async
bound accepts when declared as such. A worker that claims the current version for it gains a step of
staleness the trainer's corrections do not see; when one step moves the weights by less than the
dtype's rounding (a real model's learning rate in bf16), nothing can tell the two apart, and nothing
needs to: the tokens are the same model's."""


def choose_limits(
    honest: dict[str, list[dict]],
    cheats: dict[str, list[dict]],
    *,
    false_ban_rate: float = 1e-6,
    horizon: int = 100_000,
    max_groups_to_ban: float = 64.0,
    confidence: float = 0.99,
) -> dict:
    """Limits, evidence models and refusals per engine from verdict statistics: `honest` maps an
    engine to its honest groups' stats, `cheats` a cheat's name to its groups' stats (measured
    against the validator's prefill, so the same for every engine)."""
    engines: dict[str, dict] = {}
    for engine, hon in honest.items():
        if not hon:
            raise ValueError(f"engine {engine}: no honest groups measured")
        hard = hard_limits(hon)
        # What evidence must catch: each cheat's groups that the hard limits let through.
        passing = {name: [s for s in groups if not refused_by_hard(s, hard)] for name, groups in cheats.items()}
        models = _evidence_models(hon, {n: g for n, g in passing.items() if n not in INFORMATIONAL}, confidence)
        bound = ban_bound(false_ban_rate, horizon, max(1, len(models)))
        models = [replace(m, bound=bound) for m in models]
        per_cheat, unsafe = {}, []
        for name, groups in cheats.items():
            row: dict = {"groups": len(groups), "refused_by_limits": len(groups) - len(passing[name])}
            if passing[name]:
                row["groups_to_ban"] = min(
                    (groups_to_ban(m, _values(passing[name], m.statistic)) for m in models), default=math.inf
                )
                if name in INFORMATIONAL:
                    row["informational"] = True
                elif row["groups_to_ban"] > max_groups_to_ban:
                    unsafe.append(name)
            per_cheat[name] = row
        entry: dict = {
            "limits": hard,
            "evidence": [m.to_dict() for m in models],
            "honest_groups": len(hon),
            "honest_peak_score": max((_peak(m, hon) for m in models), default=0.0),
            "cheats": per_cheat,
        }
        if unsafe:
            figures = "; ".join(
                f"{n}: {per_cheat[n]['groups'] - per_cheat[n]['refused_by_limits']} of {per_cheat[n]['groups']} "
                f"groups pass the limits, about {_fmt(per_cheat[n]['groups_to_ban'])} groups to ban"
                for n in unsafe
            )
            entry["refused"] = (
                f"engine {engine}: its honest groups overlap the cheats' ({figures}; at most "
                f"{max_groups_to_ban:g} allowed): measure more honest groups, or run without this engine"
            )
        engines[engine] = entry
    return {
        "false_ban_rate": false_ban_rate,
        "horizon": horizon,
        "max_groups_to_ban": max_groups_to_ban,
        "engines": engines,
    }


def _peak(model: EvidenceModel, groups: list[dict]) -> float:
    """The highest CUSUM score a key sending these groups, in order, reaches."""
    score = peak = 0.0
    for s in groups:
        score = model.step(score, s)
        peak = max(peak, score)
    return peak


def separation(honest: dict[str, list[dict]], cheats: dict[str, list[dict]]) -> list[dict]:
    """Per engine and statistic: the honest worst against each cheat's best (lowest) and median."""
    rows = []
    for engine, hon in honest.items():
        for stat in ("exp_mismatches_max", *EVIDENCE_STATS):
            worst = max(float(s.get(stat, 0.0)) for s in hon)
            row = {"engine": engine, "statistic": stat, "honest_worst": worst, "cheats": {}}
            for name, groups in cheats.items():
                vals = sorted(float(s.get(stat, 0.0)) for s in groups)
                if vals:
                    row["cheats"][name] = {"best": vals[0], "median": vals[len(vals) // 2]}
            rows.append(row)
    return rows


def _ban_at(entry: dict, models: list[EvidenceModel], groups, ban_after: int) -> int | None:
    """The group (1-based) at which a key sending `groups` in order is banned under an engine's
    `entry`: its `ban_after`-th hard refusal, or any test's score reaching its bound."""
    frauds, scores = 0, [0.0] * len(models)
    for i, s in enumerate(groups, 1):
        if refused_by_hard(s, entry["limits"]):
            frauds += 1
            if frauds >= ban_after:
                return i
            continue
        for j, m in enumerate(models):
            scores[j] = m.step(scores[j], s)
            if scores[j] >= m.bound:
                return i
    return None


def replay_bans(chosen: dict, engine: str, cheats: dict[str, list[dict]], ban_after: int = 3) -> dict[str, int | None]:
    """The group at which each cheat, sending its measured groups in order, is banned under an
    engine's limits: by `ban_after` hard refusals or by any evidence score (None: not within them)."""
    entry = chosen["engines"][engine]
    models = [EvidenceModel.from_dict(d) for d in entry["evidence"]]
    return {name: _ban_at(entry, models, groups, ban_after) for name, groups in cheats.items()}


def ban_times(
    chosen: dict,
    engine: str,
    cheats: dict[str, list[dict]],
    *,
    runs: int = 1000,
    max_groups: int = 1000,
    ban_after: int = 3,
    seed: int = 0,
) -> dict[str, dict]:
    """How many groups each cheat needs before its ban, over `runs` sequences drawn with
    replacement from its measured groups (a bootstrap): median, worst, and how many sequences of
    `max_groups` groups were never banned."""
    entry = chosen["engines"][engine]
    models = [EvidenceModel.from_dict(d) for d in entry["evidence"]]
    rng = random.Random(seed)
    out = {}
    for name, groups in cheats.items():
        times = [
            _ban_at(entry, models, (rng.choice(groups) for _ in range(max_groups)), ban_after) for _ in range(runs)
        ]
        banned = sorted(t for t in times if t is not None)
        out[name] = {
            "median": banned[len(banned) // 2] if banned else None,
            "worst": banned[-1] if banned else None,
            "never": len(times) - len(banned),
            "runs": runs,
            "max_groups": max_groups,
        }
    return out


def honest_peaks(chosen: dict, engine: str, honest: list[dict], *, runs: int = 20, length: int = 10_000, seed: int = 0):
    """The highest share of its bound any test reaches for an honest key sending `length` groups
    drawn with replacement from the measured honest ones, over `runs` keys, and how many of them
    would have been refused or banned (each should be 0)."""
    entry = chosen["engines"][engine]
    models = [EvidenceModel.from_dict(d) for d in entry["evidence"]]
    rng = random.Random(seed)
    peak, refused, banned = 0.0, 0, 0
    for _ in range(runs):
        scores = [0.0] * len(models)
        for _ in range(length):
            s = rng.choice(honest)
            if refused_by_hard(s, entry["limits"]):
                refused += 1
                continue
            for j, m in enumerate(models):
                scores[j] = m.step(scores[j], s)
                peak = max(peak, scores[j] / m.bound)
                if scores[j] >= m.bound:
                    banned += 1
                    scores = [0.0] * len(models)
                    break
    return {"runs": runs, "length": length, "peak_share": peak, "refused": refused, "banned": banned}


def load_limits(
    path: str | Path,
    *,
    dtype: str,
    digest: str | None,
    run_dir: Path | None = None,
    published: Callable[[int], dict | None] | None = None,
) -> dict:
    """A limits file for a run sampling in `dtype` on the model of content digest `digest` (None:
    not checked, e.g. the built-in model, whose folder is made by the run), or on one of the
    versions of the run in `run_dir` (a file measured on `policies/vNNNNNN` names that version,
    see `version_of`). `published(version)`: the signed manifest the run's store keeps of a
    version it published (None: never published), for versions the trainer has pruned; given by
    the orchestrator's layer, which owns the store. Raises LimitsError naming what differs and
    the command that makes the right one."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise LimitsError(
            f"validator.limits_file {p}: cannot be read as JSON ({e}); make one with swarmrl calibrate"
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise LimitsError(f"validator.limits_file {p}: not a limits file ({FORMAT}); make one with swarmrl calibrate")
    if data.get("dtype") != dtype:
        raise LimitsError(
            f"validator.limits_file {p} was calibrated for {data.get('dtype')} but this run samples in {dtype} "
            f"(sampling.dtype): run swarmrl calibrate --dtype {dtype} for this model"
        )
    have = (data.get("model") or {}).get("digest")
    if (
        digest is not None
        and have != digest
        and not _a_run_version(p, data.get("model") or {}, digest, run_dir, published)
    ):
        raise LimitsError(
            f"validator.limits_file {p} was calibrated on another model (content digest {str(have)[:12]}…, "
            f"this run's model is {digest[:12]}…, and no version of this run has that digest): limits do not "
            "carry over between models; run swarmrl calibrate on this model, or on a version of this run "
            "(--model RUN_DIR/policies/vNNNNNN)"
        )
    for engine, entry in (data.get("engines") or {}).items():
        try:
            for d in entry.get("evidence") or []:
                EvidenceModel.from_dict(d)
        except (KeyError, TypeError, ValueError) as e:
            raise LimitsError(f"validator.limits_file {p}: engine {engine}'s evidence is malformed ({e})") from None
        if not isinstance(entry.get("limits"), dict):
            raise LimitsError(f"validator.limits_file {p}: engine {engine} has no limits")
    try:  # the drift watch reads the honest statistics: all numbers, or the file is refused whole
        for groups in ((data.get("measured") or {}).get("honest") or {}).values():
            for g in groups:
                [float(v) for v in g.values()]
    except (AttributeError, TypeError, ValueError) as e:
        raise LimitsError(f"validator.limits_file {p}: its measured honest statistics are malformed ({e})") from None
    if any(k in entry["limits"] for entry in data["engines"].values() for k in RETIRED_LIMITS):
        data = _chosen_again(p, data)
    return data


def evidence_identity(limits: dict) -> dict[str, str]:
    """Per accepted engine, sha256 of its evidence models: what a key's CUSUM for that engine is
    summed under. Files with the same identity score keys alike (their hard limits may differ)."""
    return {
        name: hashlib.sha256(json.dumps(e.get("evidence") or [], sort_keys=True).encode()).hexdigest()
        for name, e in sorted((limits.get("engines") or {}).items())
        if not e.get("refused")
    }


def version_of(folder: str | Path) -> int | None:
    """The policy version a folder holds when it is a run's version folder (named vNNNNNN, as
    under a run directory's policies/ and a worker's cache), else None."""
    m = re.fullmatch(r"v(\d{6})", Path(folder).resolve().name)
    return int(m.group(1)) if m else None


def _a_run_version(
    p: Path, model: dict, start_digest: str, run_dir: Path | None, published: Callable[[int], dict | None] | None
) -> bool:
    """Whether a limits file measured on a policy version (`model["version"]`) was measured on
    this run's: that version, as the trainer wrote it, has the file's content digest, and an
    adapter's base is this run's starting model. A policy keeps drifting from the weights the
    limits were first measured on (docs/validation.md, 'Drift'); an operator measures them
    again on a later version, and the run takes that file at start or while it runs."""
    version = model.get("version")
    if version is None or run_dir is None:
        return False
    if model.get("base_digest") not in (None, start_digest):
        return False
    try:
        have = _version_digest(Path(run_dir), int(version), published)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LimitsError(
            f"validator.limits_file {p}: could not read policy version {version} of this run ({e})"
        ) from None
    if have is None:
        raise LimitsError(
            f"validator.limits_file {p} was calibrated on policy version {version}, which this run never "
            "published (another run's version?): calibrate on a version of this run"
        )
    return have == model.get("digest")


def _version_digest(run_dir: Path, version: int, published: Callable[[int], dict | None] | None) -> str | None:
    """A version's content digest as this run's trainer wrote it: its folder under policies/
    while the trainer keeps it, else the signed manifest the orchestrator's store keeps of every
    version published (versions are pruned after a few steps, and a run resumed later must still
    take the file it took). None: this run has no such version."""
    folder = run_dir / "policies" / f"v{version:06d}"
    if folder.is_dir():
        return model_digest(folder)
    manifest = published(version) if published is not None else None
    return manifest_model_digest(manifest) if manifest else None


def _chosen_again(p: Path, data: dict) -> dict:
    """A file whose limits were chosen under an earlier rule (one of RETIRED_LIMITS among them),
    chosen again from the statistics it measured with its own false-ban rate and horizon: a limit
    retired because it refused honest work leaves cheats it alone refused to a new evidence test,
    which only a new choice makes (the replays of `swarmrl calibrate --measured` are left out)."""
    m = data.get("measured") or {}
    if not (m.get("honest") and m.get("cheats")):
        raise LimitsError(
            f"validator.limits_file {p} was chosen with {', '.join(RETIRED_LIMITS)}, which this version no longer "
            "applies, and holds no measured statistics to choose again from: run swarmrl calibrate again"
        )
    chosen = choose_limits(
        m["honest"],
        m["cheats"],
        false_ban_rate=float(data.get("false_ban_rate", 1e-6)),
        horizon=int(data.get("horizon", 100_000)),
        max_groups_to_ban=float(data.get("max_groups_to_ban", 64.0)),
    )
    return {**data, **chosen, "chosen_again": f"on load: {', '.join(RETIRED_LIMITS)} retired"}


# What a bf16 run on a model without a calibration is told (docs/validation.md, "Calibrating a run").
NO_CALIBRATION = (
    "this run samples in bfloat16 (sampling.dtype) on {model}, and validator.limits_file is not set: the shipped "
    "bfloat16 limits were measured on the built-in 4-layer model, and on a deeper model they refuse honest work "
    "or pass quantised work (docs/validation.md, 'Calibrating a run'). Measure this model first: swarmrl "
    "calibrate --model {model} --dtype bfloat16 --engines builtin --out limits.json (about 45 minutes for "
    "SmolLM2-135M on 2 cores; add vllm to --engines, from .venv-vllm, if vLLM workers will join), then set "
    'validator.limits_file = "limits.json"; or run in float32'
)


def run_limits(
    cfg,
    model_folder: str | Path | None,
    run_dir: str | Path | None = None,
    published: Callable[[int], dict | None] | None = None,
) -> dict | None:
    """The limits file a run validates with, checked against its model and dtype (None: the run
    has none and may go without: float32, or the built-in model whose limits ship in the config).
    `model_folder` is the run's starting model (None: not at hand, its digest is not checked);
    `run_dir`, where the run has one, lets a file measured on one of its versions through
    (`published`: see `load_limits`). Raises LimitsError with the command to run."""
    v = cfg.validator
    if v.limits_file:
        digest = model_digest(model_folder) if model_folder is not None and Path(model_folder).is_dir() else None
        data = load_limits(
            v.limits_file,
            dtype=cfg.sampling.dtype,
            digest=digest,
            run_dir=Path(run_dir) if run_dir else None,
            published=published,
        )
        _check_sampling(v.limits_file, data.get("sampling"), cfg.sampling)
        if all(e.get("refused") for e in data["engines"].values()):
            # No worker could submit a proven group: say why now, not as every group's refusal.
            raise LimitsError(
                f"validator.limits_file {v.limits_file} accepts no engine: "
                + "; ".join(e["refused"] for e in data["engines"].values())
            )
        return data
    if cfg.sampling.dtype == "bfloat16" and cfg.model.path:
        raise LimitsError(NO_CALIBRATION.format(model=cfg.model.path))
    return None


def _check_sampling(path, measured: dict | None, sampling) -> None:
    """A group's statistics depend on its size, its completions' length and the temperature: limits
    measured with others than the run's do not hold for it (a file without them is not checked)."""
    if not measured:
        return
    run = {
        "group_size": sampling.group_size,
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
    }
    differ = {k: (measured.get(k), v) for k, v in run.items() if measured.get(k) != v}
    if differ:
        said = ", ".join(f"{k} {a} (this run: {b})" for k, (a, b) in differ.items())
        flags = " ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in run.items())
        raise LimitsError(
            f"validator.limits_file {path} was measured with {said}: statistics of other groups do not follow "
            f"its limits. Run swarmrl calibrate again with {flags}"
        )
