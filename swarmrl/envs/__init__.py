"""Environments for multi-turn episodes (issue 31, first stage: the pure layer, not yet wired into
the worker, the orchestrator or the trainer).

An environment is a deterministic function of (task, the model's turns so far, seed): it answers
the latest turn with an observation and says whether the episode is over, and it grades a finished
episode. Because it is deterministic, the trusted side can replay an untrusted worker's episode
and refuse any observation the environment would not have produced (`episode.replay`).

  base.py      the `Environment` record and `Reply`
  episode.py   an episode as one token sequence with a mask of the model's tokens; running one
               from a sampling callback, and replaying a submitted one
  builtin.py   the shipped environments: `calculator` (a tool called inside the answer) and
               `guess` (find a hidden number from higher / lower feedback)
  registry.py  environments by name; adding one is one module and one `register` call
"""
