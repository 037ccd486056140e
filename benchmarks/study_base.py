"""Study (not a test): does the SFT base depend on the CPU it was trained on?

The same `swarmrl sft` (same seed, same data) is run with the ATen/MKL kernels pinned to each
instruction set in --isas, which is how one machine stands in for another: a pip torch picks its
vector kernels (AVX-512 on recent Intel Xeons, AVX2 on most AMD EPYCs and older Intel parts) at
run time, and float32 results differ in the last bits between them. Each base is then scored
by `swarmrl eval` on the default held-out split (avg@4, T = 1), and the final weights are compared.

  ATEN_CPU_CAPABILITY     torch's own vectorised kernels (softmax, norms, AdamW, reductions)
  MKL_ENABLE_INSTRUCTIONS the matrix products (MKL sgemm/dgemm)

Each run uses one thread (--threads) so two can share a 2-core machine without oversubscribing
it (two 2-thread OpenMP jobs on 2 cores ran ~10x slower here).

Usage: python benchmarks/study_base.py --isas avx512,avx2 --dtypes float32,float64 --seeds 0 \
           --out /tmp/study_base [extra --sft.FIELD overrides]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from safetensors.torch import load_file

MKL_NAMES = {"avx512": "AVX512", "avx2": "AVX2", "default": None}


def one(isa: str, dtype: str, seed: int, args, extra: list[str], out: Path) -> dict:
    name = f"{isa}-{dtype}-s{seed}"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    if isa != "default":
        env["ATEN_CPU_CAPABILITY"] = isa
        env["MKL_ENABLE_INSTRUCTIONS"] = MKL_NAMES[isa]
    base = out / name
    cli = [sys.executable, "-m", "swarmrl.cli"]
    subprocess.run(
        [
            *cli,
            "sft",
            "--output",
            str(base),
            "--sft.seed",
            str(seed),
            "--sft.dtype",
            dtype,
            "--sft.threads",
            str(args.threads),
            *extra,
        ],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    evals = out / f"{name}-eval"
    subprocess.run(
        [
            *cli,
            "eval",
            "--model",
            str(base),
            "--benchmark",
            "arithmetic",
            "--k",
            "4",
            "--temperature",
            "1.0",
            "--max-tokens",
            "64",
            "--output-dir",
            str(evals),
        ],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    summary = json.loads((evals / "summary.json").read_text())
    meta = json.loads((base / "swarmrl_sft.json").read_text())
    return {
        "isa": isa,
        "dtype": dtype,
        "seed": seed,
        "accuracy": summary["avg@4"],
        "sft_seconds": meta["seconds"],
        "cpu_capability": meta.get("cpu_capability"),
        "path": str(base),
    }


def max_weight_diff(a: str, b: str) -> float:
    wa, wb = load_file(f"{a}/model.safetensors"), load_file(f"{b}/model.safetensors")
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--isas", default="avx512,avx2")
    p.add_argument("--dtypes", default="float32,float64")
    p.add_argument("--seeds", default="0")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--parallel", type=int, default=2, help="runs at a time (each uses --threads threads)")
    p.add_argument("--out", default="study_base")
    args, extra = p.parse_known_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = list(
        itertools.product(args.isas.split(","), args.dtypes.split(","), [int(s) for s in args.seeds.split(",")])
    )
    with ThreadPoolExecutor(args.parallel) as ex:
        results = list(ex.map(lambda c: one(*c, args, extra, out), cells))
    print(f"{'isa':>8} {'dtype':>8} {'seed':>4} {'held-out avg@4':>15} {'sft s':>7}")
    for r in results:
        print(f"{r['isa']:>8} {r['dtype']:>8} {r['seed']:>4} {r['accuracy']:>15.3f} {r['sft_seconds']:>7.0f}")
    # Same dtype and seed, different kernels: how far apart did the weights end up?
    for (dtype, seed), group in itertools.groupby(
        sorted(results, key=lambda r: (r["dtype"], r["seed"])), key=lambda r: (r["dtype"], r["seed"])
    ):
        group = list(group)
        for a, b in itertools.combinations(group, 2):
            d = max_weight_diff(a["path"], b["path"])
            print(
                f"{dtype} seed {seed}: {a['isa']} vs {b['isa']}: accuracy {a['accuracy']:.3f} vs {b['accuracy']:.3f}, "
                f"max |weight difference| {d:.2e}"
            )
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
