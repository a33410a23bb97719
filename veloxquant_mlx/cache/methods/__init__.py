"""Method implementations, one module per method, grouped by family (``quantization/``, ``eviction/``,
``crosslayer/``; shared helpers stay here). Importing this package imports every module, which registers
each method with ``veloxquant_mlx.cache.base``; each module is also importable under its pre-family path
(``veloxquant_mlx.cache.methods.kivi``), which earlier releases documented.
"""

import importlib
import pkgutil
import sys

for _info in pkgutil.walk_packages(__path__, prefix=f"{__name__}."):
    _module = importlib.import_module(_info.name)
    if not _info.ispkg and _info.name.count(".") > __name__.count(".") + 1:
        sys.modules.setdefault(f"{__name__}.{_info.name.rsplit('.', 1)[-1]}", _module)
