"""MovieLens-100K as a CTR task: the files (:mod:`.files`: fetched at run time, read and checked) and the
dataset of ``GemBatch``es (:mod:`.dataset`, where the task, the splits and the features are described)."""

from gem_train.data.movielens.dataset import MovieLens100K
from gem_train.data.movielens.files import (
    DataFetchError,
    MovieLensEvents,
    MovieLensFormatError,
    default_cache_dir,
    fetch_movielens_100k,
    read_movielens_100k,
)

__all__ = [
    "DataFetchError",
    "MovieLens100K",
    "MovieLensEvents",
    "MovieLensFormatError",
    "default_cache_dir",
    "fetch_movielens_100k",
    "read_movielens_100k",
]
