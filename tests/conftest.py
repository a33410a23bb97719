import sys
from pathlib import Path

import pytest

# The suite's one OpenBLAS preload: importing the package runs ``_blas.preload()``, and conftest.py is
# imported before any test module imports mlx, so no test module repeats it.
import veloxquant_mlx  # noqa: F401

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _restore_dispatch():
    """Tests may install or uninstall the dispatch point; leave it as found."""
    from veloxquant_mlx.cache import dispatch

    was = dispatch.installed()
    yield
    (dispatch.install if was else dispatch.uninstall)()
