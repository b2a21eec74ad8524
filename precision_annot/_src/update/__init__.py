"""The update half: how each parameter is updated (`rule`), what `apply` says about it and the
step guard (`guard`), state formats (`formats`), the step (`step`) and the optimizer
(`optimizer`).

Importing the package imports nothing of its modules: `runtime` imports the guard while
`optimizer` imports `runtime`.
"""
