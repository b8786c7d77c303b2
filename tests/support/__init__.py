"""What the tests share and no test file holds: rank-side cases, models, hand-made inputs.

A test module never imports another test module; what two of them need lives here, importable by
the ranks they spawn as ``tests.support.<module>``.
"""
