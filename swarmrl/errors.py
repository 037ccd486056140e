"""The errors whose message is meant for the person running swarmrl.

`SwarmrlError` is their base: its message says what is wrong and what to do, so a command prints
it as one line and exits, without a traceback (`swarmrl.cli.main` catches it for every command;
a role that must do more on its way out, as the trainer recording why it stopped, catches its own
first). A class that was a `ValueError` or `RuntimeError` before keeps that base too, so every
`except ValueError` that caught it still does.

Errors about a request or a peer (a refused body, a bad proof, a failed signature) are not
these: they are answered to the peer, not printed for the user.
"""

from __future__ import annotations


class SwarmrlError(Exception):
    """An error meant for the user: its message says what is wrong and what to do. Commands print
    it as `swarmrl: error: <message>` (or their own one-line prefix) without a traceback."""


class WrongPrecision(SwarmrlError):
    """The run samples in another dtype than the one this worker or validator was told to use
    (its --dtype); the message names both and says how to restart."""
