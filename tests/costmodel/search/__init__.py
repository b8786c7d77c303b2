"""Tests of commlab.costmodel.search."""
