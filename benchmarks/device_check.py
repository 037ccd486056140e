"""GPU check (run on a CUDA machine; not a test): the CUDA paths of the sampler and the trainer.

Checks and figures, printed and written as JSON to --out:
  noise        seeded Gumbel noise on CUDA vs CPU: integer hash bit-identical, float noise max diff,
               and whether the seeded choice over random logits agrees everywhere
  cpu_vs_cuda  tiny fp32 model: the same seeds give the same tokens on CPU and CUDA; logprob and
               hidden-state max differences (what TOPLOC and logprob checks must tolerate)
  sampler      a ~200M-parameter Qwen2 in bf16: project sampler vs HF generate, tokens/s
  mismatch     bf16 sampler logprobs vs a bf16 prefill of the same tokens (inference/trainer gap)
  trainer      one GRPO rollout step in bf16 on CUDA: time, tokens/s, finite metrics

Needs only torch, transformers, pydantic and tomli_w (no math-verify): rewards are synthetic.
Usage: python benchmarks/device_check.py --out device_check.json
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from swarmrl.config import load_config
from swarmrl.inference.sampler import Sampler
from swarmrl.inference.seeded import seeded_choice, stream_keys, uniform_noise
from swarmrl.model.checkpoint import build_tiny_policy
from swarmrl.protocol.rollouts import Group, Sample
from swarmrl.trainer.batch import build_train_batch
from swarmrl.trainer.grpo import GRPOTrainer


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
    results["noise"] = {"keys_identical": bool(torch.equal(k_cpu, k_gpu)),
                        "uniform_identical": bool(torch.equal(u_cpu, u_gpu)),
                        "choice_agreement": float((c_cpu == c_gpu).float().mean())}


def check_cpu_vs_cuda(results):
    model, tok = build_tiny_policy(seed=3)
    model.eval()
    prompts = [tok(f"Compute {a} + {a * 3 % 97}.")["input_ids"] for a in range(32)]
    seeds = list(range(32))
    stop = [tok.eos_token_id]
    cpu = Sampler(model, stop_token_ids=stop, pad_token_id=tok.pad_token_id).generate(
        prompts, seeds, max_new_tokens=48, return_hidden=True)
    gpu_model = model.to("cuda")
    gpu = Sampler(gpu_model, stop_token_ids=stop, pad_token_id=tok.pad_token_id).generate(
        prompts, seeds, max_new_tokens=48, return_hidden=True)
    same = sum(a.token_ids == b.token_ids for a, b in zip(cpu, gpu))
    lp = max(max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) for a, b in zip(cpu, gpu) if a.token_ids == b.token_ids)
    hid = max(float((a.hidden - b.hidden).abs().max()) for a, b in zip(cpu, gpu) if a.token_ids == b.token_ids)
    results["cpu_vs_cuda"] = {"completions": 32, "identical_tokens": same, "logprob_max_abs_diff": lp,
                              "hidden_max_abs_diff": hid}


def medium_model(vocab: int) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                      tie_word_embeddings=True, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


def check_sampler(results, model, batch=64, new=256):
    vocab = model.config.vocab_size
    # 8 prompts x 8 samples each, so the same outputs form GRPO groups for the trainer check.
    prompts = [[1] + [random.Random(i // 8).randrange(5, vocab) for _ in range(31)] for i in range(batch)]
    # A stop id the model can never emit, so both sides generate exactly `new` tokens.
    ours = Sampler(model, stop_token_ids=[vocab], pad_token_id=0)
    ours.generate(prompts[:4], list(range(4)), max_new_tokens=8)
    sync(); t = time.perf_counter()
    outs = ours.generate(prompts, list(range(batch)), max_new_tokens=new)
    sync(); t_ours = time.perf_counter() - t
    ids = torch.tensor(prompts, device="cuda")
    gen_kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  pad_token_id=0)
    model.generate(ids[:4], attention_mask=torch.ones_like(ids[:4]), **{**gen_kw, "max_new_tokens": 8, "min_new_tokens": 8})
    sync(); t = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), **gen_kw)
    sync(); t_hf = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    results["sampler"] = {"params_m": sum(p.numel() for p in model.parameters()) / 1e6, "batch": batch,
                          "new_tokens": new, "ours_tok_s": n / t_ours, "hf_tok_s": batch * new / t_hf,
                          "ours_over_hf": (n / t_ours) / (batch * new / t_hf)}
    return prompts, outs


def check_mismatch_and_trainer(results, model, prompts, outs):
    cfg = load_config(None, ["--model.device", "cuda", "--model.dtype", "bfloat16", "--trainer.micro_batch_size", "16",
                             "--trainer.optimizer_steps", "2", "--sampling.group_size", "8",
                             "--sampling.prompts_per_step", "8", "--sampling.max_new_tokens", "256"])
    rng = random.Random(0)
    groups = []
    for g in range(8):
        block = range(g * 8, g * 8 + 8)
        samples = [Sample(outs[i].token_ids, outs[i].logprobs, outs[i].finish_reason, i) for i in block]
        rewards = [float(rng.random() < 0.5) for _ in block]
        rewards[0], rewards[1] = 1.0, 0.0  # informative
        groups.append(Group(f"p{g}", "synthetic", "", "{}", prompts[g * 8], samples, 0, "dev", 1.0,
                            rewards=rewards, task_rewards=rewards))
    batch = build_train_batch(groups, pad_token_id=0, normalize_std=True, adv_eps=1e-6)
    trainer = GRPOTrainer(model, cfg)
    sync(); t = time.perf_counter()
    metrics = trainer.train_step(batch)
    sync(); dt = time.perf_counter() - t
    results["mismatch"] = {"bf16_sampler_vs_prefill_logprob_abs_diff_mean": metrics["off_policy/logprob_abs_diff"],
                           "max": metrics["off_policy/logprob_abs_diff_max"]}
    results["trainer"] = {"seconds": dt, "tokens": metrics["train/tokens"],
                          "sequences": len(batch), "tokens_per_s": metrics["train/tokens"] / dt,
                          "finite": all(v == v and abs(v) != float("inf") for v in metrics.values()),
                          "loss_policy": metrics["loss/policy"], "grad_norm": metrics["grad_norm"],
                          "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="device_check.json")
    args = p.parse_args()
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    for name, fn in [("noise", lambda: check_noise(results)), ("cpu_vs_cuda", lambda: check_cpu_vs_cuda(results))]:
        t = time.perf_counter(); fn(); print(name, json.dumps(results[name]), f"({time.perf_counter() - t:.1f}s)", flush=True)
    model = medium_model(261)
    prompts, outs = check_sampler(results, model)
    print("sampler", json.dumps(results["sampler"]), flush=True)
    check_mismatch_and_trainer(results, model.train(), prompts, outs)
    print("mismatch", json.dumps(results["mismatch"]), flush=True)
    print("trainer", json.dumps(results["trainer"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
