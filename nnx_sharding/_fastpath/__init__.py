"""The fast path: reuse a call's split while its graphs keep their structure.

`cache` holds the split per call site; `snapshot` proves the graphs unchanged; `pointers`
compares object identities in one step; `slots` is the one module that reads flax's
Variable slots directly (probed at import, with a public fallback).
"""
