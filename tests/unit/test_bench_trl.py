"""The arithmetic of benchmarks/bench_trl.py's report: the share of the matmul limit a step
reaches and the time to a held-out gain, on hand-checked numbers (the benchmark itself runs
both trainers and is no test)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_trl import add_share, time_to_gain, time_to_gain_interpolated  # noqa: E402


class _TinyModel(torch.nn.Module):
    """1 layer, 2 heads of width 2, vocabulary 10, tied embeddings: 16 weights in the block and
    40 in the output layer (the embedding table, read once more as the head)."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(
            vocab_size=10, hidden_size=4, num_attention_heads=2, num_hidden_layers=1, tie_word_embeddings=True
        )
        self.embed_tokens = torch.nn.Embedding(10, 4)
        self.block = torch.nn.Linear(4, 4, bias=False)


def test_share_counts_sampling_and_lora_training_passes_over_the_steady_step():
    work = {"prompt_tokens": 6.0, "model": _TinyModel(), "completions": 2, "train_passes": 2}
    r = {"s_per_step": 5.33, "step_walls": [10.0, 2.0, 4.0], "completion_tokens": 4.0}
    add_share(r, work, limit_gflops=1e-5)
    # per token at context 6 + 4/2 = 8: 2 x (16 + 40) + 4 x 1 layer x 2 heads x 2 wide x 8 = 240
    # per step: 2 completions x (6 + 4) tokens x 240 x (1 sampling + 2 training) = 14,400 FLOPs
    assert r["s_per_step_steady"] == pytest.approx(3.0)  # step 1 left out
    assert r["model_gflop_per_step"] == pytest.approx(1.44e-5)
    assert r["matmul_share"] == pytest.approx(1.44e-5 / 3.0 / 1e-5)


def test_share_of_a_one_step_run_uses_its_only_step_and_none_without_lengths():
    work = {"prompt_tokens": 6.0, "model": _TinyModel(), "completions": 2, "train_passes": 3}
    r = {"s_per_step": 7.0, "step_walls": [7.0], "completion_tokens": None}
    add_share(r, work, limit_gflops=1.0)
    assert r["s_per_step_steady"] == 7.0
    assert r["model_gflop_per_step"] is None and r["matmul_share"] is None


def test_time_to_gain_is_the_first_evaluation_at_or_past_the_gain():
    curve = [
        {"wall_s": 0.0, "accuracy": 0.25},
        {"wall_s": 3.0, "accuracy": 0.40},
        {"wall_s": 6.0, "accuracy": 0.45},  # +0.20: reached (within 1e-9)
        {"wall_s": 9.0, "accuracy": 0.70},
    ]
    assert time_to_gain(curve, 0.20) == 6.0
    assert time_to_gain(curve, 0.50) is None


def test_interpolated_time_to_gain_is_linear_between_the_evaluations_around_the_crossing():
    curve = [
        {"wall_s": 0.0, "accuracy": 0.25},
        {"wall_s": 3.0, "accuracy": 0.35},  # +0.10
        {"wall_s": 6.0, "accuracy": 0.55},  # +0.30: +0.20 is half way from 3 s to 6 s
        {"wall_s": 9.0, "accuracy": 0.70},
    ]
    assert time_to_gain_interpolated(curve, 0.20) == pytest.approx(4.5)
    assert time_to_gain_interpolated(curve, 0.30) == pytest.approx(6.0)
    assert time_to_gain_interpolated(curve, 0.50) is None
