"""The warm start's precision and thread settings, and the cache key they shape."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from swarmrl.config import load_config
from swarmrl.sft.warmstart import base_cache_key, train_sft


def test_cache_key_keeps_old_bases_and_separates_new_settings():
    default = base_cache_key(load_config(None, []))
    assert default.endswith("-seed0")  # bases cached before dtype/threads existed stay valid
    assert base_cache_key(load_config(None, ["--sft.dtype", "float64"])) == default + "-float64"
    assert base_cache_key(load_config(None, ["--sft.threads", "1"])) == default + "-t1"


def test_float64_warm_start_saves_float32_and_records_how(tmp_path):
    torch_threads = torch.get_num_threads()
    try:
        small = ["--sft.steps", "3", "--sft.batch_size", "4", "--sft.examples", "32", "--sft.threads", "1"]
        runs = {}
        for dtype in ("float32", "float64"):
            cfg = load_config(None, [*small, "--sft.dtype", dtype])
            out = train_sft(cfg, tmp_path / dtype, log=lambda msg: None)
            runs[dtype] = load_file(str(out / "model.safetensors"))
            meta = json.loads((out / "swarmrl_sft.json").read_text())
            assert meta["dtype"] == dtype and meta["threads"] == 1 and meta["cpu_capability"]
        assert all(t.dtype == torch.float32 for t in runs["float64"].values())
        # Same start, same batches: after 3 steps the two precisions agree closely but not exactly.
        diff = max(float((runs["float32"][k] - runs["float64"][k]).abs().max()) for k in runs["float32"])
        assert 0.0 < diff < 1e-3
    finally:
        torch.set_num_threads(torch_threads)
