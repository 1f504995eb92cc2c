"""The chaos suite: seeded runs of real processes under random faults, each history checked.

``python -m tests.chaos --runs N --seconds S`` plays N new seeds and writes a results file;
``--seed X`` replays one. See docs/invariants.md for what is checked and why it should hold.
"""
