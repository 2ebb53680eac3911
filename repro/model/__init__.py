"""The cost model: what a run holds, sends and costs per GPU, in closed form from its recipe, with no torch.

    terms      what the model knows of a run (Cell) and what it says of it (Prediction); shared terms
    costs      bytes held and sent by the data- and tensor-parallel frameworks; the front (predict, compare)
    pipelines  the same for torchgpipe, PyTorch's pipeline schedules and PipeDream, stage by stage
    flops      floating-point operations of a step per GPU and per process, by phase, every framework
    platforms  a machine as data: rates, bandwidths, dispatch cost, collectives by scope (configs/platforms/)
    time       a step's time per framework on a platform: compute, exposed communication, bubbles; epochs
    predict    the model over the Table 2 matrix's recipes: `repro predict`, --fit, the paper-scale figures
    check      a run's counters against the model: what every run logs at its end, and reports/model_check's rows

Its derivations are in docs/memory.md, docs/flops.md and docs/time.md; tests/test_costmodel.py,
tests/test_time.py and reports/model_check.* hold it against the counters and measured steps.
"""
