"""Generate with the proving vLLM engine (swarmrl/inference/vllm_engine.py) and write what a worker
would submit, hidden states included, as JSON: run by vLLM's environment's python for the real
tier (tests/real/test_vllm_proofs.py) and benchmarks/bench_vllm_proofs.py.

    .venv-vllm/bin/python tests/support/vllm_rows.py --spec spec.json --out out.json

spec: {"versions": [folder, ...], "dtype": "float32", "stop": [id], "phases": [{"version": i,
"prompts": [[ids]], "seeds": [s], "temperature": T, "max_new_tokens": n}, ...]}. Phases run in
order; a phase on another version loads it in place first (no restart). The output holds, per
phase, each completion's token ids, logprobs, finish reason and hidden states, and the seconds
the generate call took.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from swarmrl.inference.vllm_engine import VllmEngine


def read_spec(doc: str) -> tuple[dict, Path]:
    """What a script run by vLLM's python is asked (--spec FILE) and where it answers (--out FILE)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    return json.loads(Path(args.spec).read_text()), Path(args.out)


def main() -> None:
    spec, out = read_spec(__doc__)
    versions = [Path(v) for v in spec["versions"]]
    dtype, batch = spec.get("dtype", "float32"), spec.get("max_batch", 64)
    engine = VllmEngine(versions[0], dtype=dtype, stop_token_ids=spec["stop"], max_batch=batch)
    loaded, phases = 0, []
    for phase in spec["phases"]:
        if phase["version"] != loaded:
            engine.load(versions[phase["version"]])
            loaded = phase["version"]
        t0 = time.perf_counter()
        outs = engine.generate(
            phase["prompts"],
            phase["seeds"],
            max_new_tokens=phase["max_new_tokens"],
            temperature=phase["temperature"],
            return_hidden=True,
        )
        seconds = time.perf_counter() - t0
        phases.append(
            {
                "seconds": seconds,
                "completions": [
                    {
                        "token_ids": o.token_ids,
                        "logprobs": o.logprobs,
                        "finish_reason": o.finish_reason,
                        "hidden": o.hidden.float().tolist(),
                        "hidden_dtype": str(o.hidden.dtype).removeprefix("torch."),
                    }
                    for o in outs
                ],
            }
        )
    out.write_text(json.dumps({"phases": phases}))


if __name__ == "__main__":
    main()
