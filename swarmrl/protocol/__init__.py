"""What the processes of a run agree on: the wire protocol between the orchestrator and its
workers, validators and trainer (docs/protocol.md).

    messages   request and reply bodies (pydantic), shared by server and clients
    rollouts   the group of completions a worker produces, as the trainer receives it
    reasons    why a submission is refused, and which refusals count as fraud
    rules      what a completion must look like (how it terminates)
    signing    worker identity (ed25519) and the signed-request scheme
    client     the HTTP clients of the orchestrator (worker, trainer, validator)
"""

PROTOCOL_VERSION = 3
"""Bumped when a message changes in a way an existing worker would misread (GET /v1/status says it).
2: signed requests are bound to the run (x-swarmrl-run, docs/protocol.md).
3: multi-turn episodes: a leased prompt may name an environment, a sample carries the mask of the
   model's tokens, and a lease request says the worker's protocol version (a worker that does not
   is refused leases in a run with episodes, where its single-turn answers would be fraud)."""

SCHEMA_DIGESTS = {
    # Status grew "plugins" (issue 52), the dashboard "store" (issue 53): replies older clients
    # ignore; POST /v1/rollouts/upload (issue 53) is a new route an older worker never calls. So
    # still version 3.
    3: "f279d0d2c951e73ef742e41db6cd5103b5756b4150b689f30bf660f6410f3cd0",
}
"""`messages.schema_digest()` of each protocol version: the shape of every message, pinned. A change
of a message fails tests/unit/test_protocol.py until it is entered here: under a new
PROTOCOL_VERSION when an existing worker would misread it, or as this version's new digest when it
is compatible (a reply grew a field an older client ignores), saying why in the commit."""

EPISODES_SINCE = 3
"""The first protocol version whose workers can play episodes."""
