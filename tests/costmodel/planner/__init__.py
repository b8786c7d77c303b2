"""Tests of commlab.costmodel.planner."""
