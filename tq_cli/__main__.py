"""`python -m tq_cli` is the `tq` command."""

from tq_cli.app import main

if __name__ == "__main__":  # not when a spawned worker imports this module
    main()
