"""Optional features and the pip extra that installs each.

`pip install fedharness` runs the default benchmark and writes Parquet; Ray, W&B, Optuna (with PostgreSQL),
scikit-learn's data set, the federated data formats (HDF5, Hugging Face) and the privacy accountant come with
extras. Asking for a feature whose extra is missing is one line naming the extra (a ConfigError: exit status 2 on the command line), never a traceback from deep inside.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from fedharness.errors import ConfigError

# import name -> the extra that installs it
EXTRA_OF: dict[str, str] = {
    "ray": "ray",
    "wandb": "wandb",
    "wandb_workspaces": "wandb",
    "optuna": "tune",
    "cmaes": "tune",
    "sqlalchemy": "tune",
    "psycopg": "tune",
    "sklearn": "data",
    "h5py": "federated",
    "datasets": "federated",
    "orjson": "federated",
    "dp_accounting": "privacy",
}


class MissingExtra(ConfigError):
    """A feature needs a package that an extra installs: `pip install 'fedharness[EXTRA]'`."""

    def __init__(self, key: str, value: object, module: str):
        self.extra = EXTRA_OF.get(module.split(".")[0], "all")
        super().__init__(key, value, f"needs the '{self.extra}' extra: pip install 'fedharness[{self.extra}]' "
                                     f"(no module named '{module}')")


def require_extra(module: str, key: str, value: object) -> ModuleType:
    """Import `module` for the feature that config key `key` = `value` asks for, or raise MissingExtra."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        if err.name is not None and module.split(".")[0] != err.name.split(".")[0]:
            raise  # the module is there but one of its own imports is broken: not a missing extra
        raise MissingExtra(key, value, module) from None
