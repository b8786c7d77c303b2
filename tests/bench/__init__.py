"""Tests of commlab.bench."""
