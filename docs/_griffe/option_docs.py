"""A griffe extension for the manual: each slimopt optimizer class is documented with the
docstring it has when imported, whose options section slimopt generates from its option table
(``slimopt.options.OPTIONS``), so the page shows every option with that class's default."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import griffe


class OptionDocs(griffe.Extension):
    """Replace a slimopt optimizer class's docstring by its runtime one."""

    def on_class_instance(self, *, node: Any, cls: griffe.Class, agent: Any, **kwargs: Any) -> None:
        # The optimizer classes live in one module; importing only it keeps the build light.
        if cls.module.path != "slimopt.optimizers" or cls.docstring is None:
            return
        from slimopt import SlimoptOptimizer

        runtime = getattr(importlib.import_module(cls.module.path), cls.name, None)
        if isinstance(runtime, type) and issubclass(runtime, SlimoptOptimizer) and runtime.__doc__:
            cls.docstring.value = inspect.cleandoc(runtime.__doc__)
