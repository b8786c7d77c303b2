"""commlab's tests: a package, so that every test module has one dotted name (tests/conftest.py)."""
