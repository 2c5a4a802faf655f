"""``python -m pageshare.golden``: the command line of cli.py."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
