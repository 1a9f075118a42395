"""`python -m holeblend_runtime.lookup_server` is `holeblend-lookup`."""

from holeblend_runtime.lookup_server.cli import main

if __name__ == "__main__":
    main()
