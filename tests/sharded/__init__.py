"""Tests of commlab.sharded."""
