"""Tests of commlab.runtime."""
