"""Tests of commlab.costmodel.lowering."""
