"""Tests of commlab.collectives."""
