"""Tests of commlab.runs."""
