"""`swarmrl serve`: an OpenAI-compatible HTTP server over the project's batched sampler."""
