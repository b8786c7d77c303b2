"""Tests of commlab.sweep."""
