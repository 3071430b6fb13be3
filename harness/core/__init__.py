"""The core engine: the round loop, executors and client shards, random streams, recorded series, checkpoints."""
