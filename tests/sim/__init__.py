"""Tests of commlab.sim."""
