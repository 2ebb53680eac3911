"""Warm stand-in ranks: CPU processes forked from a process that has already imported torch and the
frameworks, instead of each importing them from cold (docs/launch.md).

- `repro.warm.ranks` (imports torch): start N ranks of a function, wait, exit codes; what the warm
  launcher process and tests that need real ranks call.
- `repro.warm.client` (no torch): the parent's side, which starts a warm launcher process and runs
  jobs in it (`repro run` on CPU stand-ins, `repro table2` across its cells).
- `python -m repro.warm` (this package's __main__): the warm launcher process itself.

Nothing is imported here, so that the parent's side stays free of torch.
"""
