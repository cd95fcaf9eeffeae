"""The bottom layer: what every other package of dtcompile, ``dtcompile.hops`` and ``dynamo_vars`` need.

Named channels (:mod:`~dtcompile.base.channels`), the graph notation, the torch
contract and the compatibility layer over the supported releases, scoped
patches, sizes, op facts (names, collectives, view families), progress, the DTensor sharding-cache helpers and the folders
beside the compile cache.  Nothing here imports another package of ours, so
``dtcompile.hops`` and ``dynamo_vars`` reach it without loading the backend (the
``dtcompile`` package itself loads its names lazily, see its ``__init__``).
"""
