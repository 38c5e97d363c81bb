"""Allow ``python -m routelab ...`` as an alias of the ``routelab`` command."""

import sys

from routelab.cli import main

if __name__ == "__main__":
    sys.exit(main())
