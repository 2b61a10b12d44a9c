"""`python -m megainfer.gpucheck --out DIR [--budget-s 420]`: the GPU check, from a plain checkout
with `PYTHONPATH=.` and no install step (its code: megainfer/tools/gpucheck/)."""

import sys

from megainfer.tools.gpucheck.runner import main

if __name__ == "__main__":
    sys.exit(main())
