"""Tests of commlab.costmodel.calibration."""
