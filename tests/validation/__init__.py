"""Tests of commlab.validation."""
