"""Tests of commlab.cli."""
