"""``python -m tinyserve``: parse the command line into configs and run the server."""

import os
import sys

# Before numpy/torch load: numpy threads inside Triton's CPU interpreter only slow it down.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from tinyserve.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
