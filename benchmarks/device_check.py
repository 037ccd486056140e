"""GPU check (run on a CUDA machine; not a test): the CUDA paths of the sampler and the trainer.

Checks and figures, printed and written as JSON to --out:
  noise        seeded Gumbel noise on CUDA vs CPU: integer hash bit-identical, float noise max diff,
               and whether the seeded choice over random logits agrees everywhere
  cpu_vs_cuda  tiny fp32 model: the same seeds give the same tokens on CPU and CUDA; logprob and
               hidden-state max differences (what TOPLOC and logprob checks must tolerate)
  sampler      a ~200M-parameter Qwen2 in bf16: project sampler vs HF generate, tokens/s
  mismatch     bf16 sampler logprobs vs a bf16 prefill of the same tokens (inference/trainer gap)
  trainer      one GRPO rollout step in pure bf16 (trainer.precision "bf16") on CUDA: time,
               tokens/s, finite metrics
  precision    one GRPO rollout step on a random Qwen2 of Qwen2-0.5B's shape (494M parameters,
               vocab 151936) per trainer.precision: fp32, mixed (float32 master weights and AdamW
               state, bf16 compute), mixed with activation checkpointing, pure bf16; time,
               tokens/s, peak memory, the dtypes of masters / AdamW state / published weights,
               and each grad norm against fp32's
  fsdp2        with 2+ GPUs: the mixed step under torchrun on 2 ranks (nccl, FSDP2's
               MixedPrecisionPolicy, and again with CPU offload) against one process; with one
               GPU it is skipped (nccl needs a GPU per rank) and `precision` is the 1-GPU run

Needs only torch, transformers, pydantic and tomli_w (no math-verify): rewards are synthetic.
Usage: python benchmarks/device_check.py --out device_check.json
       python benchmarks/device_check.py --smoke-cpu   # the precision check's plumbing on CPU, tiny model

UNTESTED on CUDA: `precision` and `fsdp2` were written without a device machine (issue 17); only
`--smoke-cpu` (the same code on a tiny model on CPU) and an import check have run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from swarmrl.config import load_config
from swarmrl.inference.sampler import Sampler
from swarmrl.inference.seeded import seeded_choice, stream_keys, uniform_noise
from swarmrl.model.checkpoint import build_tiny_policy
from swarmrl.protocol.rollouts import Group, Sample, scored_group
from swarmrl.trainer.batch import build_train_batch
from swarmrl.trainer.grpo import GRPOTrainer, init_distributed


def sync():
    torch.cuda.synchronize()


def check_noise(results):
    seeds = torch.arange(64, dtype=torch.int64) * 7919 + 2**40
    steps = torch.arange(64, dtype=torch.int64)
    k_cpu, k_gpu = stream_keys(seeds, steps), stream_keys(seeds.cuda(), steps.cuda()).cpu()
    u_cpu, u_gpu = uniform_noise(seeds, steps, 152064), uniform_noise(seeds.cuda(), steps.cuda(), 152064).cpu()
    logits = torch.randn(64, 152064)
    c_cpu = seeded_choice(logits, seeds, steps, 1.0)
    c_gpu = seeded_choice(logits.cuda(), seeds.cuda(), steps.cuda(), 1.0).cpu()
    results["noise"] = {
        "keys_identical": bool(torch.equal(k_cpu, k_gpu)),
        "uniform_identical": bool(torch.equal(u_cpu, u_gpu)),
        "choice_agreement": float((c_cpu == c_gpu).float().mean()),
    }


def check_cpu_vs_cuda(results):
    model, tok = build_tiny_policy(seed=3)
    model.eval()
    prompts = [tok(f"Compute {a} + {a * 3 % 97}.")["input_ids"] for a in range(32)]
    seeds = list(range(32))
    stop = [tok.eos_token_id]
    cpu = Sampler(model, stop_token_ids=stop, pad_token_id=tok.pad_token_id).generate(
        prompts, seeds, max_new_tokens=48, return_hidden=True
    )
    gpu_model = model.to("cuda")
    gpu = Sampler(gpu_model, stop_token_ids=stop, pad_token_id=tok.pad_token_id).generate(
        prompts, seeds, max_new_tokens=48, return_hidden=True
    )
    same = sum(a.token_ids == b.token_ids for a, b in zip(cpu, gpu))
    lp = max(
        max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) for a, b in zip(cpu, gpu) if a.token_ids == b.token_ids
    )
    hid = max(float((a.hidden - b.hidden).abs().max()) for a, b in zip(cpu, gpu) if a.token_ids == b.token_ids)
    results["cpu_vs_cuda"] = {
        "completions": 32,
        "identical_tokens": same,
        "logprob_max_abs_diff": lp,
        "hidden_max_abs_diff": hid,
    }


def medium_model(vocab: int) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


def check_sampler(results, model, batch=64, new=256):
    vocab = model.config.vocab_size
    # 8 prompts x 8 samples each, so the same outputs form GRPO groups for the trainer check.
    prompts = [[1] + [random.Random(i // 8).randrange(5, vocab) for _ in range(31)] for i in range(batch)]
    # A stop id the model can never emit, so both sides generate exactly `new` tokens.
    ours = Sampler(model, stop_token_ids=[vocab], pad_token_id=0)
    ours.generate(prompts[:4], list(range(4)), max_new_tokens=8)
    sync()
    t = time.perf_counter()
    outs = ours.generate(prompts, list(range(batch)), max_new_tokens=new)
    sync()
    t_ours = time.perf_counter() - t
    ids = torch.tensor(prompts, device="cuda")
    gen_kw = dict(
        max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0
    )
    model.generate(
        ids[:4], attention_mask=torch.ones_like(ids[:4]), **{**gen_kw, "max_new_tokens": 8, "min_new_tokens": 8}
    )
    sync()
    t = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), **gen_kw)
    sync()
    t_hf = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    results["sampler"] = {
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "batch": batch,
        "new_tokens": new,
        "ours_tok_s": n / t_ours,
        "hf_tok_s": batch * new / t_hf,
        "ours_over_hf": (n / t_ours) / (batch * new / t_hf),
    }
    return prompts, outs


def check_mismatch_and_trainer(results, model, prompts, outs):
    cfg = load_config(
        None,
        [
            "--model.device",
            "cuda",
            "--trainer.precision",
            "bf16",
            "--trainer.micro_batch_size",
            "16",
            "--trainer.optimizer_steps",
            "2",
            "--sampling.group_size",
            "8",
            "--sampling.prompts_per_step",
            "8",
            "--sampling.max_new_tokens",
            "256",
        ],
    )
    rng = random.Random(0)
    groups = []
    for g in range(8):
        block = range(g * 8, g * 8 + 8)
        samples = [
            Sample(token_ids=outs[i].token_ids, logprobs=outs[i].logprobs, finish_reason=outs[i].finish_reason, seed=i)
            for i in block
        ]
        rewards = [float(rng.random() < 0.5) for _ in block]
        rewards[0], rewards[1] = 1.0, 0.0  # informative
        groups.append(scored_group(f"p{g}", prompts[g * 8], samples, rewards, worker="dev"))
    batch = build_train_batch(groups, pad_token_id=0, normalize_std=True, adv_eps=1e-6)
    trainer = GRPOTrainer(model, cfg)
    sync()
    t = time.perf_counter()
    metrics = trainer.train_step(batch)
    sync()
    dt = time.perf_counter() - t
    results["mismatch"] = {
        "bf16_sampler_vs_prefill_logprob_abs_diff_mean": metrics["off_policy/logprob_abs_diff"],
        "max": metrics["off_policy/logprob_abs_diff_max"],
    }
    results["trainer"] = {
        "seconds": dt,
        "tokens": metrics["train/tokens"],
        "sequences": len(batch),
        "tokens_per_s": metrics["train/tokens"] / dt,
        "finite": all(v == v and abs(v) != float("inf") for v in metrics.values()),
        "loss_policy": metrics["loss/policy"],
        "grad_norm": metrics["grad_norm"],
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30,
    }


# ---- trainer precision (issue 17) -------------------------------------------------------------
QWEN2_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    rope_theta=1e6,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=261,
)  # --smoke-cpu


def random_qwen2(shape: dict, device: str) -> Qwen2ForCausalLM:
    """Random weights, float32 (what a mixed-precision trainer loads: its masters)."""
    cfg = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(device)


def synthetic_groups(n_groups: int, group_size: int, prompt_len: int, max_completion: int, vocab: int) -> list[Group]:
    """Random prompts and completions of mixed lengths, each group with both rewards (informative)."""
    rng = random.Random(0)
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(5, vocab) for _ in range(prompt_len)]
        samples = []
        for s in range(group_size):
            n = rng.randint(max_completion // 4, max_completion)
            ids = [rng.randrange(5, vocab) for _ in range(n)]
            samples.append(Sample(token_ids=ids, logprobs=[-1.0] * n, finish_reason="stop", seed=g * group_size + s))
        rewards = [float(rng.random() < 0.5) for _ in range(group_size)]
        rewards[0], rewards[1] = 1.0, 0.0
        groups.append(scored_group(f"p{g}", prompt, samples, rewards, worker="dev"))
    return groups


def precision_config(
    device: str, precision: str, ac: bool, n_groups: int, group_size: int, max_new: int, extra: list[str] = ()
):
    return load_config(
        None,
        [
            "--model.device",
            device,
            "--trainer.precision",
            precision,
            "--trainer.activation_checkpointing",
            str(ac).lower(),
            "--trainer.micro_batch_size",
            "8",
            "--trainer.optimizer_steps",
            "2",
            "--sampling.group_size",
            str(group_size),
            "--sampling.prompts_per_step",
            str(n_groups),
            "--sampling.max_new_tokens",
            str(max_new),
            *extra,
        ],
    )


def precision_step(
    shape: dict,
    device: str,
    precision: str,
    ac: bool,
    *,
    n_groups: int = 8,
    group_size: int = 8,
    prompt_len: int = 64,
    max_new: int = 512,
    dist_info=None,
    extra: list[str] = (),
) -> dict:
    """One GRPO rollout step (old logprobs, 2 optimizer steps) under `trainer.precision`."""
    cuda = device.startswith("cuda")
    cfg = precision_config(device.split(":")[0], precision, ac, n_groups, group_size, max_new, extra)
    model = random_qwen2(shape, device)
    batch = build_train_batch(
        synthetic_groups(n_groups, group_size, prompt_len, max_new, shape["vocab_size"]),
        pad_token_id=0,
        normalize_std=True,
        adv_eps=1e-6,
    )
    trainer = GRPOTrainer(model, cfg, dist_info)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    metrics = trainer.train_step(batch)
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    published = trainer.full_state_dict(torch.bfloat16)
    out = {
        "precision": precision,
        "activation_checkpointing": ac,
        "seconds": dt,
        "tokens": metrics["train/tokens"],
        "sequences": len(batch),
        "tokens_per_s": metrics["train/tokens"] / dt,
        "params_m": sum(p.numel() for p in trainer.model.parameters()) / 1e6,
        "grad_norm": metrics["grad_norm"],
        "loss_policy": metrics["loss/policy"],
        "logprob_abs_diff_max": metrics["off_policy/logprob_abs_diff_max"],
        "finite": all(v == v and abs(v) != float("inf") for v in metrics.values()),
        "master_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
        "optimizer_state_dtypes": sorted(
            {str(v.dtype) for st in trainer.optimizer.state.values() for k, v in st.items() if k != "step"}
        ),
        "published_dtypes": sorted({str(v.dtype) for v in published.values()}) if published else None,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }
    del trainer, model, published
    if cuda:
        torch.cuda.empty_cache()
    return out


def check_precision(results, shape: dict, device: str, **kw):
    runs = [
        precision_step(shape, device, prec, ac, **kw)
        for prec, ac in (("fp32", False), ("mixed", False), ("mixed", True), ("bf16", False))
    ]
    ref = runs[0]["grad_norm"]
    for r in runs:
        r["grad_norm_rel_diff_vs_fp32"] = abs(r["grad_norm"] - ref) / max(ref, 1e-12)
    mixed = runs[1]
    results["precision"] = {
        "runs": runs,
        "mixed_masters_fp32": mixed["master_dtypes"] == ["torch.float32"],
        "mixed_state_fp32": mixed["optimizer_state_dtypes"] == ["torch.float32"],
        "checkpointing_grad_norm_rel_diff": abs(runs[2]["grad_norm"] - mixed["grad_norm"])
        / max(mixed["grad_norm"], 1e-12),
    }


def _fsdp_worker(out: str, offload: bool) -> None:
    """Under torchrun: the mixed step on this rank's GPU; rank 0 writes the figures."""
    info = init_distributed("cuda")
    extra = ["--trainer.nproc", os.environ["WORLD_SIZE"]] + (["--trainer.cpu_offload", "true"] if offload else [])
    r = precision_step(QWEN2_05B, info.device("cuda"), "mixed", False, dist_info=info, extra=extra)
    peaks = [None] * info.world_size
    torch.distributed.all_gather_object(peaks, r["peak_mem_gb"])
    if info.is_main:
        Path(out).write_text(json.dumps({**r, "world_size": info.world_size, "peak_mem_gb_per_rank": peaks}))
    torch.distributed.destroy_process_group()


def check_fsdp2(results):
    gpus = torch.cuda.device_count()
    if gpus < 2:
        results["fsdp2"] = {"skipped": f"{gpus} GPU: nccl needs one GPU per rank; `precision` is the 1-GPU run"}
        return
    one = results["precision"]["runs"][1]  # mixed, one process
    out = {}
    for offload in (False, True):
        path = Path(f"device_check_fsdp2_{int(offload)}.json")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "1",
                "--nproc_per_node",
                "2",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                __file__,
                "--fsdp-worker",
                str(path),
            ]
            + (["--offload"] if offload else []),
            capture_output=True,
            text=True,
            timeout=1200,
        )
        if proc.returncode != 0:
            out["offload" if offload else "plain"] = {"error": proc.stderr[-3000:]}
            continue
        r = json.loads(path.read_text())
        r["grad_norm_rel_diff_vs_one_process"] = abs(r["grad_norm"] - one["grad_norm"]) / max(one["grad_norm"], 1e-12)
        out["offload" if offload else "plain"] = r
    results["fsdp2"] = out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="device_check.json")
    p.add_argument("--smoke-cpu", action="store_true", help="only the precision check, tiny model, on CPU")
    p.add_argument("--fsdp-worker", help=argparse.SUPPRESS)  # internal: one torchrun rank of check_fsdp2
    p.add_argument("--offload", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.fsdp_worker:
        _fsdp_worker(args.fsdp_worker, args.offload)
        return
    if args.smoke_cpu:
        results = {}
        check_precision(results, TINY, "cpu", n_groups=2, group_size=4, prompt_len=8, max_new=16)
        print(json.dumps(results, indent=1))
        return
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    for name, fn in [("noise", lambda: check_noise(results)), ("cpu_vs_cuda", lambda: check_cpu_vs_cuda(results))]:
        t = time.perf_counter()
        fn()
        print(name, json.dumps(results[name]), f"({time.perf_counter() - t:.1f}s)", flush=True)
    model = medium_model(261)
    prompts, outs = check_sampler(results, model)
    print("sampler", json.dumps(results["sampler"]), flush=True)
    check_mismatch_and_trainer(results, model.train(), prompts, outs)
    print("mismatch", json.dumps(results["mismatch"]), flush=True)
    print("trainer", json.dumps(results["trainer"]), flush=True)
    del model
    torch.cuda.empty_cache()
    t = time.perf_counter()
    check_precision(results, QWEN2_05B, "cuda")
    print("precision", json.dumps(results["precision"]), f"({time.perf_counter() - t:.1f}s)", flush=True)
    check_fsdp2(results)
    print("fsdp2", json.dumps(results["fsdp2"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
