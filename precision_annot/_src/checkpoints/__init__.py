"""Checkpoints and the plan: what a checkpoint holds, read without its tensor data
(`reading`), what loading one into an applied model keeps and says (`loading`), and the
`checkpoint` backend of `check` (`checks`)."""
