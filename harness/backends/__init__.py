"""Execution backends beyond the in-process one: Ray client-shard actors and cluster handling."""
