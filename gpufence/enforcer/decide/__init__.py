"""Decide: the pure rules, the compute controller and the state machine (no I/O, no clock reads):
one poll's facts in, frozen decisions out."""
