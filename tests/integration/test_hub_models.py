"""model.path and --model as a Hub id through the commands (tests/unit/test_hub.py checks the
resolver; tests/e2e/test_rl_e2e.py's TLS run starts from a Hub id and checks the signed commit)."""

from __future__ import annotations

from hub_cache import offline_env
from runs import swarmrl


def test_a_hub_id_missing_from_the_cache_offline_stops_rl_and_eval_naming_the_id_and_the_cache(tmp_path):
    """Nothing is fetched (HF_HUB_OFFLINE): the id and the cache are named, with the fix, and no
    run directory is left half made."""
    hub = tmp_path / "hub"
    hub.mkdir()
    env = offline_env(hub)
    run = tmp_path / "run"
    proc = swarmrl("rl", "--prepare", "--run-dir", str(run), "--model.path", "Org/Missing", check=False, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "model.path Org/Missing is not in the Hugging Face cache" in proc.stderr and str(hub) in proc.stderr
    assert "HF_HUB_OFFLINE is set" in proc.stderr and not (run / "config.toml").exists()
    out = tmp_path / "eval"
    proc = swarmrl(
        "eval", "--model", "Org/Missing", "--benchmark", "arithmetic", "--output-dir", str(out), check=False, env=env
    )
    assert proc.returncode == 2 and "--model Org/Missing is not in the Hugging Face cache" in proc.stderr, proc.stderr
