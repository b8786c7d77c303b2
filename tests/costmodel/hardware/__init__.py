"""Tests of commlab.costmodel.hardware."""
