"""Sharded data parallelism (ZeRO stages 1-3) on commlab's flat buckets."""
