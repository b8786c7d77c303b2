"""Tests of commlab.costmodel."""
