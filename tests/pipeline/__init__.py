"""Tests of commlab.pipeline."""
