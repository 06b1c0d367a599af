"""The aggregator service (aiohttp): rounds, async buffer, auth, checkpoints."""
