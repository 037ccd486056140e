"""`swarmrl serve` as a real process on 127.0.0.1 (its URL from --url-file), with an `openai` client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai


class Server:
    def __init__(self, model: Path, run: Path, *extra: str):
        self.url_file = run / "url.json"
        self.log = open(run / "serve.log", "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "swarmrl.cli",
                "serve",
                "--model",
                str(model),
                "--port",
                "0",
                "--url-file",
                str(self.url_file),
                "--threads",
                "1",
                *extra,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        deadline = time.monotonic() + 60
        while not self.url_file.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, (run / "serve.log").read_text()
            time.sleep(0.05)
        info = json.loads(self.url_file.read_text())
        self.url, self.model = info["url"], info["model"]
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=20)
        self.log.close()
