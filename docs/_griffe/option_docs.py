"""A griffe extension for the manual: each slimopt optimizer class is documented with the
docstring it has when imported, whose options section slimopt generates from its option table
(``slimopt.options.OPTIONS``), so the page shows every option with that class's default; and
its constructor's defaults are shown as the values they are (``betas=(0.9, 0.999)``), where
the source names them once (``AdamWRule.defaults["betas"]``)."""

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

    def on_function_instance(self, *, node: Any, func: griffe.Function, agent: Any, **kwargs: Any) -> None:
        if func.module.path != "slimopt.optimizers" or func.name != "__init__" or func.parent is None:
            return
        runtime = getattr(importlib.import_module(func.module.path), func.parent.name, None)
        if not isinstance(runtime, type):
            return
        defaults = inspect.signature(runtime.__init__).parameters
        for parameter in func.parameters:
            value = defaults.get(parameter.name)
            if parameter.default is not None and value is not None and value.default is not value.empty:
                parameter.default = repr(value.default)
