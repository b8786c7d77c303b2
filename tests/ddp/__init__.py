"""Tests of commlab.ddp."""
