"""The optimizer core: the ``torch.optim`` shell (``shell``) and the engine beside it.

One update of one unit (a parameter, or one expert of a stacked parameter) reads the unit's
``Plan`` (``plan``: what the unit is, worked out once) and one ``Update`` record (``update``:
what this step brings); ``update.apply`` is the one dispatcher choosing the path: the
reference path (``reference``), the fused step (``fused``), slices of rows (``rows``) or the
small tensors together (``fused``). ``moments`` keeps the stored moments, ``refresh`` the
projection basis, ``decisions`` the non-finite votes, ``units`` the experts' views, counters
and seeds, ``weights`` the writes into the parameters.
"""
