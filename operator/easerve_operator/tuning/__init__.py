"""HAS (Hybrid Auto Selection): the offline search for (allocation, B, s).

Stage 1 (``stage1``) profiles each stage once and prunes allocations whose bottleneck stage is
already overloaded at the target rate; Stage 2 (``stage2``) refines (allocation, B, s) with a
seeded Optuna TPE study over the survivors. Trials go through the ``TrialRunner`` protocol and
profiling through the ``Profiler`` protocol (``runners``), so the same search runs on the
discrete-event twin today and on Kubernetes rollouts later.

This package imports nothing heavy at import time: ``easerve tune --help`` must stay fast, so
Optuna is imported by ``stage2`` only, and callers import the submodules they need.
"""
