"""`python -m tq_cli` is the `tq` command."""

from tq_cli.app import main

main()
