"""The analysis behind ``analyze-image``: from guests of a golden image to the blocks they keep.

Start from analyze.analyze(): guests (vm, workload), host KSM (ksm,
hostmap), guest memory (dump, crash_backend with classify, drgn_backend,
debugsyms), from a guest page to a verified base-image block (mapping), the
runs summed up (aggregate), the results database (resultsdb) and its
notebooks (notebook, ``pageshare report``; datafiles finds them and the
crash extension).
"""
