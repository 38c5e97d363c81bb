"""The parallel text's cache directory (``load_parallel_text(cache_dir=)``, the experiments' ``--data-dir``)."""

from __future__ import annotations

import pytest

from routelab.data import parallel_text
from routelab.data.errors import DataUnavailable


def test_a_given_directory_without_the_cache_is_named_when_it_cannot_be_built(tmp_path, monkeypatch):
    """A mistyped ``--data-dir`` on a machine without the Debian packages said only how to install
    them; it now names the directory it looked in first."""
    def unavailable(module):
        raise DataUnavailable("mod2imp (Debian libsword-utils) is not installed")

    monkeypatch.setattr(parallel_text, "_export", unavailable)
    typo = tmp_path / "data-cahce"
    with pytest.raises(DataUnavailable, match=r"no cached parallel text at .*data-cahce.*--data-dir.*mod2imp"):
        parallel_text.load_parallel_text(typo)
    assert not typo.exists()  # nothing created
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty"))
    with pytest.raises(DataUnavailable, match=r"^mod2imp"):  # the default location: the install advice alone
        parallel_text.load_parallel_text()
