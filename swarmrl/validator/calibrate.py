"""`swarmrl calibrate`: measure one model's honest work and the cheat catalogue, write a limits file.

Honest groups are sampled the way workers sample them, through each engine the run will accept
(seeded, with hidden states; proofs built by the worker's code), from the model's own prompts
under its chat template, and judged by the validator's own prefill and checks
(`Validator.prefill`, `reports`, `judge`). The cheats each claim the model:

  int8_per_row, int8_per_32, int4_per_32   its weights fake-quantised (a scale per output row or
                                           per 32 inputs), sampled by the built-in engine
  other_model                              a LoRA-perturbed copy (rank 16, 1% of each weight's norm)
  edited_tokens                            honest groups with one token per completion changed,
                                           proofs and logprobs rebuilt for the edit
  edited_logprobs                          honest groups reporting every logprob at half its value
  previous_version                         the model one optimizer step away (every weight moved by
                                           `previous_lr`, Adam's first-step size), sampled by the
                                           built-in engine: measured and reported, never used to
                                           refuse an engine (limits.INFORMATIONAL says why)

Cheats are measured once: the validator's prefill does not depend on what a worker declares, so
the same cheat groups are what a cheat declaring any engine sends. `calibration.choose_limits`
then turns the statistics into limits, evidence models and refusals per engine.
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path

import torch

from swarmrl.config import ValidatorConfig
from swarmrl.config.training import LORA_TARGETS_DEFAULT
from swarmrl.inference.engine import build_engine
from swarmrl.model.altered import quantised, stepped
from swarmrl.model.checkpoint import base_folder, is_adapter, load_policy, save_policy
from swarmrl.proofs.limits import (
    FORMAT,
    ban_times,
    choose_limits,
    cpu_kind,
    honest_peaks,
    model_digest,
    replay_bans,
    separation,
    version_of,
)
from swarmrl.proofs.toploc import build_proofs_many, encode
from swarmrl.protocol.messages import ClaimedGroup, ClaimedSample
from swarmrl.validator.checks import token_logprobs
from swarmrl.validator.core import Validator, prefill

CHEATS = (
    "int8_per_row",
    "int8_per_32",
    "int4_per_32",
    "other_model",
    "edited_tokens",
    "edited_logprobs",
    "previous_version",
)


def lora_copy(full, relative: float, rank: int = 16, seed: int = 1):
    """Another model of the same vocabulary: every projection trainer.lora adapts by default plus
    a random rank-`rank` update of Frobenius norm `relative` x its own (a differently fine-tuned
    adapter)."""
    new = copy.deepcopy(full).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, m in new.named_modules():
            if name.split(".")[-1] in LORA_TARGETS_DEFAULT:
                out_f, in_f = m.weight.shape
                delta = torch.randn((out_f, rank), generator=gen) @ torch.randn((rank, in_f), generator=gen)
                m.weight.add_(delta * (relative * m.weight.norm() / delta.norm()))
    return new.eval()


def to_items(
    prompts, seeds, outs, vcfg: ValidatorConfig, group_size: int, temperature: float, engine: str
) -> list[ClaimedGroup]:
    """Claimed groups as the validator receives them (proofs built as `inference/worker.py` builds them)."""
    proofs = build_proofs_many([o.hidden for o in outs], chunk_size=vcfg.chunk_size, topk=vcfg.topk)
    items: list[ClaimedGroup] = []
    for i in range(0, len(outs), group_size):
        samples = [
            ClaimedSample(
                token_ids=outs[j].token_ids, logprobs=outs[j].logprobs, seed=seeds[j], proofs=encode(proofs[j])
            )
            for j in range(i, i + group_size)
        ]
        items.append(
            ClaimedGroup(
                id=len(items),
                worker="calibration",
                policy_version=0,
                temperature=temperature,
                prompt_ids=prompts[i],
                samples=samples,
                engine=engine,
            )
        )
    return items


def edited_tokens(
    items: list[ClaimedGroup], model, eos: int, vcfg: ValidatorConfig, temperature: float
) -> list[ClaimedGroup]:
    """The middle token of each completion moved to the next non-end id, then honest proofs and
    logprobs rebuilt for the edited text (what the `edit_tokens` adversary sends)."""
    vocab = model.config.vocab_size
    out = [it.model_copy(deep=True) for it in items]
    for it in out:
        for smp in it.samples:
            ids = list(smp.token_ids)
            if len(ids) >= 2:
                t = (len(ids) - 1) // 2
                new = (ids[t] + 1) % vocab
                ids[t] = new if new != eos else (new + 1) % vocab
            smp.token_ids = ids
        outs = prefill(model, [(it.prompt_ids, [smp.token_ids for smp in it.samples])])[0]
        proofs = build_proofs_many([h for h, _ in outs], chunk_size=vcfg.chunk_size, topk=vcfg.topk)
        for smp, (_, logits), pr in zip(it.samples, outs, proofs):
            tokens = torch.tensor(smp.token_ids)
            smp.logprobs = token_logprobs(logits, tokens, torch.full((len(tokens), 1), temperature)).tolist()
            smp.proofs = encode(pr)
    return out


def edited_logprobs(items: list[ClaimedGroup]) -> list[ClaimedGroup]:
    out = [it.model_copy(deep=True) for it in items]
    for it in out:
        for smp in it.samples:
            smp.logprobs = [lp * 0.5 for lp in smp.logprobs]
    return out


def prompt_ids(tok, prompt: str) -> list[int]:
    """A prompt as the orchestrator leases it without a length target (`tasks.source.model_input`,
    which a unit test holds this to): not imported, because it pulls in the reward packages that
    vLLM's environment, where `--engines vllm` runs, does not have."""
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def read_prompts(path: Path) -> list[str]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(
                    f"{path}:{n}: a row needs a 'prompt' string (the task schema: prompt, verification_info)"
                )
            rows.append(row["prompt"])
    if not rows:
        raise ValueError(f"{path} holds no rows")
    return rows


class Calibration:
    """One calibration run's state: the model in the run's dtype, its prompts, and the validator."""

    def __init__(
        self,
        model_folder: str,
        prompts: list[str],
        *,
        dtype: str,
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        batch_groups: int,
        seed: int,
        work_dir: Path,
        previous_lr: float = 1e-4,
    ):
        self.folder, self.dtype = model_folder, dtype
        self.g, self.max_new, self.temp = group_size, max_new_tokens, temperature
        self.full, self.tok = load_policy(model_folder, dtype=torch.float32)
        self.full.eval()
        self.adapter = is_adapter(model_folder)
        if self.adapter and dtype != "float32":
            # A LoRA version: workers and validators merge the adapter in the run's dtype
            # (load_policy), which is not the float32 merge rounded: measure what they run.
            self.model = load_policy(model_folder, dtype=getattr(torch, dtype))[0].eval()
        else:
            self.model = self.full if dtype == "float32" else copy.deepcopy(self.full).to(getattr(torch, dtype)).eval()
        self.work_dir = work_dir
        self.vcfg = ValidatorConfig(batch_groups=batch_groups)
        self.validator = Validator(self.vcfg, work_dir)
        self.texts, self.rng = prompts, random.Random(seed)
        self.order = self.rng.sample(range(len(prompts)), len(prompts))
        self.taken = 0
        self.previous_lr = previous_lr

    def prompts_for(self, n_groups: int) -> tuple[list[list[int]], list[int]]:
        rows = [self.order[(self.taken + i) % len(self.order)] for i in range(n_groups)]
        self.taken += n_groups
        ps = [prompt_ids(self.tok, self.texts[r]) for r in rows]
        prompts = [p for p in ps for _ in range(self.g)]
        return prompts, [self.rng.getrandbits(63) for _ in prompts]

    def sample(self, engine, prompts, seeds):
        return engine.generate(prompts, seeds, max_new_tokens=self.max_new, temperature=self.temp, return_hidden=True)

    def judge(self, items: list[ClaimedGroup]) -> list[dict]:
        """Verdict statistics of every group, prefilled `batch_groups` at a time as a validator claims them."""
        out, b = [], self.vcfg.batch_groups
        for i in range(0, len(items), b):
            part = items[i : i + b]
            outs = self.validator.prefill(
                self.model, [(it.prompt_ids, [s.token_ids for s in it.samples]) for it in part]
            )
            samples = [s for it in part for s in it.samples]
            temps = [it.temperature for it in part for _ in it.samples]
            reports = self.validator.reports([o for res in outs for o in res], samples, temps)
            pos = 0
            for it in part:
                # Judged under the float32 defaults only for the statistics; the limits come later.
                builtin = it.model_copy(update={"engine": "builtin"})
                v = self.validator.judge(builtin, reports[pos : pos + len(it.samples)], self.dtype)
                out.append(v.stats)
                pos += len(it.samples)
        return out

    def engine(self, name: str, max_batch: int):
        if name == "vllm":
            from swarmrl.inference.vllm_engine import VllmEngine

            folder = Path(self.folder)
            if self.adapter:  # as a vLLM worker loads a LoRA version: merged, saved whole (inference/worker.py)
                folder = save_policy(self.model, self.tok, self.work_dir / "merged")
            return VllmEngine(folder, dtype=self.dtype, stop_token_ids=[self.tok.eos_token_id], max_batch=max_batch)
        return build_engine(self.model, self.tok, kind=name, max_batch=max_batch)

    def honest(self, engine_name: str, groups: int, max_batch: int) -> tuple[list[dict], list[ClaimedGroup], dict]:
        engine = self.engine(engine_name, max_batch)
        prompts, seeds = self.prompts_for(groups)
        t0 = time.perf_counter()
        outs = self.sample(engine, prompts, seeds)
        gen_s = time.perf_counter() - t0
        if hasattr(engine, "close"):
            engine.close()
        items = to_items(prompts, seeds, outs, self.vcfg, self.g, self.temp, engine_name)
        t0 = time.perf_counter()
        stats = self.judge(items)
        val_s = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        timing = {"generate_s": gen_s, "validate_s": val_s, "tokens": tokens}
        return stats, items, timing

    def cheat(self, name: str, groups: int, honest_items: list[ClaimedGroup], max_batch: int) -> list[dict]:
        if name == "edited_tokens":
            return self.judge(
                edited_tokens(honest_items[:groups], self.model, self.tok.eos_token_id, self.vcfg, self.temp)
            )
        if name == "edited_logprobs":
            return self.judge(edited_logprobs(honest_items[:groups]))
        if name == "other_model":
            altered = lora_copy(self.full, 0.01)
        elif name == "previous_version":
            altered = stepped(self.full, self.previous_lr)
        else:
            bits = 4 if name.startswith("int4") else 8
            altered = quantised(self.full, bits, None if name.endswith("per_row") else 32)
        altered = altered.to(getattr(torch, self.dtype)).eval()
        prompts, seeds = self.prompts_for(groups)
        outs = self.sample(build_engine(altered, self.tok, kind="builtin", max_batch=max_batch), prompts, seeds)
        return self.judge(to_items(prompts, seeds, outs, self.vcfg, self.g, self.temp, "builtin"))


def calibrate(
    model_folder: str,
    prompts: list[str],
    *,
    dtype: str,
    engines: list[str],
    groups: int,
    cheat_groups: int,
    group_size: int = 8,
    max_new_tokens: int = 48,
    temperature: float = 1.0,
    max_batch: int = 16,
    batch_groups: int = 4,
    cheats: tuple[str, ...] = CHEATS,
    previous_lr: float = 1e-4,
    false_ban_rate: float = 1e-6,
    horizon: int = 100_000,
    max_groups_to_ban: float = 64.0,
    seed: int = 0,
    work_dir: Path,
    log=print,
) -> dict:
    """The limits file's content (module docstring)."""
    t_start = time.time()
    digest = model_digest(model_folder)
    cal = Calibration(
        model_folder,
        prompts,
        dtype=dtype,
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        batch_groups=batch_groups,
        seed=seed,
        work_dir=work_dir,
        previous_lr=previous_lr,
    )
    honest: dict[str, list[dict]] = {}
    timing: dict[str, dict] = {}
    first_items: list[ClaimedGroup] = []
    for name in engines:
        stats, items, timing[name] = cal.honest(name, groups, max_batch)
        honest[name] = stats
        first_items = first_items or items
        worst = max(s["mant_err_group"] for s in stats)
        log(
            f"calibrate: {name}: {len(stats)} honest groups, worst group statistic {worst:.3g} "
            f"({timing[name]['generate_s']:.0f} s sampling, {timing[name]['validate_s']:.0f} s validating)"
        )
    measured: dict[str, list[dict]] = {}
    for name in cheats:
        t0 = time.perf_counter()
        measured[name] = cal.cheat(name, cheat_groups, first_items, max_batch)
        best = min(s["mant_err_group"] for s in measured[name])
        log(
            f"calibrate: cheat {name}: {len(measured[name])} groups, lowest group statistic {best:.3g} "
            f"({time.perf_counter() - t0:.0f} s)"
        )
    chosen = limits_from(honest, measured, false_ban_rate, horizon, max_groups_to_ban)
    return {
        "format": FORMAT,
        "model": {
            "digest": digest,
            "folder": str(model_folder),
            "layers": int(getattr(cal.full.config, "num_hidden_layers", 0)),
            # A run's version folder (policies/vNNNNNN): a run takes the file for that version of
            # its own (proofs/limits.py, `load_limits`); an adapter's base must be the run's.
            **({"version": version_of(model_folder)} if version_of(model_folder) is not None else {}),
            **({"base_digest": model_digest(base_folder(model_folder))} if cal.adapter else {}),
        },
        "dtype": dtype,
        "cpu": {"kind": cpu_kind(), "threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "sampling": {
            "group_size": group_size,
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "max_batch": max_batch,
            "seed": seed,
            "previous_lr": previous_lr,
        },
        **chosen,
        "separation": separation(honest, measured),
        "measured": {"honest": honest, "cheats": measured},
        "timing": timing,
        "seconds": time.time() - t_start,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def limits_from(
    honest: dict[str, list[dict]], cheats: dict[str, list[dict]], false_ban_rate: float, horizon: int, max_groups: float
) -> dict:
    """The limits, evidence tests and refusals of measured statistics, with each cheat's ban replayed."""
    chosen = choose_limits(honest, cheats, false_ban_rate=false_ban_rate, horizon=horizon, max_groups_to_ban=max_groups)
    for name, entry in chosen["engines"].items():
        entry["bans"] = replay_bans(chosen, name, cheats)
        entry["ban_times"] = ban_times(chosen, name, cheats)
        entry["honest_bootstrap"] = honest_peaks(chosen, name, honest[name])
    return chosen


def rechosen(data: dict, *, false_ban_rate: float, horizon: int, max_groups_to_ban: float) -> dict:
    """An earlier limits file with its limits chosen again from the statistics it measured (another
    false-ban rate or horizon, or this version's choice), without sampling anything."""
    m = data["measured"]
    return {
        **data,
        **limits_from(m["honest"], m["cheats"], false_ban_rate, horizon, max_groups_to_ban),
        "separation": separation(m["honest"], m["cheats"]),
    }


def report(data: dict) -> str:
    """The limits file as an operator reads it: per engine the limits, the evidence statistic, and
    per cheat how it is caught."""
    lines = [
        f"model {data['model']['folder']} ({data['model']['digest'][:12]}…, {data['model']['layers']} layers), "
        f"{data['dtype']}, CPU kind {data['cpu']['kind']}, {data['seconds']:.0f} s"
    ]
    for engine, e in data["engines"].items():
        lines.append(
            f"engine {engine}: {e['honest_groups']} honest groups; limits "
            + ", ".join(f"{k} {v:g}" for k, v in e["limits"].items())
        )
        for ev in e["evidence"]:
            lines.append(f"  evidence on {ev['statistic']} (aimed at {ev['target']}): ban at {ev['bound']:.1f}")
        lines.append(f"  honest peak score {e['honest_peak_score']:.2f}")
        boot = e.get("honest_bootstrap")
        if boot:
            lines.append(
                f"  honest keys of {boot['length']} groups drawn from those ({boot['runs']}): highest score "
                f"{boot['peak_share']:.0%} of the bound, {boot['refused']} groups refused, {boot['banned']} bans"
            )
        for name, row in e["cheats"].items():
            bans = e.get("bans", {}).get(name)
            t = e.get("ban_times", {}).get(name)
            lines.append(
                f"  {name:16s} refused by limits {row['refused_by_limits']}/{row['groups']}"
                + (" (measured for the record: never refuses an engine)" if row.get("informational") else "")
                + (f", about {row['groups_to_ban']:.3g} groups to ban by evidence" if "groups_to_ban" in row else "")
                + (f"; banned at group {bans}" if bans else "; not banned within its groups")
                + (
                    f"; groups to ban over {t['runs']} draws: median {t['median']}, worst {t['worst']}"
                    + (f", {t['never']} never within {t['max_groups']}" if t["never"] else "")
                    if t
                    else ""
                )
            )
        if e.get("refused"):
            lines.append("  REFUSED: " + e["refused"])
    return "\n".join(lines)
