"""`python -m ckptlab ...` is the `ckptlab` command."""

from ckptlab.cli import main

main()
