"""The implementation of precision_annot; the public names are re-exported by the package.

Nothing here is public: import from `precision_annot` (and `precision_annot.adapters`).
"""
