"""Workloads: one model definition and one data pipeline per paper workload, shared by every framework.

Each workload has a plan (NAME_plan.py: its model section, checks and sample count; no torch), which the
parent reads, and a workload (NAME.py: model, data, loss and metric; torch), which the ranks run; the
registry names both (repro.registry.WORKLOADS). Nothing is imported here, so the plans stay torch-free.
"""
