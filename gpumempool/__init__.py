"""gpumempool: GPU memory pools with the allocator you choose.

A caching allocator engine written in Go (torch's CUDACachingAllocator
semantics: 512-byte rounding, small/large pools, best fit, split/merge,
stream-ordered reuse, OOM retry), shipped as one extension module that also
exports torch's pluggable-allocator C functions::

    import gpumempool as gmp
    with gmp.MemPool(backend="sim") as pool:
        ptr = pool.alloc(1000, device=0, stream=0)
        pool.free(ptr)
        print(pool.stats()["allocated_bytes.all.peak"])
        path, alloc_sym, free_sym = pool.pluggable_symbols()

The ``sim`` backend (a simulated device) works everywhere; user allocator
functions make the ``callback`` backend.
"""

from ._locate import load_installed as _load_installed

# Imported from a source checkout without a built extension, while an
# installed copy exists: the import system hands out the installed module.
if _load_installed(__name__, __file__) is None:
    from ._api import *  # noqa: F401,F403
    from ._api import __all__, __version__  # noqa: F401
