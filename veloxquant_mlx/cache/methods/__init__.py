"""Method implementations. Importing this package imports every module in it, which registers
each built method with ``veloxquant_mlx.cache.base``."""

import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
