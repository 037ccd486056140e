"""Honest and cheating proving vLLM workers against a real orchestrator, one lease at a time: run
by vLLM's environment's python for tests/real/test_vllm_adversaries.py.

    .venv-vllm/bin/python tests/support/vllm_adversary.py --spec spec.json --out out.json

spec: {"orchestrator": url, "trainer_key": hex, "dtype": "float32", "policies": {"0": status
policy entry, "1": ...}, "attacks": [{"kind": KIND or null (honest), "dir": folder, "leases": n}]}.
Each attack is a `Worker` (null) or an `AdversarialWorker` with `vllm` settings, exactly what
`swarmrl worker --engine vllm [--adversary KIND]` builds, with its own key under `dir`. It loads
v1 (old_version: v0 first, then claims v1), takes `leases` leases and submits what it generates.
One vLLM engine serves them all in turn, each worker loading its (possibly altered) version into
it in place, as a long-running worker loads each new version: one vLLM start instead of one per
cheat. The output holds, per attack, the key, the versions vLLM was given and the submit replies.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_rows import read_spec

from swarmrl.adversary.workers import AdversarialWorker
from swarmrl.inference.backends import VllmOptions
from swarmrl.inference.worker import Worker


def main() -> None:
    spec, out = read_spec(__doc__)
    policies = spec["policies"]
    engine, results = None, []
    for attack in spec["attacks"]:
        kind, folder = attack["kind"], Path(attack["dir"])
        loaded: list[str] = []
        common = dict(
            key_file=folder / "key.pem",
            cache_dir=folder,
            name=f"vllm-{kind or 'honest'}",
            log=lambda msg, loaded=loaded: loaded.append(msg),
            trainer_key=spec["trainer_key"],
            dtype=spec.get("dtype", "float32"),
            engine="vllm",
            engine_options=VllmOptions(kv_cache_gib=1.0),
        )
        w = (
            AdversarialWorker(spec["orchestrator"], kind=kind, **common)
            if kind
            else Worker(spec["orchestrator"], **common)
        )
        w.session.engine = w.sampler = engine  # None for the first: it starts vLLM
        w.client.register(w.name)
        if kind == "old_version":
            assert w._ensure_policy(policies["0"])
        assert w._ensure_policy(policies["1"]) and w.version == 1
        engine = w.sampler
        replies = []
        for _ in range(attack.get("leases", 1)):
            lease = w.client.lease(w.version)["lease"]
            assert lease is not None, "the orchestrator gave no lease"
            sub = w.generate(lease)
            replies.append({"engines": sorted({g.get("engine") for g in sub["groups"]}), **w.client.submit(sub)})
        results.append({"kind": kind, "key": w.client.key_hex, "log": loaded, "replies": replies})
    out.write_text(json.dumps({"attacks": results}))


if __name__ == "__main__":
    main()
