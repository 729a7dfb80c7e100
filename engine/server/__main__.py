"""`python -m engine.server --model DIR ...`: the engine server (engine/server/main.py).

Guarded: the spawned engine process imports its parent's main module again (as __mp_main__),
and must not start a second server."""

import sys

from engine.server.main import main

if __name__ == "__main__":
    sys.exit(main())
