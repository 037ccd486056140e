"""Schemathesis against the live orchestrator's /openapi.json: no input may produce a 5xx.

Every operation is fuzzed four ways: unsigned, signed by a registered worker key (so bodies get
past authentication into the service's own checks), and with the trainer's and the validator's
bearer tokens. The
signer is a `requests` auth hook, so it signs the exact bytes schemathesis sends.
"""

from __future__ import annotations

import httpx
import pytest
import requests
import schemathesis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from swarmrl.protocol.client import TrainerClient, WorkerClient
from swarmrl.protocol.signing import sign_headers

from orchestrator_harness import OrchestratorProcess, make_run_dir, signed_version

pytestmark = pytest.mark.timeout(600)


class Signer(requests.auth.AuthBase):
    def __init__(self, key, run_id: str):
        self.key, self.run_id = key, run_id

    def __call__(self, r):
        body = r.body or b""
        if isinstance(body, str):
            body = body.encode()
        r.headers.update(sign_headers(self.key, self.run_id, r.method, r.path_url.split("?")[0], body))
        return r


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    # High rate limits: the fuzzer itself must not be throttled into only ever seeing 429s.
    run = make_run_dir(
        tmp_path_factory.mktemp("fuzz") / "run",
        "--orchestrator.rate_per_s",
        "10000",
        "--orchestrator.rate_burst",
        "10000",
        "--orchestrator.max_request_bytes",
        "200000",
    )
    proc = OrchestratorProcess(run).start()
    token = (run / "trainer.token").read_text().strip()
    TrainerClient(proc.url, token).publish(0, "http://127.0.0.1:9", signed_version(run, 0))
    key = Ed25519PrivateKey.generate()
    WorkerClient(proc.url, key).register("fuzzer")
    validator = (run / "validator.token").read_text().strip()
    run_id = WorkerClient(proc.url, key).run()
    yield {"proc": proc, "key": key, "token": token, "validator": validator, "run_id": run_id}
    proc.stop()
    assert "internal error" not in proc.log(), proc.log()


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_request_produces_a_server_error(live, mode):
    """Positive: bodies that match the schema; negative: bodies that violate it on purpose."""
    api = schemathesis.openapi.from_url(live["proc"].url + "/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 11
    generation = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    calls = 0
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=generation))
        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case):
            nonlocal calls
            with requests.Session() as session:
                case.call_and_validate(session=session, checks=[not_a_server_error])
                case.call_and_validate(
                    session=session, checks=[not_a_server_error], auth=Signer(live["key"], live["run_id"])
                )
                for token in (live["token"], live["validator"]):
                    case.call_and_validate(
                        session=session, checks=[not_a_server_error], headers={"authorization": f"Bearer {token}"}
                    )
            calls += 4

        try:
            fuzz()
        except Unsatisfiable:
            assert mode == "negative"  # nothing to violate (no parameters, no body): e.g. GET /healthz
    assert calls >= 4 * len(operations) * (1 if mode == "positive" else 0.5)
    assert httpx.get(live["proc"].url + "/healthz").status_code == 200  # still serving
