import sys
from pathlib import Path

import pytest

import veloxquant_mlx  # noqa: F401  (loads OpenBLAS before any test imports mlx)

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _restore_dispatch():
    """Tests may install or uninstall the dispatch point; leave it as found."""
    from veloxquant_mlx.cache import dispatch

    was = dispatch.installed()
    yield
    (dispatch.install if was else dispatch.uninstall)()
