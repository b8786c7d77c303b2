"""`python -m commlab.cli`: the same as the `commlab` command."""

from commlab.cli import main

main()
