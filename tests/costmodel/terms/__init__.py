"""Tests of commlab.costmodel.terms."""
